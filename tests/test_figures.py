"""Figures are pure functions of capture data: checked on a tiny model's captures, no Streamlit."""

import numpy as np
import plotly.graph_objects as go
import pytest

from attnviz.effects import compare
from attnviz.figures import export
from attnviz.core.spec.arch import parse
from attnviz.capture import capture
from attnviz.plan import Keep
from attnviz.figures import (allocation_bars, architecture_masks, difference, heatmap, key_profile, overview, panels,
                             shift_panels, sink_grid, sink_map, stablemask_pseudo, tile_at)
from attnviz.effects.heads import Taxonomy
from attnviz.figures.heads import head_classes
from attnviz.figures.style import LOG_FLOOR, MASKED, max_pool

from tiny import loaded


@pytest.fixture(scope="module")
def lm():
    return loaded("llama")


def test_heatmap_marks_masked_cells_apart_from_zero(lm):
    cap = capture(lm, "a short text", "nosink-fwd")
    fig = heatmap(cap, 2, head=1)
    z = np.asarray(fig.data[0].customdata, dtype=float)
    assert np.isnan(z[0, 1]) and np.isnan(z[5, 0])  # future key, hidden first key: masked (NaN)
    assert z[0, 0] == pytest.approx(1.0)  # query 0 keeps itself
    grey = [s for s in fig.layout.shapes if s.fillcolor == MASKED]  # NaN cells show grey, exactly under the cells
    assert len(grey) == 1 and (grey[0].x0, grey[0].x1, grey[0].y0, grey[0].y1) == (-0.5, len(z) - 0.5, -0.5, len(z) - 0.5)
    assert fig.layout.plot_bgcolor != MASKED  # and nowhere else
    assert "head 1 (KV group 0)" in fig.layout.title.text
    mean = heatmap(cap, 2)
    np.testing.assert_allclose(np.nan_to_num(np.asarray(mean.data[0].customdata, dtype=float)),
                               np.where(cap.allowed[2], cap.layer_probs(2).mean(0), 0), atol=1e-6)


def test_large_heatmaps_ship_an_image_not_numbers(lm):
    cap = capture(lm, "x" * 300, "fwd", Keep(layers=[1]))
    fig = heatmap(cap, 1)
    assert isinstance(fig.data[0], go.Image) and fig.data[0].source.startswith("data:image/png;base64,")
    assert fig.data[0].z is None
    assert len(fig.to_json()) < 300 * 300  # far below n² numbers


def test_max_pool_keeps_sinks_visible():
    values = np.zeros((8, 8))
    values[5, 0] = 0.9
    values[0, 7] = np.nan
    pooled = max_pool(values, 4)
    assert pooled.shape == (4, 4) and pooled[2, 0] == 0.9
    all_nan = np.full((4, 4), np.nan)
    assert np.isnan(max_pool(all_nan, 2)).all()


def test_log_and_row_normalisation(lm):
    cap = capture(lm, "some tokens here", "fwd")
    fig = heatmap(cap, 0, head=0, row_normalise=True)
    z = np.asarray(fig.data[0].z, dtype=float)
    np.testing.assert_allclose(np.nanmax(z, 1), 1.0)
    log = heatmap(cap, 0, head=0, log=True)
    assert np.nanmax(np.asarray(log.data[0].z, dtype=float)) <= 0  # log10 of probabilities


def test_shared_scale_across_panels(lm):
    a, b = capture(lm, "shared scale", "fwd"), capture(lm, "shared scale", "bidir")
    fig = panels([a, b], ["A", "B"], 1)
    heat = [t for t in fig.data if isinstance(t, go.Heatmap)]
    assert len({(t.zmin, t.zmax) for t in heat}) == 1


def test_the_top_pair_of_maps_has_a_title_and_axis_titles(lm):
    a, b = capture(lm, "shared scale", "fwd"), capture(lm, "shared scale", "bidir")
    fig = panels([a, b], ["A", "B"], 1)
    assert "layer 1" in fig.layout.title.text and "mean over heads" in fig.layout.title.text
    assert fig.layout.xaxis.title.text == fig.layout.xaxis2.title.text == "key"
    assert fig.layout.yaxis.title.text == "query"
    assert "head 0" in panels([a, b], ["A", "B"], 1, head=0).layout.title.text


@pytest.mark.parametrize("arch_b", ["nosink-bidir", "nosink-fwd"])
def test_the_difference_greys_only_the_cells_both_masks_hide(lm, arch_b):
    """B − A with a masked cell read as 0 on the side that masks it (a forbidden key gets no attention): where B
    attends and A may not (the upper triangle under a bidirectional B), B's attention shows; key 0, which FWD attends
    and NoSink hides, shows A's attention with a minus sign; grey (NaN) only where both hide a cell."""
    a, b = capture(lm, "the difference of two maps", "fwd"), capture(lm, "the difference of two maps", arch_b)
    z = np.asarray(difference(a, b, 2).data[0].z, dtype=float)
    pa = np.where(a.allowed[2], a.layer_probs(2).mean(0), 0)
    pb = np.where(b.allowed[2], b.layer_probs(2).mean(0), 0)
    hidden = ~a.allowed[2] & ~b.allowed[2]
    assert np.array_equal(np.isnan(z), hidden)
    np.testing.assert_allclose(z[~hidden], (pb - pa)[~hidden], atol=1e-6)
    assert (z[1:, 0] < 0).all()  # key 0: FWD attends, NoSink hides
    if arch_b == "nosink-bidir":
        assert not hidden.any() and (z[np.triu_indices_from(z, 1)] > 0).all()
    else:
        assert hidden[np.triu_indices_from(hidden, 1)].all()


def test_overview_click_maps_to_layer_and_head(lm):
    cap = capture(lm, "overview tiles", "fwd")
    fig = overview(cap, tile=12)
    assert np.asarray(fig.data[0].z).shape == (3 * 12, 4 * 12)
    assert tile_at(cap, x=3 * 12 + 1, y=2 * 12 + 5, tile=12) == (2, 3)


def test_log_overview_spans_its_colour_scale(lm):
    """The log mosaic holds log10 p (<= 0): its range is [log10 floor, max], not the linear [0, ...]
    that painted every tile the lowest colour."""
    cap = capture(lm, "overview tiles in log colours", "fwd")
    trace = overview(cap, tile=4, log=True).data[0]
    z = np.asarray(trace.z, dtype=float)
    assert trace.zmin == np.log10(LOG_FLOOR) and trace.zmax == np.nanmax(z) <= 0
    assert np.nanmin(z) >= trace.zmin and np.nanmax(z) > trace.zmin


def test_heatmap_image_colours_are_the_colour_scale_and_masked_grey(lm):
    import base64
    import io

    from PIL import Image

    cap = capture(lm, "x" * 300, "fwd", Keep(layers=[1]))
    fig = heatmap(cap, 1, head=0)
    rgb = np.asarray(Image.open(io.BytesIO(base64.b64decode(fig.data[0].source.split(",")[1]))).convert("RGB"))
    values = max_pool(np.where(cap.allowed[1], cap.layer_probs(1)[0], np.nan), 512)
    grey = tuple(int(MASKED[i:i + 2], 16) for i in (1, 3, 5))
    assert rgb.shape[:2] == values.shape
    assert (rgb[np.isnan(values)] == grey).all()  # masked cells (above the diagonal) are grey
    top = np.unravel_index(np.nanargmax(values), values.shape)  # the largest weight: the darkest blue
    low = np.unravel_index(np.nanargmin(values), values.shape)
    assert tuple(rgb[top]) == (8, 48, 107) and rgb[low].sum() > rgb[top].sum()


def test_sink_figures(lm):
    cap = capture(lm, "sinks, everywhere.", "fwd")
    profile = key_profile(cap, 0)
    assert len(profile.data) == 3 and all(t.showlegend for t in profile.data)
    np.testing.assert_allclose(profile.data[0].y, cap.layer_probs(0)[:, :, 0].mean(0), atol=1e-6)
    many = key_profile(cap, 0, layers=[0, 1, 2] * 3)  # past LEGEND_MAX curves: a colour bar for the layer
    curves, bar = many.data[:-1], many.data[-1]
    assert len(curves) == 9 and not any(t.showlegend for t in many.data)
    assert bar.marker.showscale and bar.marker.colorbar.title.text == "layer" and (bar.marker.cmin, bar.marker.cmax) == (0, 2)
    reduced = capture(lm, "sinks, everywhere.", "fwd", Keep(statistics=True))
    assert not key_profile(reduced, 1).data and "Only key 0" in key_profile(reduced, 1).layout.annotations[0].text
    bars = allocation_bars(cap)
    total = sum(np.asarray(t.y) for t in bars.data)
    np.testing.assert_allclose(total, 1, atol=1e-3)
    grid = sink_grid(cap, 0, eps=0.0)
    assert np.asarray(grid.data[0].z).all()  # every head has alpha_0 > 0


def test_shift_panels_and_rates(lm):
    a, b = capture(lm, "shift the sink", "fwd"), capture(lm, "shift the sink", "nosink-fwd")
    fig = shift_panels([a, b], ["fwd", "nosink-fwd"], 2)
    bars = [t for t in fig.data if isinstance(t, go.Bar)]
    assert len(bars) == 2 and bars[1].y[0] == pytest.approx(cap0 := b.stat(2, "column_mean").mean(0)[0])
    assert cap0 < 0.2  # key 0 is only seen by query 0 under NoSink
    rates = compare.shift_rates(a, b, 1)
    assert rates.shape == (3,) and ((rates >= 0) & (rates <= 1)).all()


def test_compare_metrics(lm):
    a = capture(lm, "compare me", "fwd", Keep(hidden_states=True))
    same = capture(lm, "compare me", "fwd", Keep(hidden_states=True))
    b = capture(lm, "compare me", "bidir", Keep(hidden_states=True))
    assert compare.kl_divergence(a, same) == pytest.approx(0, abs=1e-9)
    assert compare.kl_divergence(a, b) > 0
    cos = compare.hidden_cosine(a, b)
    assert cos[0] == pytest.approx(1, abs=1e-3) and cos[-1] < 0.999
    top = compare.top_tokens(a, 3)
    assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1]


def test_mask_pictures():
    fig = architecture_masks(parse("mask0&bidir(k=2, k0=1)", 4), n=5)
    tiles = [t for t in fig.data if isinstance(t, go.Heatmap)]
    assert len(tiles) == 4
    np.testing.assert_array_equal(np.asarray(tiles[3].z)[:, 0], [1, 0, 0, 0, 0])
    pseudo = stablemask_pseudo(4, 0.5)
    z = np.asarray(pseudo.data[0].z, dtype=float)
    assert z[0, 3] == pytest.approx(-1.5) and np.isnan(z[3, 0])


def test_the_mask_tiles_are_numbered_square_and_keyed():
    """Every tile shows its query and key positions, is square, and a legend keys its two colours; the axes are named
    once: keys under each column's bottom tile, queries left of each row."""
    fig = architecture_masks(parse("mask0&bidir(k=2, k0=1)", 8), n=12, cols=6)  # rows of 6 and 2 tiles
    for i in range(8):
        sub = fig.get_subplot(i // 6 + 1, i % 6 + 1)
        assert sub.xaxis.showticklabels and sub.yaxis.showticklabels, i
        assert (sub.xaxis.tick0, sub.xaxis.dtick) == (sub.yaxis.tick0, sub.yaxis.dtick) == (0, 2)  # 0, 2, .. 10
        assert sub.yaxis.scaleanchor == sub.yaxis.anchor and sub.yaxis.constrain == "domain"  # square tiles
    bottom = {fig.get_subplot(2, 1).xaxis.title.text, fig.get_subplot(2, 2).xaxis.title.text,
              *(fig.get_subplot(1, c).xaxis.title.text for c in range(3, 7))}
    assert bottom == {"key"} and fig.get_subplot(1, 1).xaxis.title.text is None
    assert fig.get_subplot(1, 1).yaxis.title.text == fig.get_subplot(2, 1).yaxis.title.text == "query"
    key = {t.name: t.marker.color for t in fig.data if isinstance(t, go.Scatter)}
    scale = fig.data[0].colorscale
    assert fig.layout.showlegend and key == {"may attend": scale[-1][1], "masked": scale[0][1]}


def test_the_stablemask_colour_bar_names_the_pseudo_scores_it_shows():
    """The cells above the diagonal are −γ·j, negative logits (docs/methods.md#stablemask), not probabilities P."""
    bar = stablemask_pseudo(6, 0.5).data[0]
    assert np.nanmax(np.asarray(bar.z, dtype=float)) < 0
    title = bar.colorbar.title.text
    assert "pseudo-score" in title and "−γ·j" in title and "P[" not in title


def test_the_sink_maps_legend_is_clear_of_the_key_axis(lm):
    """The legend stands above the plot (its bottom edge at the plot's top or higher): the key axis's tick labels are
    below the plot, where a legend at y < 0 covered three of them."""
    fig = sink_map(capture(lm, "sinks, everywhere.", "fwd"))
    legend = fig.layout.legend
    assert legend.yanchor == "bottom" and legend.y >= 1 and fig.layout.xaxis.side in (None, "bottom")
    assert fig.layout.margin.t >= 100  # room above the plot for the title's two lines and the legend


def test_the_overview_tiles_render_square(lm):
    """Every layer × head map is square as plotly.js draws the figure (an SVG through kaleido): the plot's clip
    rectangle over the heads is as wide as it is tall over the layers, at the figure's own size and on a page
    narrower than it."""
    import re

    cap = capture(lm, "square overview tiles", "fwd")
    fig = overview(cap, tile=12)
    for width in (fig.layout.width, 300):
        svg = go.Figure(fig).update_layout(width=width).to_image(format="svg").decode()
        wide, tall = map(float, re.search(r'class="plotclip"><rect width="([\d.]+)" height="([\d.]+)"', svg).groups())
        assert wide / cap.n_heads == pytest.approx(tall / len(cap.layers), rel=0.02), width
        assert tall / len(cap.layers) >= 8


def test_shift_panels_name_the_top_maps_axes(lm):
    a, b = capture(lm, "shift the sink", "fwd"), capture(lm, "shift the sink", "nosink-fwd")
    fig = shift_panels([a, b], ["fwd", "nosink-fwd"], 2)
    assert [fig.get_subplot(1, c).xaxis.title.text for c in (1, 2)] == ["key", "key"]
    assert fig.get_subplot(1, 1).yaxis.title.text == "query"
    assert [fig.get_subplot(2, c).xaxis.title.text for c in (1, 2)] == ["key", "key"]


def test_head_classes_count_each_class_as_a_hand_count():
    """Two layers of three heads, by hand (eps 0.5, streaming tau 0.9, inactive tau 0.2): sink heads (0,0), (0,1),
    (1,0); streaming (0,0), (1,1); inactive (0,1); none: (0,2), (1,2). Drawn by precedence inactive > streaming > sink:
    (0,0) streaming, (0,1) inactive, so one tile of three sink heads is drawn sink. The legend counts every head that
    holds a class (as the page's numbers do) and how many are drawn, and states the precedence."""
    tax = Taxonomy("m", "fwd", 1, alpha0=np.array([[0.9, 0.9, 0.1], [0.9, 0.2, 0.1]]),
                   streaming_score=np.array([[0.95, 0.1, np.nan], [0.1, 0.95, 0.1]]),
                   ahon=np.array([[1.0, 0.1, 1.0], [1.0, 1.0, 1.0]]), eps=0.5, tau_stream=0.9, tau_inactive=0.2)
    fig = head_classes(tax)
    names = [t.name for t in fig.data if t.name]
    assert names == ["retrieval: 2 (33%)", "sink: 3 (50%), 1 drawn", "streaming: 2 (33%)", "inactive: 1 (17%)"]
    assert "inactive > streaming > sink" in fig.layout.legend.title.text
    hover = np.asarray(fig.data[1].text).reshape(2, 3)
    assert hover[0].tolist() == ["streaming + sink (drawn as streaming)", "inactive + sink (drawn as inactive)",
                                 "retrieval"]
    assert hover[1].tolist() == ["sink", "streaming", "retrieval"]
    assert np.asarray(fig.data[0].text).tolist() == [["streaming", "inactive", "retrieval"],
                                                     ["sink", "streaming", "retrieval"]]


def test_metrics_table_and_filenames(lm):
    cap = capture(lm, "table rows", "fwd")
    frame = export.metrics_frame(cap)
    assert len(frame) == 3 * 4 and {"alpha_0", "sink_key", "kv_group", "discarded_mass"} <= set(frame.columns)
    name = export.filename(export.describe(cap, 2, None), "pdf")
    assert name == "attnviz_tiny-llama_fwd_L2_hmean.pdf"
    assert export.filename({"model": "a/b c", "arch": "mask0&bidir(k=8, k0=4)"}, "png") == \
        "attnviz_a-b_mask0-bidir-k-8-k0-4.png"
