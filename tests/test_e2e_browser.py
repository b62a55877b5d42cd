"""The app end to end: `streamlit run app.py` on localhost, driven in Debian's headless Chromium."""

import io
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from appserver import browser_page, running_app, wait_for_app  # noqa: E402

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not shutil.which("chromium") and not os.environ.get("ATTNVIZ_REQUIRE_BROWSER"), reason="needs chromium (bash scripts/setup.sh dev)")]

PAGES = {"Attention sinks": "Attention sinks", "Sink shifting": "Sink shifting", "Compare A vs B": "Compare A vs B",
         "Heads": "Heads: sinks", "Effects": "Effects", "Mask designer": "Mask designer", "Walkthrough": "Walkthrough: attention",
         "Heatmaps": "Attention heatmaps"}


def chart_title(page) -> str:
    return page.locator('[data-testid="stMain"] [data-testid="stPlotlyChart"] .gtitle').first.text_content()


def wait_title(page, prefix: str) -> None:
    page.wait_for_function("() => [...document.querySelectorAll('[data-testid=\"stMain\"] .gtitle')]"
                           f".some(e => e.textContent.startsWith({prefix!r}))", timeout=60_000)


def wait_viewer(page, expected: str, timeout: int = 60_000) -> None:
    page.wait_for_function(f"() => [...document.querySelectorAll('.avz-title')].some(e => e.textContent === {expected!r})",
                           timeout=timeout, polling=20)


def chart_on_page(page, url: str, has_text: str):
    """Open ``url``, wait for the chart whose text has ``has_text`` and for the script to finish; the chart, in view."""
    page.goto(url)
    chart = page.locator('[data-testid="stMain"] [data-testid="stPlotlyChart"]').filter(has_text=has_text).first
    chart.wait_for(timeout=240_000)
    wait_for_app(page)
    no_exception(page)
    chart.scroll_into_view_if_needed()
    return chart


@pytest.fixture(scope="module")
def app_url(model_cache, tmp_path_factory):
    """One server for the tests that only open pages, each test in a browser session of its own; the tests of a
    fresh server, of the server's log and of shared mode start their own (this one logs elsewhere)."""
    with running_app(log_path=tmp_path_factory.mktemp("app") / "streamlit.log") as url:
        yield url


def no_exception(page) -> None:
    assert page.locator('[data-testid="stException"]').count() == 0
    assert "Traceback" not in page.locator('[data-testid="stMain"]').inner_text()


def test_app_in_a_real_browser(app_url, tmp_path):
    url = app_url
    with browser_page() as page:
        page.goto(url)
        wait_for_app(page)
        no_exception(page)
        wait_viewer(page, "layer 29 · fwd · mean over heads")  # the instant viewer (attnviz.viewer)

        # move the layer slider with the keyboard: the browser repaints, the model does not re-run
        slider = page.locator(".avz-layer")
        slider.focus()
        slider.press("Home")
        wait_viewer(page, "layer 0 · fwd · mean over heads")

        # a click on the overview's tile (layer 5, head 2) opens it; a slider move after it is not undone
        overview = page.locator('[data-testid="stMain"] [data-testid="stPlotlyChart"]').filter(
            has_text="every layer × head").first
        overview.scroll_into_view_if_needed()
        area = overview.locator(".nsewdrag").first.bounding_box()
        page.mouse.click(area["x"] + area["width"] * (2 * 12 + 6) / (9 * 12),
                         area["y"] + area["height"] * (5 * 12 + 6) / (30 * 12))
        wait_viewer(page, "layer 5 · fwd · head 2 (KV group 0)")
        wait_for_app(page)  # the click's rerun done: on a busy machine its stale viewer lingers beside the new one
        page.wait_for_function("() => document.querySelectorAll('.avz-layer').length === 1", timeout=60_000)
        slider.focus()
        slider.press("ArrowRight")
        wait_viewer(page, "layer 6 · fwd · head 2 (KV group 0)")
        page.wait_for_timeout(1500)  # the viewer reports where it rests; the export follows
        wait_for_app(page)
        wait_viewer(page, "layer 6 · fwd · head 2 (KV group 0)")

        # export the heatmap as a PDF and check the file
        page.get_by_text("Export this figure").first.click()
        page.get_by_role("button", name="Prepare file").first.click()
        download_button = page.get_by_role("button", name="Download attnviz").first
        download_button.wait_for(timeout=120_000)
        with page.expect_download(timeout=60_000) as info:
            download_button.click()
        target = tmp_path / info.value.suggested_filename
        info.value.save_as(target)
        data = target.read_bytes()
        assert target.suffix == ".pdf" and data.startswith(b"%PDF")
        from pypdf import PdfReader

        reader = PdfReader(io.BytesIO(data))
        assert len(reader.pages) == 1 and '"arch": "fwd"' in reader.metadata["/Keywords"]
        assert '"layer": 6' in reader.metadata["/Keywords"] and '"head": 2' in reader.metadata["/Keywords"]

        # every page opens without an exception
        for name, heading in PAGES.items():
            page.locator('[data-testid="stSidebarNav"]').get_by_text(name, exact=True).click()
            page.locator('[data-testid="stMain"] h1').filter(has_text=heading).first.wait_for(timeout=120_000)
            if name == "Effects":  # its computations start on request: ask for the default perplexity comparison
                page.get_by_role("button", name="Compute perplexity").click()
            drawn = ".avz-canvas" if name == "Heatmaps" else '[data-testid="stMain"] [data-testid="stPlotlyChart"]'
            page.locator(drawn).first.wait_for(timeout=120_000)
            wait_for_app(page)
            no_exception(page)


def test_heads_page_tile_opens_its_heatmap(app_url):
    """The Heads page's layer × head grid; a click on a tile opens that head's heatmap below it."""
    url = app_url
    with browser_page() as page:
        grid = chart_on_page(page, f"{url}/heads", "head taxonomy")
        area = grid.locator(".nsewdrag").first.bounding_box()
        page.mouse.click(area["x"] + area["width"] * (4 + 0.5) / 9, area["y"] + area["height"] * (3 + 0.5) / 30)
        wait_title(page, "layer 3 ")
        titles = page.locator('[data-testid="stMain"] [data-testid="stPlotlyChart"] .gtitle').all_text_contents()
        assert "layer 3 · fwd · head 4 (KV group 1)" in titles
        no_exception(page)


@pytest.mark.parametrize("path,heading", [("compare", "Compare A vs B"), ("sinks", "Attention sinks"),
                                          ("walkthrough", "Walkthrough: attention"), ("effects", "Effects")])
def test_a_page_url_works_as_the_first_request_of_a_fresh_server(model_cache, path, heading):
    """streamlit#9624: with a pages/ folder, the first request used to run the page without app.py."""
    with running_app() as url, browser_page() as page:
        page.goto(f"{url}/{path}")
        page.locator('[data-testid="stMain"] h1').filter(has_text=heading).first.wait_for(timeout=180_000)
        if path == "effects":  # computes on request: its button is the sign that the page ran to the end
            page.get_by_role("button", name="Compute perplexity").wait_for(timeout=180_000)
        else:
            wait_for_app(page)
        no_exception(page)
        nav = page.locator('[data-testid="stSidebarNav"]').inner_text()
        assert "Heatmaps" in nav and "Mask designer" in nav  # the app's navigation, not a bare file list
        assert page.locator('[data-testid="stSidebar"] textarea').count() >= 1  # the shared sidebar is there


def test_nothing_is_fetched_from_outside_the_server(app_url):
    """Offline: the page icon (the tab's favicon) and the navigation's icons are shipped with the app; Streamlit
    fetches a ":material/…:" page icon from fonts.gstatic.com, which fails without the internet."""
    url = app_url
    with browser_page() as page:
        outside: list[str] = []
        page.on("request", lambda r: None if r.url.startswith((url, "data:", "blob:")) else outside.append(r.url))
        page.goto(f"{url}/walkthrough")
        page.locator('[data-testid="stMain"] h1').filter(has_text="Walkthrough: attention").first.wait_for(
            timeout=180_000)
        wait_for_app(page)
        page.wait_for_function("() => document.querySelector('link[rel~=icon]')?.href")
        icon = page.evaluate("() => document.querySelector('link[rel~=icon]').href")
        no_exception(page)
    assert icon.startswith(url) and outside == [], (icon, outside)


def test_an_abandoned_capture_stops_at_a_layer_boundary(model_cache, tmp_path):
    """New input, or another page, while a long capture runs: it stops after the current layer
    (Streamlit interrupts at the progress report) instead of running all 30 layers."""
    from conftest import ENGLISH

    log = tmp_path / "streamlit.log"  # this test's own server log (another worker may run a server too)
    long_text = " ".join([ENGLISH] * 30)  # ~1,300 tokens: seconds per layer here

    def start_long_capture(page, text):
        area = page.locator('[data-testid="stSidebar"] textarea').first
        area.fill(text)
        area.press("Control+Enter")
        page.wait_for_function("() => [...document.querySelectorAll('[data-testid=\"stProgress\"]')]"
                               ".some(e => /Capturing fwd.*: [2-9]\\/30/.test(e.textContent))", timeout=180_000)

    def abandoned(count: int) -> list[tuple[int, int]]:
        """The (layer reached, layers) of each abandoned capture in the server's log, once there are ``count``."""
        import re
        import time

        deadline = time.time() + 120
        while True:
            found = [(int(d), int(t)) for d, t in re.findall(r"abandoned Capturing fwd.*? at (\d+)/(\d+)",
                                                             log.read_text())]
            if len(found) >= count or time.time() > deadline:
                return found
            time.sleep(0.5)

    with running_app(log_path=log) as url, browser_page() as page:
        page.goto(url)
        wait_for_app(page)
        start_long_capture(page, long_text)
        # new input: a short text replaces the long one mid-capture
        area = page.locator('[data-testid="stSidebar"] textarea').first
        area.fill("A short text instead.")
        area.press("Control+Enter")
        first = abandoned(1)
        assert len(first) == 1 and 2 <= first[0][0] < first[0][1] == 30, first
        page.locator('[data-testid="stCaptionContainer"]').filter(has_text=" 5 tokens").first.wait_for(timeout=120_000)
        wait_for_app(page)
        no_exception(page)

        start_long_capture(page, long_text + " Again.")  # another page: the mask designer
        page.locator('[data-testid="stSidebarNav"]').get_by_text("Mask designer", exact=True).click()
        page.locator('[data-testid="stMain"] h1').filter(has_text="Mask designer").first.wait_for(timeout=60_000)
        wait_for_app(page)
        second = abandoned(2)
        assert len(second) == 2 and 2 <= second[1][0] < 30, second
        no_exception(page)


def test_the_why_page_opens_from_a_heatmaps_link_and_draws_its_figures(app_url):
    """The Heatmaps page links each head's sink column to the Why page, which opens at that cell in the same
    session (the sidebar's text kept) and draws the attribution, the layer's diagnosis and the query-key view."""
    url = app_url
    with browser_page() as page:
        page.goto(url)
        page.locator(".avz-canvas").first.wait_for(timeout=120_000)
        wait_for_app(page)
        link = page.get_by_text("Explain: why head 0 of layer 29 attends to key", exact=False).first
        link.wait_for(timeout=60_000)
        link.click()
        page.locator('[data-testid="stMain"] h1').filter(has_text="Why: what makes").first.wait_for(timeout=120_000)
        wait_title(page, "layer 29 head 0, all")
        wait_title(page, "layer 29: where each head")
        wait_title(page, "layer 29 head 0: queries and keys")
        assert "layer=29" in page.url and "head=0" in page.url
        no_exception(page)

        # a click on a query in the query-key view draws its attention row and moves the attribution to it
        chart = page.locator('[data-testid="stMain"] [data-testid="stPlotlyChart"]').filter(
            has_text="queries and keys after").first
        chart.scroll_into_view_if_needed()
        target = chart.evaluate("""(el) => {
            const gd = el.querySelector('.js-plotly-plot'), L = gd._fullLayout, box = gd.querySelector('.nsewdrag').getBoundingClientRect();
            const px = (t, i) => [box.left + L.xaxis.l2p(t.x[i]), box.top + L.yaxis.l2p(t.y[i])];
            const all = gd._fullData.flatMap(t => Array.from(t.x, (_, i) => px(t, i)));
            let best = [-1, -1];  // the query farthest from every other point: a click cannot pick another
            Array.from(gd._fullData[0].x, (_, i) => {
                const [x, y] = px(gd._fullData[0], i);
                const gap = Math.min(...all.map(([a, b]) => Math.hypot(a - x, b - y)).filter(d => d > 0.01));
                if (i > 0 && gap > best[1]) best = [i, gap];
            });
            return [best[0], ...px(gd._fullData[0], best[0])];
        }""")
        query, x, y = target
        page.mouse.move(x, y)
        page.wait_for_timeout(300)
        page.mouse.click(x, y)
        wait_title(page, f"layer 29 head 0: the attention row of query {query} ")
        wait_title(page, f"layer 29 head 0, query {query} → key 0")
        no_exception(page)

        # at 1,500 px every metric shows its whole value, and the query-key view's legend keeps off its colour bar
        shown = page.evaluate("""() => [...document.querySelectorAll('[data-testid="stMetricValue"] div')]
            .map(e => [e.textContent, e.scrollWidth > e.clientWidth + 1])""")
        assert len(shown) >= 4 and not [text for text, cut in shown if cut], shown
        overlap = chart.evaluate("""(el) => {
            const a = el.querySelector('.legend').getBoundingClientRect(), b = el.querySelector('.colorbar').getBoundingClientRect();
            return !(a.right <= b.left || b.right <= a.left || a.bottom <= b.top || b.bottom <= a.top);
        }""")
        assert not overlap

        # "Test it": the picked source patched at the sink token, the sink's attention per layer before and after
        button = page.locator('[data-testid="stMain"] button').filter(has_text="Test it").first
        button.scroll_into_view_if_needed()
        button.click()
        wait_title(page, "Attention on the sink key, per layer, with ")
        page.locator('[data-testid="stMetricLabel"]').filter(has_text="Perplexity of this text").first.wait_for()
        no_exception(page)


def test_a_shared_server_refuses_paths_outside_its_roots(model_cache, tmp_path, monkeypatch):
    """Shared mode in a real browser: a model directory and a results folder outside the roots get one line
    each, and nothing is read; the remote-code switch is not there."""
    root = tmp_path / "root"
    (root / "results").mkdir(parents=True)
    monkeypatch.setenv("ATTNVIZ_SHARED", "1")
    monkeypatch.setenv("ATTNVIZ_ROOTS", str(root))
    with running_app() as url, browser_page() as page:
        page.goto(url)
        wait_for_app(page)
        sidebar = page.locator('[data-testid="stSidebar"]')
        assert sidebar.get_by_text("trust remote code").count() == 0
        assert sidebar.get_by_text("anyone who reaches this port", exact=False).count() == 1
        model = sidebar.get_by_label("Model", exact=True).and_(sidebar.locator("input"))
        model.fill("/etc")
        model.press("Enter")
        sidebar.get_by_text("reads only under", exact=False).first.wait_for(timeout=60_000)
        page.locator('[data-testid="stSidebarNav"]').get_by_text("Sweeps", exact=True).click()
        page.locator('[data-testid="stMain"] h1').filter(has_text="Sweeps").first.wait_for(timeout=60_000)
        folder = page.locator('[data-testid="stMain"] input[aria-label="Results folder"]')
        folder.fill("../..")
        folder.press("Enter")
        page.locator('[data-testid="stMain"]').get_by_text("reads only under", exact=False).first.wait_for(timeout=60_000)
        folder.fill(str(root / "results"))
        folder.press("Enter")
        page.locator('[data-testid="stMain"]').get_by_text("No results in", exact=False).first.wait_for(timeout=60_000)
        no_exception(page)


# the pixel of a point of a Plotly trace (subplots included): the chart's element, trace index, point index
POINT_PX = """(el, [t, i]) => {
    const gd = el.querySelector('.js-plotly-plot'), L = gd._fullLayout, d = gd._fullData[t];
    const xa = L[d.xaxis.replace('x', 'xaxis')], ya = L[d.yaxis.replace('y', 'yaxis')];
    const box = gd.getBoundingClientRect();
    return [box.left + xa._offset + xa.l2p(d.x[i]), box.top + ya._offset + ya.l2p(d.y[i])];
}"""


def test_a_click_on_a_routes_attention_edge_opens_that_heads_heatmap(app_url):
    """The Routes page's graph: a click on an attention edge's midpoint opens that head's heatmap on the Heatmaps
    page (the viewer at that layer and head)."""
    url = app_url
    with browser_page() as page:
        chart = chart_on_page(page, f"{url}/routes", "routes of token")
        # the heaviest attention edge of the first panel whose midpoint no other drawn point is near
        found = chart.evaluate("""(el) => {
            const gd = el.querySelector('.js-plotly-plot');
            const t = gd._fullData.findIndex(d => d.customdata && d.customdata.length && d.customdata[0].length === 7);
            const d = gd._fullData[t];
            const picks = Array.from(d.customdata.keys()).filter(i => d.customdata[i][2] === 'attn'
                && d.customdata[i][1] >= 0 && d.customdata[i][6] === 0);
            const near = (i) => Array.from(d.x.keys()).filter(j => j !== i && Math.abs(d.x[j] - d.x[i]) < 0.6
                && Math.abs(d.y[j] - d.y[i]) < 0.6).length;
            picks.sort((a, b) => near(a) - near(b) || d.customdata[b][5] - d.customdata[a][5]);
            return [t, picks[0], d.customdata[picks[0]][0], d.customdata[picks[0]][1]];
        }""")
        trace, index, layer, head = found
        x, y = chart.evaluate(POINT_PX, [trace, index])
        page.mouse.move(x, y)
        page.wait_for_timeout(300)
        page.mouse.click(x, y)
        page.locator('[data-testid="stMain"] h1').filter(has_text="Attention heatmaps").first.wait_for(timeout=120_000)
        wait_viewer(page, f"layer {layer} · fwd · head {head} (KV group {head // 3})", timeout=120_000)
        no_exception(page)


def boxes_overlap(a: dict, b: dict) -> bool:
    return a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"] and \
        a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"]


def test_five_pages_figures_read_as_a_paper_figure(model_cache, tmp_path):
    """What a reader of a paper figure would notice, as Chromium draws it (each chart's screenshot in tmp_path): the
    overview's maps are square; the sink map's legend covers none of the key axis's tokens; the Heads page's sink
    number is its legend's; the Mask designer's tiles are numbered and keyed, StableMask's bar names its pseudo-scores;
    Sink shifting's top maps have query and key axis titles."""
    with running_app() as url, browser_page() as page:
        chart = chart_on_page(page, url, "every layer × head")
        chart.screenshot(path=str(tmp_path / "overview.png"))
        area = chart.locator(".nsewdrag").first.bounding_box()  # the plot: 9 heads across, 30 layers down
        assert abs(area["width"] / 9 - area["height"] / 30) < 0.03 * area["height"] / 30, area

        chart = chart_on_page(page, f"{url}/sinks", "where the sinks are")
        chart.screenshot(path=str(tmp_path / "sink-map.png"))
        legend = chart.locator(".legend").first.bounding_box()
        ticks = [t.bounding_box() for t in chart.locator(".xtick").all()]
        assert len(ticks) > 3 and not [t for t in ticks if boxes_overlap(legend, t)]

        chart = chart_on_page(page, f"{url}/heads", "head taxonomy")
        chart.screenshot(path=str(tmp_path / "heads.png"))
        sinks = page.locator('[data-testid="stMetricValue"]').first.inner_text()  # "157 (58%)"
        assert f"sink: {sinks}" in chart.locator(".legend").first.text_content()

        chart = chart_on_page(page, f"{url}/designer", "mask of every layer")
        chart.screenshot(path=str(tmp_path / "masks.png"))
        for axis in "xy":  # every tile's numbers: .xtick, .x2tick, ... (6 a side at the page's 12 tokens)
            assert chart.locator(f'g[class^="{axis}"][class$="tick"]').count() >= 30 * 6, axis
        assert "may attend" in chart.locator(".legend").first.text_content()
        stable = page.locator('[data-testid="stMain"] [data-testid="stPlotlyChart"]').filter(
            has_text="StableMask pseudo-attention").first
        stable.scroll_into_view_if_needed()
        stable.screenshot(path=str(tmp_path / "stablemask.png"))
        assert "pseudo-score" in stable.locator(".colorbar").first.text_content()

        chart = chart_on_page(page, f"{url}/shifting", "mass per key")
        chart.screenshot(path=str(tmp_path / "shift.png"))
        titles = chart.locator(".g-xtitle, .g-x2title, .g-x3title, .g-x4title, .g-ytitle").all_text_contents()
        assert titles.count("key") >= 4 and "query" in titles, titles
        no_exception(page)
