"""Static export through kaleido and Debian's chromium: valid files with the metadata inside."""

import io
import os
import shutil

import pytest

from attnviz.figures import export
from attnviz.capture import capture
from attnviz.figures import heatmap

from tiny import loaded

pytestmark = pytest.mark.skipif(not shutil.which("chromium") and not os.environ.get("ATTNVIZ_REQUIRE_BROWSER"), reason="needs chromium (bash scripts/setup.sh dev)")


@pytest.fixture(scope="module")
def figure_and_meta():
    cap = capture(loaded("llama"), "export me", "nosink-fwd")
    return heatmap(cap, 1, head=2), export.describe(cap, 1, 2)


@pytest.mark.parametrize("fmt", export.FORMATS)
def test_export_formats_carry_metadata(figure_and_meta, fmt):
    fig, meta = figure_and_meta
    data = export.figure_bytes(fig, fmt, meta, preset="paper-single")
    magic = {"png": b"\x89PNG", "svg": b"<svg", "pdf": b"%PDF"}[fmt]
    assert data.startswith(magic)
    got = export.read_metadata(data, fmt)
    assert got["arch"] == "nosink-fwd" and got["layer"] == 1 and got["head"] == 2
    assert got["model"] == "tiny-llama" and got["text"] == "export me" and got["dtype"] == "float32"
    if fmt == "pdf":
        from pypdf import PdfReader

        page = PdfReader(io.BytesIO(data)).pages[0]
        assert float(page.mediabox.width) == pytest.approx(340 * 0.75, rel=0.05)  # 340 px = 3.5 in column, in pt
    if fmt == "png":
        from PIL import Image

        assert Image.open(io.BytesIO(data)).size[0] == 340 * 3


def test_unknown_format_and_preset(figure_and_meta):
    fig, meta = figure_and_meta
    with pytest.raises(export.ExportError, match="unknown format"):
        export.figure_bytes(fig, "bmp", meta)
    with pytest.raises(export.ExportError, match="unknown preset"):
        export.figure_bytes(fig, "png", meta, preset="poster")
