"""attnviz on a GPU: statistics, pooled maps, regions and streaming of random-weight
models shaped like SmolLM2-135M and Llama-3-8B, against stock transformers in the same run.

    python bench/gpu.py                       # every case of the issue's table (needs a CUDA GPU)
    python bench/gpu.py --case smollm2:8192   # one case; shapes: smollm2, llama8b, thin, tiny
    python bench/gpu.py --device cpu --case tiny:256 --skip-eager   # a smoke run of this script

Models are built from configs in bf16 with random weights: nothing is downloaded, and timings
depend on shapes, not on weights. Tokens are random ids through a one-word-per-token tokenizer.
For each case and in the same process:

- ``sdpa_s``: one stock forward with transformers' SDPA attention (no maps), the baseline;
- ``eager_s``: stock eager attention with ``output_attentions=True`` (``oom`` where it does not fit);
- ``stats_s``: ``capture(keep=Keep(statistics=True, pool=512))``, what the app and ``attnviz sinks`` run on a long
  text: every layer's statistics and 512-px max-pooled maps, finished results on the host;
- ``stats_peak_mb``: ``torch.cuda.max_memory_allocated`` during the capture above what the model holds.

Each case prints ``gpu shape=<name> n=<N> stats_s=<s> sdpa_s=<s> stats_vs_sdpa=<x> stats_peak_mb=<MB>
eager_s=<s|oom>``; the region case prints ``gpu region shape=... n=... side=96 region_s=<s>`` and the
streaming case ``gpu stream shape=... policy=... per_token_ms=<ms> generate_ms=<ms> ratio=<x>``
(``region_s`` resumes from a long capture's kept layer inputs, as the app does; ``from_start_s`` runs
the forward from the embeddings).
With ``--launch 64x64:4:3 128x64:8:2:1`` a statistics case also prints ``gpu launch ...
launch=<TILE:WARPS:STAGES[:GROUPS[:REGISTERS]]> stats_s=<s> stats_vs_sdpa=<x>`` for the fused kernel at each launch
choice (``attnviz.core.kernel.kernels.launch``
takes the card's measured one from ``TUNED``; bench/kernel_sweep.py measures them on one layer).
Times are medians of ``--repeat`` runs after one warm-up. Goals: llama8b:32768 stats
<= 2x SDPA and <= 4 GB above the model; llama8b:4096 faster than eager with <= 5 % of its memory;
smollm2:8192 <= 0.3 s; a 96 x 96 region at 32,768 tokens <= 1 s; streaming <= 1.3x generate.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch

from attnviz import settings
from attnviz.core import engine
from attnviz.effects import streaming
from attnviz import regions
from attnviz.capture import capture
from attnviz.plan import Keep
from attnviz.core.loading.models import LoadedModel
from common import profiled

SHAPES = {  # (layers, heads, kv heads, hidden, intermediate, vocab, max positions)
    "smollm2": dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                    intermediate_size=1536, vocab_size=49152, max_position_embeddings=65536),
    "llama8b": dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                    intermediate_size=14336, vocab_size=128256, max_position_embeddings=65536),
    # SmolLM2's 30 layers and 9 / 3 heads with almost no arithmetic: on a CPU its per-token time is the
    # framework's per-step overhead, which is what bounds a 135M model's decoding on a GPU
    "thin": dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=72,
                 intermediate_size=64, vocab_size=512, max_position_embeddings=65536),
    "tiny": dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                 intermediate_size=128, vocab_size=512, max_position_embeddings=65536),
}
CASES = ["llama8b:32768", "llama8b:4096", "smollm2:8192", "region:llama8b:32768", "stream:smollm2:300"]


class WordTokenizer:
    """One token per space-separated word 'w<id>': exact token counts without a vocabulary file."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [int(w[1:]) % self.vocab for w in text.split()]}

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)

    def __len__(self):
        return self.vocab


def build(shape: str, device: str, dtype: torch.dtype, layers: int | None = None) -> LoadedModel:
    """A random-weight model of ``shape`` (:data:`SHAPES`), with ``layers`` layers instead of the shape's if given."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})},
                         rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=engine.KEY).eval()
    model.generation_config.eos_token_id = None
    engine.prepare(model)
    return LoadedModel(model, WordTokenizer(config.vocab_size), f"random {shape}", None, 0.0)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeat: int) -> tuple[float, float]:
    """(median seconds, peak MB above the memory allocated before) of ``fn()`` after one warm-up."""
    fn()
    times, peaks = [], []
    for _ in range(repeat):
        gc.collect()
        sync(device)
        base = 0
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
        peaks.append((torch.cuda.max_memory_allocated() - base) / 2**20 if device.startswith("cuda") else 0.0)
        del result
    return statistics.median(times), max(peaks)


def stock(loaded: LoadedModel, impl: str, ids: torch.Tensor, attentions: bool = False):
    model = loaded.model
    model.set_attn_implementation(impl)
    try:
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=False, output_attentions=attentions, logits_to_keep=1)
            return out.attentions if attentions else out.logits
    finally:
        model.set_attn_implementation(engine.KEY)


def text_of(loaded: LoadedModel, n: int) -> tuple[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(n)
    ids = torch.randint(0, loaded.tokenizer.vocab, (1, n), generator=generator)
    return loaded.tokenizer.decode(ids[0].tolist()), ids


def stats_case(loaded: LoadedModel, shape: str, n: int, device: str, repeat: int, eager: bool,
               launches: list[str] | None = None, profile: bool = False) -> None:
    text, ids = text_of(loaded, n)
    ids = ids.to(device)
    sdpa_s, _ = timed(lambda: stock(loaded, "sdpa", ids), device, repeat)
    names = ("ATTNVIZ_KERNEL_TILE", "ATTNVIZ_KERNEL_WARPS", "ATTNVIZ_KERNEL_STAGES", "ATTNVIZ_KERNEL_GROUPS",
             "ATTNVIZ_KERNEL_REGISTERS")
    for choice in launches or []:  # the kernel at each launch choice, against the same SDPA baseline
        chosen = settings.Settings.from_environment({**os.environ, **dict(zip(names, choice.split(":")))})
        with settings.applied(chosen):
            seconds, peak = timed(lambda: capture(loaded, text, "fwd", Keep(statistics=True, pool=512)), device, repeat)
        print(f"gpu launch shape={shape} n={n} launch={choice} stats_s={seconds:.3f} sdpa_s={sdpa_s:.3f} "
              f"stats_vs_sdpa={seconds / sdpa_s:.2f} stats_peak_mb={peak:.0f}", flush=True)
    stats_s, peak = timed(lambda: capture(loaded, text, "fwd", Keep(statistics=True, pool=512)), device, repeat)
    if profile:
        profiled(lambda: capture(loaded, text, "fwd", Keep(statistics=True, pool=512)), f"stats {shape}:{n}")
        profiled(lambda: stock(loaded, "sdpa", ids), f"sdpa {shape}:{n}")
    eager_s = "skipped"
    if eager:
        try:
            seconds, eager_peak = timed(lambda: stock(loaded, "eager", ids, attentions=True), device, 1)
            eager_s = f"{seconds:.3f} eager_peak_mb={eager_peak:.0f}"
        except torch.OutOfMemoryError:
            eager_s = "oom"
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(f"gpu shape={shape} n={n} stats_s={stats_s:.3f} sdpa_s={sdpa_s:.3f} stats_vs_sdpa={stats_s / sdpa_s:.2f} "
          f"stats_peak_mb={peak:.0f} eager_s={eager_s}", flush=True)


def region_case(loaded: LoadedModel, shape: str, n: int, device: str, repeat: int) -> None:
    """The last layer's last 96 queries x first 96 keys: from the text's start (the whole forward
    runs before it) and, as the app does after a long capture, from the capture's kept layer inputs."""
    text, _ = text_of(loaded, n)
    layer = loaded.n_layers - 1
    where = (layer, (n - 96, n), (0, 96))
    cap = capture(loaded, text, "fwd", Keep(statistics=True, pool=512, checkpoints=8))
    seconds, peak = timed(lambda: regions.of_capture(loaded, cap, *where), device, repeat)
    start_s, _ = timed(lambda: regions.region(loaded, text, "fwd", *where), device, repeat)
    print(f"gpu region shape={shape} n={n} side=96 layer={layer} region_s={seconds:.3f} from_start_s={start_s:.3f} "
          f"peak_mb={peak:.0f} checkpoints={sorted(cap.checkpoints)}", flush=True)


def stream_case(loaded: LoadedModel, shape: str, n: int, device: str, repeat: int) -> None:
    _, ids = text_of(loaded, n + 1)
    ids = ids[0].tolist()
    start = torch.tensor([ids[:1]], device=device)

    def generate():
        with torch.inference_mode():
            loaded.model.set_attn_implementation("sdpa")
            try:
                return loaded.model.generate(start, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            finally:
                loaded.model.set_attn_implementation(engine.KEY)

    generate_s, _ = timed(generate, device, repeat)
    for policy in ("dense", f"sink(s=4, w={max(8, n // 5 - 4)})"):
        seconds, _ = timed(lambda: streaming.stream(loaded, ids, policy), device, repeat)
        print(f"gpu stream shape={shape} policy={policy.replace(' ', '')} tokens={n} "
              f"per_token_ms={1000 * seconds / n:.2f} generate_ms={1000 * generate_s / n:.2f} "
              f"ratio={seconds / generate_s:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help=f"shape:n, region:shape:n or stream:shape:n "
                                                          f"(default: {' '.join(CASES)})")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-eager", action="store_true", help="no eager output_attentions baseline")
    parser.add_argument("--profile", action="store_true", help="also print a profile of each statistics case")
    parser.add_argument("--launch", nargs="*", help="also time the statistics kernel at these launch choices, each "
                                                    "TILE:WARPS:STAGES[:GROUPS[:REGISTERS]] (64x64:4:2:4:128; "
                                                    "ATTNVIZ_KERNEL_TILE, _WARPS, _STAGES, _GROUPS, _REGISTERS)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"# device={args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}) "
          f"torch={torch.__version__} dtype={args.dtype}", flush=True)
    models: dict[str, LoadedModel] = {}
    for case in args.case or CASES:
        parts = case.split(":")
        kind = parts[0] if parts[0] in ("region", "stream") else "stats"
        shape, n = (parts[1], int(parts[2])) if kind != "stats" else (parts[0], int(parts[1]))
        if shape not in models:
            models.clear()
            gc.collect()
            models[shape] = build(shape, args.device, dtype)
        loaded = models[shape]
        if kind == "stats":
            stats_case(loaded, shape, n, args.device, args.repeat, not args.skip_eager, args.launch, args.profile)
        elif kind == "region":
            region_case(loaded, shape, n, args.device, args.repeat)
        else:
            stream_case(loaded, shape, n, args.device, args.repeat)


if __name__ == "__main__":
    main()
