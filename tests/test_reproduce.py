"""`attnviz reproduce`: one PDF, a page per paper's headline figure, each with its
claim, the number measured here, the published number and the command; parsed back with pypdf."""

import json

import pytest
from pypdf import PdfReader

from attnviz.cli import main


@pytest.fixture(scope="module")
def pdf(model_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("repro") / "repro.pdf"
    assert main(["reproduce", "--quick", "--out", str(out)]) == 0
    return out


def page_text(page) -> str:
    return " ".join(page.extract_text().split())


def test_every_section_is_a_page_with_its_numbers(pdf):
    reader = PdfReader(pdf)
    meta = json.loads(reader.metadata["/Keywords"])
    assert meta["sections"] == ["shifting", "streaming", "sinkrate", "ksweep", "residual"]
    assert len(reader.pages) == 5
    numbers = meta["numbers"]
    pages = [page_text(p) for p in reader.pages]
    for text, title in zip(pages, ["Sink shifting (seed 000, Fig F–K)", "StreamingLLM: the window break",
                                   "Sink rate, Gu et al.'s protocol", "Embedding k-sweep (seed 000)",
                                   "Residual recompute methods (seed 003)"]):
        assert title in text, title
        for part in ("Claim:", "Measured here:", "Published:", "Regenerate: attnviz"):
            assert part in text, (title, part)
    shifting, streaming, rate, sweep, res = pages
    assert f"{numbers['shifting']['shift_rate_m1']:.1%}" in shifting  # the measured number, as printed
    assert numbers["shifting"]["shift_rate_m1"] > 0.5  # the sink moves: most heads go from key 0 to key 1
    assert numbers["shifting"]["top_key_mass_mask0_bidir"] < numbers["shifting"]["top_key_mass_fwd"] / 2
    s = numbers["streaming"]
    assert f"dense {s['dense']:.2f}" in streaming and "13.8" in streaming  # measured, and the documented figure (docs/methods.md#cache-policies)
    assert s["window"] > 1.5 * s["dense"] and s["sink"] < s["window"]  # the window breaks, sinks repair it
    assert f"{numbers['sinkrate']['rate']:.1%}" in rate and "T = 64, eps = 0.3" in rate
    assert "--sweep k" in sweep and "recall@1" in sweep
    assert "13.18" in res and "baseline" in res  # seed 003's published table


def test_a_bad_section_is_one_line_and_exit_2(model_cache, tmp_path, capsys):
    assert main(["reproduce", "--only", "shifting,nope", "--out", str(tmp_path / "r.pdf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown section 'nope'" in err[0]
    assert main(["reproduce", "--out", str(tmp_path / "r.png")]) == 2
    assert not list(tmp_path.iterdir())


def test_the_effects_page_makes_the_same_pdf(model_cache, tmp_path):
    from test_app import app_test, on_page

    at = app_test(tmp_path)
    at.run()
    on_page(at, "pages/effects.py")
    at.radio(key="fx_section").set_value("Paper reproductions").run()
    at.multiselect(key="fx_rep_only").set_value(["sinkrate"]).run()
    at.toggle(key="fx_rep_quick").set_value(True).run()
    at.button(key="fx_rep_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    text = " ".join(str(m.value) for m in at.markdown)
    assert "Sink rate, Gu et al.'s protocol" in text and "Measured here: model-wide sink rate" in text
    button = at.get("download_button")
    assert any("Download reproductions" in b.proto.label for b in button)
