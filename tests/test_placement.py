"""Where attnviz puts its tensors, proven on the CPU for every entry point (docs/gpu.md#placement).

Each entry point runs twice on the same tiny model: on the CPU, and with the model's weights on a simulated
second device (tests/elsewhere.py) on which any operation that mixes a CPU tensor with the model's tensors
fails, as it does on CUDA. The second run must finish and give the first run's numbers. A mask, index or
buffer made on the CPU and used with the model's tensors (the Why page's crash on a GPU: its mask was made on
the CPU) fails here."""

import numpy as np
import pytest
import torch

from attnviz import capture, regions
from attnviz.plan import Keep
from attnviz.effects import dataset, embedding, evaluate, explain, generate, heads, streaming
from attnviz.kv import compress

from elsewhere import Misplaced, elsewhere, to_host
from tiny import loaded

TEXT = "The keeper lit the lamp, and the ships passed the rocks all night long."
DOCS = [TEXT, "A second lamp burned in the window until the dawn came up over the sea.",
        "The storm broke the old pier in two, and the keeper rowed out to mend it."]


def both(run, kind: str = "llama"):
    """``run(loaded)`` on the CPU, then with the model elsewhere: both results (the second on the host)."""
    on_cpu = run(loaded(kind))
    lm = loaded(kind)
    with elsewhere(lm.model):
        assert lm.model.device.type == "meta"
        there = to_host(run(lm))
    return on_cpu, there


def test_the_simulated_device_fails_where_a_gpu_would():
    lm = loaded("llama")
    with elsewhere(lm.model):
        weight = lm.model.model.embed_tokens.weight.detach()
        with pytest.raises(Misplaced):
            weight.masked_fill(torch.ones(weight.shape, dtype=torch.bool), 0.0)  # a mask made on the CPU
        with pytest.raises(Misplaced):
            weight + torch.ones(weight.shape[-1])
        made = torch.zeros(3, device=lm.model.device)  # made on the model's device: fine
        assert (weight[:3, 0] + made).device == lm.model.device
        assert float(weight[0, 0] + torch.tensor(1.0)) == pytest.approx(float(weight[0, 0]) + 1)  # a CPU scalar: fine
        with pytest.raises((TypeError, RuntimeError, NotImplementedError)):
            weight.numpy()  # as on a GPU: copy to the host first
        np.testing.assert_array_equal(weight.cpu().numpy(), to_host(weight).numpy())


@pytest.mark.parametrize("kind", ["llama", "gemma2", "gpt_oss", "gpt2"])
@pytest.mark.parametrize("options", [dict(), dict(statistics=True, pool=8, scores=True, value_norms=True),
                                     dict(scores=True, value_norms=True, qkv=True, hidden_states=True, activations=True),
                                     dict(checkpoints=2)], ids=["maps", "statistics", "extras", "checkpoints"])
def test_capture(kind, options):
    if options.get("checkpoints") and kind == "gpt2":
        pytest.skip("GPT-2 cannot resume a forward from a layer's input")
    if kind == "gpt2":  # its Conv1D projection has no value-weighted view (a clear refusal, tested elsewhere)
        options = {k: v for k, v in options.items() if k != "value_norms"}
    a, b = both(lambda lm: capture(lm, TEXT, "mask0-bidir(k=2)", Keep(storage_dtype=torch.float32, **options)), kind)
    for layer in a.layers:
        if options.get("statistics"):
            for name, value in a.stats[layer].items():
                np.testing.assert_allclose(b.stats[layer][name], value, atol=1e-5, equal_nan=True, err_msg=name)
        else:
            np.testing.assert_allclose(b.layer_probs(layer), a.layer_probs(layer), atol=1e-5)
    np.testing.assert_allclose(b.next_logprobs, a.next_logprobs, atol=1e-4)


@pytest.mark.parametrize("spec", ["fwd", "stablemask(gamma=0.5)", "nosink-fwd*3"])
def test_regions(spec):
    a, b = both(lambda lm: regions.region(lm, TEXT, spec, 1, (40, 70), (0, 30)))
    np.testing.assert_allclose(b.values, a.values, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "gpt_oss", "gpt2"])
def test_explain_probabilities_sink_key_diagnosis_and_query_key_view(kind):
    def why(lm):
        run = explain.KeptForward(lm, TEXT, "fwd", upto=2)
        return (run.probabilities(2, 1), run.sink_key(2, 1), run.explain(2, 1, "all", 0).score,
                explain.diagnose(run, 2).key_side, explain.query_key_view(run, 2, 1).points)

    a, b = both(why, kind)
    np.testing.assert_allclose(b[0].numpy(), a[0].numpy(), atol=1e-5)
    assert b[1] == a[1] and b[2] == pytest.approx(a[2], abs=1e-4)
    np.testing.assert_allclose(np.asarray(b[3]), np.asarray(a[3]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(b[4]), np.asarray(a[4]), atol=1e-4)


def test_heads():
    a, b = both(lambda lm: heads.taxonomy(lm, [TEXT], s=2, w=8))
    np.testing.assert_allclose(b.alpha0, a.alpha0, atol=1e-5)
    np.testing.assert_allclose(b.ahon, a.ahon, atol=1e-4)


def test_compress():
    ids = [3 + (i * 7) % 87 for i in range(200)]
    a, b = both(lambda lm: compress.compress(lm, ids, context=100, ratios=(0.5,)))
    assert [r["press"] for r in b.as_json()["presses"]] == [r["press"] for r in a.as_json()["presses"]]
    assert b.dense.perplexity == pytest.approx(a.dense.perplexity, rel=1e-5)
    for mine, theirs in zip(b.rows, a.rows):
        assert mine.perplexity == pytest.approx(theirs.perplexity, rel=1e-4)


@pytest.mark.parametrize("policy", ["dense", "sink(s=2, w=8)", "window(w=8)"])
def test_streaming(policy):
    ids = list(range(3, 60))
    a, b = both(lambda lm: streaming.stream(lm, ids, policy))
    np.testing.assert_allclose(b.token_nll, a.token_nll, atol=1e-4)


@pytest.mark.parametrize("policy", ["dense", "sink(s=2, w=8)"])
def test_generation(policy):
    a, b = both(lambda lm: generate.generate(lm, TEXT, policy=policy, max_new_tokens=6))
    assert b.new_ids == a.new_ids


def test_evaluation():
    a, b = both(lambda lm: evaluate.evaluate(lm, TEXT, "nosink-fwd*3", window=32, stride=16))
    np.testing.assert_allclose(b.token_nll, a.token_nll, atol=1e-4)


def test_embeddings_and_dataset_sinks():
    a, b = both(lambda lm: (embedding.probe(lm, DOCS, m=4), dataset.sinks(lm, DOCS, max_len=16, n_samples=4)))
    assert b[0].recall_at_1 == a[0].recall_at_1 and b[0].mrr == pytest.approx(a[0].mrr)
    np.testing.assert_allclose(b[1].alpha, a[1].alpha, atol=1e-5, equal_nan=True)


def test_a_statistics_capture_sends_its_results_to_the_host_without_waiting():
    """During the forward, each finished layer's statistics and pooled maps leave the device by asynchronous
    copies (pinned memory on a GPU) and nothing waits on a copy but the key ranges' one read per mask; the run
    waits once, after the forward (docs/gpu.md#placement)."""
    import elsewhere

    lm = loaded("llama")
    phases = []
    lm.model.register_forward_pre_hook(lambda *a: phases.append(len(elsewhere.TRANSFERS)))
    lm.model.register_forward_hook(lambda *a: phases.append(len(elsewhere.TRANSFERS)))
    with elsewhere.elsewhere(lm.model):
        elsewhere.TRANSFERS.clear()
        cap = capture(lm, TEXT, "fwd", Keep(statistics=True, pool=8))
        during = elsewhere.TRANSFERS[phases[0]:phases[1]]
    waits = [t for t in during if t[0] == "wait"]
    assert len(waits) <= 1, waits  # the key ranges of the one mask, read once
    assert sum(t[0] == "async" for t in during) >= len(cap.layers) * 2  # statistics and pooled maps, every layer
    assert set(cap.stats[0]) >= {"alpha", "entropy", "pooled"} and isinstance(cap.stats[0]["alpha"], np.ndarray)


@pytest.mark.parametrize("route", ["blocks", "fused"])
def test_a_capture_copies_nothing_to_the_device_layer_by_layer(route, monkeypatch):
    """A copy of a host tensor to a GPU waits for everything queued before it (from pageable memory PyTorch
    synchronises the stream), so a copy a layer keeps the host from running ahead of the device, and on a small model
    the capture's time becomes the host's plus the device's (docs/gpu.md#the-hosts-share-measured-on-a-cpu). The
    positions, the padding and the delimiter flags go to the device once a run, on the block route and on the fused
    route (its kernel's launch counted, not run: only where tensors are is tested here)."""
    import elsewhere
    from attnviz.core.engine import routes
    from attnviz.core.kernel import kernels

    launches = []
    if route == "fused":
        monkeypatch.setattr(kernels, "available", lambda: True)
        monkeypatch.setattr(kernels, "kernel", lambda: type("Launch", (), {
            "__getitem__": lambda self, grid: lambda *a, **k: launches.append(grid)})())
    lm = loaded("llama")
    phases = []
    lm.model.register_forward_pre_hook(lambda *a: phases.append(len(elsewhere.TRANSFERS)))
    lm.model.register_forward_hook(lambda *a: phases.append(len(elsewhere.TRANSFERS)))

    def uploads(keep):
        phases.clear()
        with elsewhere.elsewhere(lm.model), routes.forcing(fused=route == "fused"):
            elsewhere.TRANSFERS.clear()
            cap = capture(lm, TEXT, "fwd", keep)
            assert len(cap.layers) == len(keep.layers or range(lm.n_layers)) and lm.n_layers >= 3
            return [t for t in elsewhere.TRANSFERS[phases[0]:phases[1]] if t[0] == "upload"]

    for statistics in (True, ["alpha"]):  # with and without the delimiters
        every = uploads(Keep(statistics=statistics, pool=8))
        assert len(every) <= 3 and len(every) == len(uploads(Keep(statistics=statistics, pool=8, layers=[1]))), every
    assert launches if route == "fused" else not launches


def test_other_accelerators_copy_to_the_host_and_wait(monkeypatch):
    """Only CUDA's copies are queued (an event says when they land); on MPS or XPU a queued copy to the host may be
    read before it lands, so there the copy waits."""
    import elsewhere
    from attnviz.core.model import devices

    lm = loaded("llama")
    with elsewhere.elsewhere(lm.model):
        made = torch.arange(4.0, device=lm.model.device)
        elsewhere.TRANSFERS.clear()
        assert devices.HostCopy(made).result().tolist() == [0.0, 1.0, 2.0, 3.0]
        assert [kind for kind, _ in elsewhere.TRANSFERS] == ["async"]  # the simulated device copies as CUDA does
        monkeypatch.setattr(devices, "ASYNC_COPIES", {"cuda"})  # as MPS or XPU
        elsewhere.TRANSFERS.clear()
        assert devices.HostCopy(made).result().tolist() == [0.0, 1.0, 2.0, 3.0]
        assert [kind for kind, _ in elsewhere.TRANSFERS] == ["wait"]


# --- the newer analyses: the scan, paths, patching, the valley, routes, the emergence table, the attention kinds ----

def test_the_causal_scan_and_activation_patching():
    from attnviz.effects.causal import scan
    from attnviz.effects.patching import patching

    def run(lm):
        return (scan(lm, TEXT, leaders=False),
                patching(lm, "The cat sat on the mat and", "The dog sat on the hat and", "P", "R", site="resid"))

    (a, pa), (b, pb) = both(run)
    assert [c.source for c in b.checks] == [c.source for c in a.checks] and b.necessary == a.necessary
    for mine, theirs in zip(b.checks, a.checks):
        # float32's limit between devices (docs/methods.md#devices): SDPA on the simulated device is torch's math form
        np.testing.assert_allclose(mine.after.attention, theirs.after.attention, atol=1e-4, equal_nan=True)
    np.testing.assert_allclose(pb.effect, pa.effect, atol=1e-4)


def test_path_patching():
    from attnviz.effects.paths import paths

    a, b = both(lambda lm: paths(lm, TEXT, "fwd", "mlp.0", "attn.1,keys.2,mlp.1,head,all"), "gemma3_text")
    assert b.after.keys() == a.after.keys()
    for key, profile in a.after.items():
        np.testing.assert_allclose(b.after[key].attention, profile.attention, atol=1e-5, equal_nan=True)
        assert b.after[key].perplexity == pytest.approx(profile.perplexity, rel=1e-5)


def test_the_compression_valley():
    from attnviz.effects import valley

    a, b = both(lambda lm: valley.measure(lm, TEXT * 3, "fwd"))
    np.testing.assert_allclose(b.entropy, a.entropy, atol=1e-5)
    np.testing.assert_allclose(b.first_norm, a.first_norm, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])
def test_routes(kind):
    """Every layer's contributions: the Routes page's trace, on the torch path a device without Triton takes."""
    from attnviz.flow.trace import trace

    a, b = both(lambda lm: trace(lm, TEXT), kind)
    assert b.sink_keys == a.sink_keys
    for mine, theirs in zip(b.layers, a.layers):
        np.testing.assert_allclose(mine.dense(b.n_heads, b.n_tokens), theirs.dense(a.n_heads, a.n_tokens), atol=1e-5)
        np.testing.assert_allclose(mine.mlp, theirs.mlp, atol=1e-5)


@pytest.mark.parametrize("kind", ["softpick", "sigmoid", "sink(logit=0)"])
def test_each_attention_kind_and_the_emergence_measures(kind):
    from attnviz.lab import emergence
    from attnviz.recipe import Recipe

    probe = emergence.Probe.of(torch.arange(3, 27))

    def run(lm):
        recipe = Recipe.of(lm, "fwd", kind=kind)
        return capture(lm, TEXT, recipe, Keep(storage_dtype=torch.float32)), emergence.measure(lm, probe, recipe)

    (a, ra), (b, rb) = both(run)
    for layer in a.layers:
        np.testing.assert_allclose(b.layer_probs(layer), a.layer_probs(layer), atol=1e-5)
    assert len(rb) == len(ra)
    for mine, theirs in zip(rb, ra):
        for name, value in theirs.items():
            assert mine[name] == pytest.approx(value, rel=1e-4, abs=1e-5, nan_ok=True), name
