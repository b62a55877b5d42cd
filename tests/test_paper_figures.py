"""Golden layout checks of exported figures, on the rendered files, not by pixel equality:
no grey outside the matrix, the matrix fills the figure, token labels never overlap, one font
family (serif when asked), the title only when asked, a colour-bar label that says what is plotted."""

import io
import os
import re
import shutil

import numpy as np
import pytest

from attnviz.figures import export
from attnviz.capture import capture
from attnviz.figures import heatmap, sink_grid
from conftest import ENGLISH

pytestmark = pytest.mark.skipif(not shutil.which("chromium") and not os.environ.get("ATTNVIZ_REQUIRE_BROWSER"),
                                reason="needs chromium (bash scripts/setup.sh dev)")
GREY = (201, 201, 201)  # figures.style.MASKED


@pytest.fixture(scope="module")
def cap(default_model):
    return capture(default_model, ENGLISH, "nosink-fwd*30")  # masked cells: the future and key 0


def _svg(fig, **options) -> str:
    return export.figure_bytes(fig, "svg", {}, **options).decode()


def _ticks(svg: str, axis: str) -> tuple[list[float], list[float]]:
    """Positions along the axis and font sizes of the tick labels (attribute order varies)."""
    along, sizes = [], []
    for tag in re.findall(rf'class="{axis}tick"><text([^>]*)>', svg):
        x, y = re.search(r'transform="translate\(([-\d.]+),([-\d.]+)\)', tag).groups()
        along.append(float(x) if axis == "x" else float(y))
        sizes.append(float(re.search(r"font-size: ([\d.]+)px", tag).group(1)))
    return along, sizes


@pytest.mark.parametrize("preset", ["paper-single", "paper-double"])
@pytest.mark.parametrize("font", ["sans", "serif"])
@pytest.mark.parametrize("log", [False, True])
def test_heatmap_exports_meet_the_paper_bars(cap, preset, font, log):
    fig = heatmap(cap, 29, None, log=log)
    svg = _svg(fig, preset=preset, font=font, title=False)
    width, height = (float(v) for v in re.search(r'<svg[^>]*width="([\d.]+)" height="([\d.]+)"', svg).groups())
    image = re.search(r'<g class="hm"><image[^>]*height="([\d.]+)" width="([\d.]+)"', svg)
    side_h, side_w = float(image.group(1)), float(image.group(2))
    # 1. the matrix fills the figure, and grey sits exactly under the matrix, nowhere else
    assert side_w * side_h >= 0.3 * width * height, (side_w, side_h, width, height)  # labels and bar take the rest
    grey = re.findall(r'd="M([\d.]+),([\d.]+)H([\d.]+)V([\d.]+)H[\d.]+Z" style="opacity: 1;[^"]*fill: rgb\(201, 201, 201\)',
                      svg)
    assert len(grey) == 1
    x0, y0, x1, y1 = (float(v) for v in grey[0])
    assert abs((x1 - x0) - side_w) <= 1.5 and abs((y1 - y0) - side_h) <= 1.5
    assert svg.count("rgb(201, 201, 201)") == 1
    png = export.figure_bytes(fig, "png", {}, preset=preset, font=font, title=False, scale=1)
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    is_grey = (pixels == GREY).all(-1)
    inside = np.zeros_like(is_grey)
    inside[int(y0) - 1:int(np.ceil(y1)) + 1, int(x0) - 1:int(np.ceil(x1)) + 1] = True
    assert is_grey[inside].sum() > 0.1 * inside.sum()  # the masked half of the matrix is grey ...
    assert is_grey[~inside].sum() <= 0.002 * is_grey.size  # ... and outside it only stray text antialiasing
    ink = np.nonzero((pixels < 245).any(-1))
    margins = [ink[0].min() / pixels.shape[0], 1 - ink[0].max() / pixels.shape[0],
               ink[1].min() / pixels.shape[1], 1 - ink[1].max() / pixels.shape[1]]
    assert max(margins) <= 0.1, margins  # no empty bands around the figure
    # 2. token labels never overlap: neighbours at least one line apart along each axis
    for axis in ("x", "y"):
        along, sizes = _ticks(svg, axis)
        assert len(along) >= 8, axis  # labels are thinned, not dropped
        gaps = np.diff(sorted(along))
        assert gaps.min() >= max(sizes) * 0.99, (axis, gaps.min(), max(sizes))
    # 3. one font family everywhere, serif when asked
    families = set(re.findall(r"font-family: ([^;]+);", svg))
    assert len(families) == 1, families
    assert ("Times" in families.pop()) == (font == "serif")
    # 4. no title unless asked
    assert 'class="gtitle"' not in svg
    assert 'class="gtitle"' in _svg(fig, preset=preset, font=font, title=True)
    # 5. the colour bar says what is plotted
    label = re.search(r'class="cbtitle"[^>]*><text[^>]*>([^<]+)</text>', svg).group(1)
    assert label == ("log10 attention" if log else "attention")


def test_other_figures_share_font_and_title_rules(cap):
    svg = _svg(sink_grid(cap, 0), preset="paper-double", font="serif", title=False)
    families = set(re.findall(r"font-family: ([^;]+);", svg))
    assert len(families) == 1 and "Times" in families.pop()
    assert 'class="gtitle"' not in svg
    with pytest.raises(export.ExportError, match="unknown font"):
        export.styled(sink_grid(cap, 0), font="comic")
