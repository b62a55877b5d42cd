"""The Routes page through AppTest on the real default model: the graph, its threshold and heads, two architectures
on one scale, the sink's share, the logit lens, the export, opening a head's heatmap, and bad input."""

import numpy as np

from test_app import app, arr, charts, on_page  # noqa: F401 - app is a fixture

TEXT = "The capital of France is Paris. The capital of Italy is"


def _graph(at):
    return next(c for c in charts(at) if "routes of token" in c["layout"]["title"]["text"])


def _edge_points(chart):
    return [p for trace in chart["data"] if trace.get("customdata") and len(trace["customdata"][0]) == 7
            for p in trace["customdata"]]


def test_the_routes_page_draws_two_architectures_and_follows_its_controls(app):  # noqa: F811
    app.text_area(key="text").input(TEXT).run()
    on_page(app, "pages/routes.py")
    assert not app.error, [e.value for e in app.error]
    graph = _graph(app)
    assert [a["text"] for a in graph["layout"]["annotations"][:2]] == ["fwd", "nosink-fwd"]
    edges = _edge_points(graph)
    panels = {e[6] for e in edges}
    assert panels == {0, 1}
    # FWD: some attention edge from key 0 is drawn in the sink colour; NoSink-FWD's sink is key 1
    sink_traces = [t for t in graph["data"] if t.get("name") == "attention from the sink key"]
    assert sink_traces
    share = next(c for c in charts(app) if "from the sink key" in c["layout"]["title"]["text"])
    assert len(share["data"]) == 4 and len(arr(share["data"][0]["y"])) == 30
    # a higher threshold keeps fewer edges; heads summed gives head -1
    before = len(edges)
    app.slider(key="rt_threshold").set_value(0.15).run()
    assert len(_edge_points(_graph(app))) < before
    app.radio(key="rt_heads").set_value("sum").run()
    assert {e[1] for e in _edge_points(_graph(app)) if e[2] == "attn"} == {-1}
    # the logit lens of the top node: the model's next token after "... Italy is"
    tables = [t.value for t in app.dataframe]
    assert tables and "Rome" in "".join(tables[0]["promoted"].astype(str))


def test_an_attention_edge_opens_its_heads_heatmap(app):  # noqa: F811
    app.text_area(key="text").input(TEXT).run()
    on_page(app, "pages/routes.py")
    app.checkbox(key="rt_compare").set_value(False).run()
    chosen = app.selectbox(key="rt_edge").value
    app.button(key="rt_open").click().run()
    assert not app.exception, [e.value for e in app.exception]
    assert app.session_state["hm_jump_view"]["layer"] == chosen.layer
    assert app.session_state["hm_jump_view"]["head"] == chosen.head
    assert app.title[0].value == "Attention heatmaps"


def test_bad_input_on_the_routes_page_is_one_message(app):  # noqa: F811
    app.text_area(key="text").input(TEXT).run()
    on_page(app, "pages/routes.py")
    app.text_input(key="rt_other").input("fwd*2 + bidr*2").run()
    assert not app.exception
    assert any("bidr" in e.value for e in app.error)


def test_the_page_draws_the_librarys_graph(app, default_model):  # noqa: F811
    from attnviz import flow

    app.text_area(key="text").input(TEXT).run()
    on_page(app, "pages/routes.py")
    drawn = sorted((e[0], e[1], e[2], e[3], e[4], e[5]) for e in _edge_points(_graph(app)) if e[6] == 0)
    g = flow.graph(flow.trace(default_model, TEXT), -1, 0.04)
    want = sorted((e.layer, -1 if e.head is None else e.head, e.via, e.source, e.target, round(e.weight, 4))
                  for e in g.edges)
    assert [d[:5] for d in drawn] == [w[:5] for w in want]
    np.testing.assert_allclose([d[5] for d in drawn], [w[5] for w in want], atol=2e-4)
    app.checkbox(key="rt_renormalise").check().run()  # each node's kept edges divided by their sum
    drawn = sorted((e[0], e[1], e[2], e[3], e[4], e[5]) for e in _edge_points(_graph(app)) if e[6] == 0)
    g = flow.graph(g.flow, -1, 0.04, renormalise=True)
    want = sorted((e.layer, -1 if e.head is None else e.head, e.via, e.source, e.target, round(e.weight, 4))
                  for e in g.edges)
    assert [d[:5] for d in drawn] == [w[:5] for w in want]
    np.testing.assert_allclose([d[5] for d in drawn], [w[5] for w in want], atol=2e-4)
    assert any("JSON" in b.proto.label for b in app.get("download_button"))


def test_the_logit_lens_shows_whitespace_tokens_as_escapes(app):  # noqa: F811
    """After "...test.\n" the top node promotes a newline: shown as \\n, as every page shows a token, not blank."""
    app.text_area(key="text").input("Hello world.\nThis is a test.\n").run()
    on_page(app, "pages/routes.py")
    app.checkbox(key="rt_compare").set_value(False).run()
    assert not app.exception, [e.value for e in app.exception]
    shown = [str(v) for table in app.dataframe for column in ("promoted", "suppressed")
             for v in table.value[column]]
    assert "\\n" in shown
    assert all(v.strip() and "\n" not in v for v in shown), shown
