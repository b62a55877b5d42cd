"""reducers keep their state on the device of the probabilities they are fed.

This machine has no GPU, so placement is proven on PyTorch's ``meta`` device: a meta tensor has a
shape and a device but no data, and an operation that mixes it with a CPU tensor fails. A reducer
that created any state on the CPU behind its caller's back (the crash seen on CUDA) fails here too.
"""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnviz.core.engine import routes
from attnviz.core.spec import allowsets
from attnviz.core.model import devices
from attnviz.core import engine
from attnviz.core.record import recorders
from attnviz.stats import metrics
from attnviz.core.spec import masks as M
from attnviz.core.record.reduce import LayerSummary, Summaries
from attnviz.regions import _Crop

META = torch.device("meta")
H, N = 3, 10


def _tensors(obj):
    return {name: value for name, value in vars(obj).items() if isinstance(value, torch.Tensor)}


def _blocks(n=N, rows=4, device=META):
    """(q0, k0, probs (1, H, b, w), allow (1, 1, b, w)) blocks of a causal layer, keys narrowed per block."""
    for q0 in range(0, n, rows):
        q1 = min(q0 + rows, n)
        k0, k1 = (1 if q0 else 0), q1
        yield q0, k0, torch.rand(1, H, q1 - q0, k1 - k0, device=device), \
            torch.ones(1, 1, q1 - q0, k1 - k0, dtype=torch.bool, device=device)


def test_summaries_keep_every_state_on_the_meta_device():
    tokens = ["<s>", "a", ",", "b", "\n", "c", ".", "d", "e", "f"]
    summaries = Summaries(tokens, pool=4)
    norms = torch.rand(1, H, N, device=META)
    for q0, k0, probs, allow in _blocks():
        summaries.add(7, q0, probs, allow, n_q=N, k0=k0, n_kv=N, value_norms=norms)
        summaries.add_scores(7, q0, probs, allow, N, N, k0)
    layer = summaries.layers[7]
    state = {**{f"sum {k}": v for k, v in layer.sums.items()}, **_tensors(layer),
             **{k: v for k, v in layer.facts.items() if isinstance(v, torch.Tensor)}}
    assert {"sum colsum", "sum colsum_allowed", "sum rowsum", "sum plogp", "sum diag", "sum key0", "sum delim",
            "col_counts", "row_counts", "self_seen", "key0_allowed", "delim_q", "delim"} <= set(state)
    assert all(t.device == META for t in state.values()), {k: t.device for k, t in state.items()}
    for pooled in (summaries.pooled[7], summaries.pooled_value[7], summaries.pooled_scores[7]):
        assert pooled.values.device == META and pooled.seen.device == META
        assert pooled.tensor().device == META
    results = layer.tensors()
    assert all(v.device == META and v.dtype == torch.float32 for v in results.values())
    assert results["allocation"].shape == (H, N, len(metrics.ALLOCATION_PARTS))


def test_a_region_crop_stays_on_the_meta_device():
    crop = _Crop((2, 7), (0, 5))
    for q0, k0, probs, allow in _blocks():
        crop.add(0, q0, probs, allow, N, k0)
    assert crop.values.device == META and crop.allowed.device == META


@pytest.mark.parametrize("mask", [M.stablemask(0.5), M.stablemask(slopes="alibi", T=32), M.fwd()],
                         ids=["stablemask", "sm-i", "fwd"])
def test_block_probabilities_of_every_mask_kind_run_on_the_meta_device(mask):
    """The StableMask pseudo-logits and SM-I's extra logit are built on the queries' device (they
    were built on the CPU, which crashed on CUDA); so is a learned sink logit (gpt-oss)."""
    pos = torch.arange(N)[None]
    run = engine.Run([mask], frozenset({0}), pos, torch.ones(1, N, dtype=torch.bool))
    q, k = torch.rand(1, H, N, 8, device=META), torch.rand(1, 1, N, 8, device=META)
    allow = torch.ones(1, 1, N, N, dtype=torch.bool, device=META)
    probs = routes.block_probs(run, 0, mask, q, k, 0.35, allow, None, None,
                                torch.zeros(H, device=META), pos.to(META), pos.to(META), 0)
    assert probs.device == META and probs.shape == (1, H, N, N) and probs.dtype == torch.float32


def test_full_maps_are_written_on_the_host_from_any_device():
    maps = recorders.FullMaps((1, H, N, N), torch.float16, torch.device("cpu"))
    block = torch.rand(1, H, 4, 6)
    maps.put(4, 2, block)
    maps.finish()
    host = maps.host()
    assert host.device.type == "cpu" and host.dtype == torch.float16
    torch.testing.assert_close(host[:, :, 4:8, 2:8], block.half())
    assert host[:, :, :4].abs().sum() == 0


def test_block_key_ranges_are_read_back_once_and_match_the_allow_set():
    allow = torch.ones(N, N, dtype=torch.bool).tril().triu(-2)[None, None]  # a causal window of 3
    allow[0, 0, 9] = False  # a row that sees nothing: its block still gets a valid range
    ranges = allowsets._block_ranges(allow, 4).tolist()
    for (k0, k1), q0 in zip(ranges, range(0, N, 4)):
        cols = allow[0, 0, q0:q0 + 4].any(0).nonzero().flatten().tolist()
        assert (k0, k1) == (cols[0], cols[-1] + 1)
    assert allowsets._block_ranges(torch.zeros(1, 1, 4, N, dtype=torch.bool), 4).tolist() == [[0, N]]


def test_streamed_statistics_equal_the_definitions_in_blocks_that_start_past_key_0():
    """The sync-free diagonal (plain slices instead of boolean indexing) against docs/methods.md#sink-metrics in numpy."""
    torch.manual_seed(1)
    allowed = np.tril(np.ones((N, N), bool))
    scores = torch.randn(H, N, N).masked_fill(~torch.from_numpy(allowed), float("-inf"))
    probs = torch.softmax(scores, -1)
    tokens = ["<s>", "a", ",", "b", "\n", "c", ".", "d", "e", "f"]
    summary = LayerSummary(H, N, N, tokens)
    for q0 in range(0, N, 3):  # blocks of 3 rows, each with only the keys up to its last row
        q1 = min(q0 + 3, N)
        summary.add(q0, probs[:, q0:q1, :q1], torch.from_numpy(allowed[q0:q1, :q1]), 0, zero_outside=True)
    out = summary.result()
    p = probs.numpy()
    np.testing.assert_allclose(out["alpha"], metrics.alpha(p, allowed), atol=1e-6, equal_nan=True)
    np.testing.assert_allclose(out["entropy"], metrics.entropy(p, allowed, normalised=True), atol=1e-5)
    np.testing.assert_allclose(out["allocation"], metrics.allocation(p, tokens), atol=1e-6)


def test_delimiter_flags_once_per_text():
    tokens = ["<s>", ",", " ", "word", "\n\n", "!?", ",", "x."]
    flags = metrics.delimiter_flags(tokens)
    assert flags.tolist() == [0, 1, 1, 0, 1, 1, 1, 0]
    assert metrics.delimiter_flags([",", ","]).tolist() == [0, 1]  # the first token counts as first


def test_block_size_follows_the_device():
    assert devices.block_bytes("cpu") == devices.CPU_BLOCK_BYTES
    assert devices.free_bytes("cpu") is None and devices.free_bytes(META) is None


def test_block_size_from_the_settings(use_settings):
    use_settings(block_mb=2)  # ATTNVIZ_BLOCK_MB
    assert devices.block_bytes("cpu") == 2 * devices.MB


class _Transfers(TorchDispatchMode):
    """Records every operation whose tensors sit on more than one device: on a GPU each is a copy
    between host and device, and a copy from pageable host memory waits for the device."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {a.device.type for a in [*args, *(kwargs or {}).values(), out] if isinstance(a, torch.Tensor)}
        if len(seen) > 1:
            self.ops.append(str(func))
        return out


@pytest.mark.parametrize("layers", [2, 5])
def test_a_decoding_step_neither_copies_nor_reads_back(layers):
    """Streaming decoding waits for nothing (the goal: <= 1.3x generate on a GPU): a step of StreamingLLM decoding, eviction
    included, moves nothing between host and device and reads nothing back, whatever the depth.
    On ``meta`` any read (``.item()``, ``bool()``, ``.tolist()``) raises, and the dispatch mode sees
    every copy. Before, each step copied the eviction index to the device twice a layer, and the
    loop read each token's log-probability back before the next step."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from attnviz.core.loading.models import LoadedModel
    from attnviz.effects.streaming import CachedDecoder

    from tiny import VOCAB, CharTokenizer

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2)
    with META:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=engine.KEY).eval()
    decoder = CachedDecoder(LoadedModel(model, CharTokenizer(), "meta llama", None, 0.0), "fwd", "sink(s=2, w=3)")
    decoder.step(5)  # the first step makes the eviction index and the model's lazy state
    for t in range(8):
        with _Transfers() as moved:
            step = decoder.step(7)
        assert moved.ops == [], f"step {t}: {moved.ops}"
        assert step.logprobs.device == META and len(step.kv_positions) == min(t + 2, 6)  # the kept five and itself
    assert decoder.positions == [0, 1, 6, 7, 8]  # the sinks and the window, at their own positions
    assert all(layer.keys.shape[-2] == 5 for layer in decoder.cache.layers)


def test_the_default_device_is_chosen_without_needing_a_gpu(monkeypatch, use_settings):
    """The choice itself, on any machine: the settings' device (ATTNVIZ_DEVICE) when set, else CUDA when torch sees it, else the CPU;
    and the dtype each choice loads in."""
    from attnviz.core.loading.models import _resolve_dtype

    use_settings(device=None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert devices.default_device() == "cuda" and _resolve_dtype(None, "cuda") == torch.bfloat16
    assert _resolve_dtype(None, "cuda:1") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.default_device() == "cpu" and _resolve_dtype(None, "cpu") == torch.float32
    use_settings(device="cuda:1")
    assert devices.default_device() == "cuda:1"


@pytest.mark.parametrize("device_map,cuda,expected", [
    ({"model": "cpu", "lm_head": "disk"}, True, "cpu"),
    ({"model": 0, "lm_head": "cpu"}, False, "cuda"),
    ({"model": "cuda:1", "lm_head": "disk"}, True, "cuda"),
    ({"model": "mps"}, False, "mps"),
    ("auto", True, "cuda"),
    ("auto", False, "cpu"),
    ("balanced", True, "cuda"),
    ("cpu", True, "cpu"),
])
def test_where_a_device_map_puts_a_model_decides_its_dtype(device_map, cuda, expected, monkeypatch):
    from attnviz.core.loading.models import _resolve_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert devices.mapped_device(device_map) == expected
    assert _resolve_dtype(None, expected) == (torch.float32 if expected == "cpu" else torch.bfloat16)


def test_a_layer_s_results_come_back_in_one_copy_a_dtype(monkeypatch):
    """From a GPU a finished layer's results travel joined by dtype (one concatenation, one copy and one event a
    dtype, not one of each a tensor); the dict that lands is the one sent, every array in its shape and dtype.
    Checked here with the host copy's own type standing in for a GPU's."""
    made = []
    real = devices.HostCopy.__init__
    monkeypatch.setattr(devices.HostCopy, "__init__", lambda self, tensor: made.append(tensor.shape) or real(self, tensor))
    monkeypatch.setattr(devices, "ASYNC_COPIES", {"cpu"})  # the CPU's tensors take the GPU's path
    values = {"alpha": torch.rand(3, 7), "entropy": torch.rand(3, 5), "key0_allowed": torch.rand(5) > 0.5,
              "pooled": torch.rand(3, 4, 4).half(), "pool_factor": np.array(8), "rowsum": torch.rand(3, 5)}
    sent = devices.host_copies(values)
    assert isinstance(sent, devices.PackedCopy) and len(made) == 3  # float32, bool, float16
    landed = devices.landed(sent)
    assert landed.keys() == values.keys()
    for name, value in values.items():
        expected = value.numpy() if isinstance(value, torch.Tensor) else value
        np.testing.assert_array_equal(landed[name], expected)
        assert landed[name].dtype == expected.dtype and landed[name].shape == expected.shape, name
