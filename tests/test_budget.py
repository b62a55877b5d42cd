"""Analyses of many forwards sized before they run (docs/methods.md#the-plan-of-an-analysis): path patching, the
causal scan and activation patching make a plan from the model's shape, run their batches in parts that fit the
memory budget, and refuse before any forward where one row does not fit.

Each peak is measured with every allocation tracked (``allocations.py``) on a long generated text: 3,000 characters
of the stdlib's topics (the default corpus) through a tiny Llama of 4,096 positions and a one-character tokenizer,
and the default model on a shorter one. Nothing is timed."""

import io

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import tiny
from allocations import Allocations
from attnviz.core.loading.models import LoadedModel
from attnviz.effects import budget, causal
from attnviz.effects import opening as opening_mod
from attnviz.effects.opening import Opening, perplexities, perplexities_of
from attnviz.effects.patching import patching
from attnviz.effects.paths import paths
from attnviz.errors import InputError

MB = 2**20


def long_model() -> LoadedModel:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    return LoadedModel(model, tiny.CharTokenizer(), "tiny-long", None, 0.0)


def long_text(n: int = 3000) -> str:
    from pydoc_data.topics import topics

    return "".join(c for c in "".join(topics.values()) if 32 <= ord(c) < 127)[:n]


@pytest.fixture(scope="module")
def lm():
    return long_model()


def traced(lm, text, **given):
    plans = []
    with Allocations() as seen:
        found = paths(lm, text, "fwd", "embed,mlp.0", None, on_plan=plans.append, **given)
    return found, plans[-1], seen.peak


def test_a_long_text_s_plan_is_the_peak_it_makes_and_a_budget_below_it_is_kept(lm):
    text = long_text()
    found, plan, peak = traced(lm, text)
    assert plan.n == 3000 and plan.batches == ((0, 9), (1, 13), (2, 8), (3, 10))  # a row a path, by lowest layer
    assert abs(plan.peak - peak) <= 0.2 * peak, (plan.describe(), peak / MB)
    # a budget below that peak: the batches run in parts and stay within it, with the same numbers
    small = plan.held + plan.batch(3)
    split, planned, kept = traced(lm, text, budget=small)
    assert planned.rows == 3 and planned.forwards > plan.forwards, planned.describe()
    assert kept <= small, (kept / MB, small / MB)
    assert split.after.keys() == found.after.keys()
    for key, profile in found.after.items():
        assert split.after[key].attention == pytest.approx(profile.attention, rel=1e-5, abs=1e-7)
        assert split.after[key].perplexity == pytest.approx(profile.perplexity, rel=1e-5)


def test_a_budget_too_small_for_one_row_is_refused_before_any_forward(lm, monkeypatch):
    def no(*args, **kwargs):
        raise AssertionError("a forward ran")

    monkeypatch.setattr(Opening, "forward", no)
    monkeypatch.setattr(Opening, "resume", no)
    text = long_text()
    with pytest.raises(budget.AnalysisTooLarge, match=r"path patching of 3000 tokens needs ~\d+ MB .*a text of at "
                                                      r"most ~\d+ tokens, fewer senders or receivers"):
        paths(lm, text, "fwd", "embed,mlp.0", None, budget=20 * MB)
    with pytest.raises(budget.AnalysisTooLarge, match="the causal scan of 3000 tokens needs"):
        causal.scan(lm, text, budget=20 * MB, leaders=False)
    with pytest.raises(budget.AnalysisTooLarge, match="activation patching of 3000 tokens needs .*or the heads site"):
        patching(lm, text, text[:-1] + "x", metric=lambda logits: logits[:, 5], budget=20 * MB)
    with pytest.raises(InputError, match="a positive number of bytes"):
        paths(lm, text, "fwd", "embed", "head", budget=-5)


def test_the_shorter_text_the_refusal_names_fits(lm):
    text = long_text()
    plans = []
    with pytest.raises(budget.AnalysisTooLarge) as refused:
        paths(lm, text, "fwd", "embed", "head", budget=40 * MB)
    fit = int(str(refused.value).split("at most ~")[1].split(" ")[0])
    assert 0 < fit < 3000
    paths(lm, text[:fit], "fwd", "embed", "head", budget=40 * MB, on_plan=plans.append)
    assert plans[0].one_row() <= 40 * MB


def test_the_default_model_s_plan_at_3000_tokens(default_model):
    """The issue's case: path patching's defaults on 3,000 tokens of the stdlib corpus, planned without a forward."""
    from pydoc_data.topics import topics

    ids = default_model.tokenizer("".join(topics.values()))["input_ids"][:3000]
    text = default_model.tokenizer.decode(ids)
    plans = []

    class Planned(Exception):
        pass

    def stop(plan):
        plans.append(plan)
        raise Planned

    with pytest.raises(Planned):
        paths(default_model, text, "fwd", None, None, on_plan=stop, budget=6000 * MB)
    plan = plans[0]
    assert plan.n == 3000 and plan.openings == 1 and "senders the scan finds" in plan.note
    # every layer's input kept (30 × 3,000 × 576 float32), a row a few hundred MB at most
    assert plan.held == 30 * 3000 * 576 * 4 and 50 * MB < plan.per_row < 300 * MB
    assert plan.peak < 6000 * MB and plan.seconds > 0
    with pytest.raises(Planned):  # named senders: every path's row, the batches split to fit 1 GB
        paths(default_model, text, "fwd", "mlp.0,mlp.11", None, on_plan=stop, budget=1000 * MB)
    assert plans[1].largest < max(rows for _, rows in plans[1].batches) and plans[1].peak <= 1000 * MB
    with pytest.raises(budget.AnalysisTooLarge, match="fewer senders or receivers"):
        paths(default_model, text, "fwd", "mlp.0", None, budget=300 * MB)


def test_the_default_model_s_scan_makes_its_planned_peak(default_model):
    from pydoc_data.topics import topics

    ids = default_model.tokenizer("".join(topics.values()))["input_ids"][:400]
    text = default_model.tokenizer.decode(ids)
    causal.scan(default_model, text[:200], leaders=False)  # first-use caches are not the scan's
    plans = []
    with Allocations() as seen:
        causal.scan(default_model, text, leaders=False, on_plan=plans.append)
    assert abs(plans[0].peak - seen.peak) <= 0.2 * seen.peak, (plans[0].describe(), seen.peak / MB)


@pytest.mark.parametrize("site", ["resid", "heads"])
def test_activation_patching_in_parts_gives_the_same_grid(site):
    lm = tiny.loaded("llama")
    clean, corrupted = "The cat sat on the mat today.", "The dog sat on the mat today."
    whole = patching(lm, clean, corrupted, metric=lambda logits: logits[:, 5], site=site)
    plans = []
    patching(lm, clean, corrupted, metric=lambda logits: logits[:, 5], site=site, on_plan=plans.append)
    small = plans[0].held + max(plans[0].opening, plans[0].batch(2))
    parts = patching(lm, clean, corrupted, metric=lambda logits: logits[:, 5], site=site, budget=small,
                     on_plan=plans.append)
    assert plans[-1].rows < plans[0].largest and plans[-1].forwards > plans[0].forwards
    # a batch of other rows sums in another order: float32 rounding, far below an effect (a share of 1)
    torch.testing.assert_close(torch.tensor(parts.effect), torch.tensor(whole.effect), rtol=1e-4, atol=5e-5)


def test_the_scan_in_parts_gives_the_same_numbers():
    lm = tiny.loaded("llama")
    text = "The quick brown fox jumps over the lazy dog. " * 3
    whole = causal.scan(lm, text, leaders=False)
    plans = []
    causal.scan(lm, text, leaders=False, on_plan=plans.append)
    one = causal.scan(lm, text, leaders=False, budget=plans[0].held + max(plans[0].opening, plans[0].batch(2)),
                      on_plan=plans.append)
    assert plans[-1].rows < 3 and plans[-1].forwards > plans[0].forwards
    assert [c.source for c in one.checks] == [c.source for c in whole.checks]
    for a, b in zip(one.checks, whole.checks):
        assert a.after.attention == pytest.approx(b.after.attention, rel=1e-5, abs=1e-7)


def test_the_perplexity_a_few_positions_at_a_time_is_the_whole_one(monkeypatch):
    """The head read five positions at a time (a final soft cap, Gemma 2's) gives the stock model's perplexity."""
    from attnviz.core.engine import sites

    lm = tiny.loaded("gemma2")
    ids = torch.tensor([list(range(3, 40))] * 2)
    monkeypatch.setattr(budget, "LOGITS_BYTES", tiny.VOCAB * 12 * 5)
    assert opening_mod.chunk_positions(tiny.VOCAB) == 5
    kept = {}
    with torch.no_grad(), sites.hooks(lm.model, [(sites.Site("resid_post", lm.n_layers - 1), sites.save(kept, "top"))]):
        logits = lm.model(ids).logits  # the stock forward, its top layer's output read at the site
    targets = ids[0, 1:]
    assert perplexities_of(lm.model, kept["top"], targets) == pytest.approx(perplexities(logits.float(), targets),
                                                                           rel=1e-5)


def test_progress_lines_when_stderr_is_not_a_terminal(monkeypatch):
    from attnviz.cli.common import Progress

    stream = io.StringIO()
    shown = Progress("path patching", stream=stream)
    monkeypatch.setattr(Progress, "EVERY", 0.0)
    plan = budget.make("path patching", tiny.loaded("llama"), 40, [(0, 4), (1, 4)], given_budget=10**9)
    with shown:
        shown.plan(plan)
        assert stream.getvalue() == ""  # with the first progress line, not before
        for done in range(1, plan.forwards + 1):
            shown.update(done, plan.forwards)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("attnviz: plan: path patching of 40 tokens: 3 forwards")
    assert lines[1].startswith("attnviz: path patching: 1 of 3, ") and "left" in lines[1]
    assert len(lines) == 4


def test_the_cli_refuses_a_run_past_the_memory_budget_in_one_line(capsys, monkeypatch):
    from attnviz.cli import main

    lm = long_model()
    monkeypatch.setattr("attnviz.cli.common.load", lambda args: lm)
    monkeypatch.setenv("ATTNVIZ_MEMORY_MB", "25")
    assert main(["paths", "--text", long_text(), "--senders", "embed", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs ~" in err and "fewer senders or receivers" in err, err


def test_the_pages_plan_under_the_server_s_budget(default_model, tmp_path, monkeypatch):
    """The Patching and Why pages give the library the server's budget and make room for the plan's peak in the
    capture cache (older captures leave); a budget too small for one row is the page's error, before any forward."""
    import ui.cache
    import ui.jobs
    from test_app import app_test, on_page, texts

    ui.jobs._results.clear()  # no result an earlier app test of this process left: the pages plan anew
    made = []
    monkeypatch.setattr(ui.cache, "room_for", made.append)
    at = app_test(tmp_path)
    at.run()
    on_page(at, "pages/patching.py")
    at.button(key="pt_run").click().run()
    assert not at.exception and not at.error, texts(at.error)
    assert [plan.what for plan in made] == ["activation patching"] and made[0].budget == ui.cache.analysis_budget()
    monkeypatch.setattr(ui.cache, "analysis_budget", lambda: 2 * MB)
    at.query_params.update({"layer": "29", "head": "3", "query": "all", "key": "0"})
    on_page(at, "pages/why.py")
    at.text_input(key="why_senders").set_value("mlp.0").run()
    at.button(key="why_paths").click().run()
    assert not at.exception and any("path patching of" in e.value and "needs ~" in e.value for e in at.error), \
        texts(at.error)
