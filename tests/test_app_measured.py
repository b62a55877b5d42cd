"""What the Attention sinks, Sink shifting and Patching pages say is what they measured: the sentence under the sink
map names every key the map rings, the shifting page says where each architecture's sink went on this model and
text (SmolLM2's moves to key m, Gemma 3's to a "."), and the patching page's default example corrupts."""

import numpy as np

from attnviz.capture import capture
from attnviz.effects.compare import main_sink
from attnviz.effects.patching import EXAMPLE

from test_app import app, app_test, arr, charts, on_page, texts, title  # noqa: F401 - app is a fixture


def ranges(layers) -> str:
    """Layers as the pages write them: 2–8, 12, 14–29."""
    runs, start = [], layers[0]
    for prev, cur in zip(layers, layers[1:] + [None]):
        if cur != prev + 1:
            runs.append(str(start) if start == prev else f"{start}–{prev}")
            start = cur
    return ", ".join(runs)


def test_the_sinks_sentence_names_every_key_the_map_rings(app):  # noqa: F811
    """On the lighthouse example SmolLM2's " the" (key 5) is a sink in layers 2–8 beside the first token, and the map
    rings it in red: the sentence below names it too, with those layers, and every other ringed key with its own."""
    on_page(app, "pages/sinks.py")
    where = next(c for c in charts(app) if "where the sinks are" in title(c))
    ringed: dict[int, list[int]] = {}
    for trace in where["data"]:
        if trace.get("type") == "scatter":
            for label, layer in zip(trace["x"], arr(trace["y"])):
                ringed.setdefault(int(label.split()[0]), []).append(int(layer))
    caption = next(c.value for c in app.caption if c.value.startswith("Sinks (alpha > 0.3"))
    assert sorted(ringed[5]) == list(range(2, 9))
    assert "the first 'the' (key 5) in layers 2–8" in caption, caption
    for key, layers in ringed.items():
        layers = sorted(layers)
        assert f"(key {key}) in layer{'s' if len(layers) > 1 else ''} {ranges(layers)}" in caption, (key, caption)


def said(at) -> str:
    return next(m.value for m in at.markdown if m.value.startswith("Measured on"))


def check_shifting(at, loaded) -> str:
    """The page's sentence against the library's reading of captures of the same text and architectures."""
    on_page(at, "pages/shifting.py")
    assert not at.error, texts(at.error)
    sentence = said(at)
    assert "does not remove the sink" not in " ".join(m.value for m in at.markdown)
    specs = [s.strip() for s in at.text_input(key="sh_archs").value.split(";")]
    for spec in specs:
        cap = capture(loaded, at.session_state["text"], spec)
        assert f"under `{cap.arch}`, {main_sink(cap)}" in sentence, (spec, sentence)
    return sentence


def test_the_shifting_page_says_where_the_sink_went(app, default_model):  # noqa: F811
    sentence = check_shifting(app, default_model)
    assert "under `fwd`, the first token (key 0)" in sentence
    assert "under `nosink-fwd`, 'old' (key 1)" in sentence  # SmolLM2: the next key
    assert "under `nosink-fwd(m=2)`, 'lighthouse' (key 2)" in sentence


def test_the_shifting_page_on_gemma3_says_its_sink_went_to_a_full_stop(gemma3_model, model_cache, tmp_path):
    """Gemma 3 does not move its sink to key 1 when key 0 is hidden: the page says where it went."""
    at = app_test(tmp_path)
    at.session_state["model"] = "gemma3-270m"
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    sentence = check_shifting(at, gemma3_model)
    assert "Gemma 3 270M" in sentence
    assert "under `nosink-fwd`, the first '.'" in sentence, sentence


def test_the_patching_example_corrupts(app, default_model):  # noqa: F811
    """The page's default example, the library's: on the default model the clean run prefers the answer and the
    corrupted one the wrong token, with the same number of tokens, so the effects read the right way round."""
    on_page(app, "pages/patching.py")
    shown = {k: app.text_input(key=f"pt_{k}").value for k in ("clean", "corrupted", "answer", "wrong")}
    assert shown == EXAMPLE
    tok = default_model.tokenizer
    answer, wrong = (tok(shown[k], add_special_tokens=False)["input_ids"] for k in ("answer", "wrong"))
    assert len(answer) == len(wrong) == 1
    metric = {}
    for run in ("clean", "corrupted"):
        cap = capture(default_model, shown[run], "fwd")
        metric[run] = (float(cap.next_logprobs[answer[0]] - cap.next_logprobs[wrong[0]]), cap.n_tokens)
    assert metric["clean"][1] == metric["corrupted"][1]
    assert metric["clean"][0] > 0 > metric["corrupted"][0], metric
    assert np.isfinite([m for m, _ in metric.values()]).all()
