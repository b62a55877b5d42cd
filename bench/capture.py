"""Capture cost on a model, against HF eager ``output_attentions=True`` in the same run.

    python bench/capture.py --n 1024 [--repeat 3] [--model default] [--device cuda]

The model is the default one unless ``--model`` names another (a Hugging Face id or a saved model's folder).
Measures a plain SDPA forward, HF eager with ``output_attentions=True``, attnviz capture of all
layers (``attnviz.capture``: fp16 storage, held packed) and of one layer, and the engine's forward alone
with every layer's maps whole (``engine_all_whole_maps``: what the capture packs). Time is the median of
``--repeat`` runs; peak memory is the growth of the process's peak resident set (Linux ``VmHWM``, reset
through ``/proc/self/clear_refs``, after giving freed heap back with ``malloc_trim``) or of
``torch.cuda.max_memory_allocated`` on CUDA, over what was resident before the call, with the call's result
still held. Ends with the line
``capture_all_vs_eager N=<N> time_ratio=<all/eager time> mem_ratio=<all/eager peak memory>``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from attnviz.core import engine
from attnviz import Keep, capture, load
from attnviz.capture import prepare
from attnviz.core.spec.arch import parse
import common  # noqa: F401,E402 - ATTNVIZ_* read as the CLI reads them (attnviz.settings)

TEXT = ("Attention sinks are tokens that receive a large share of attention regardless of their meaning. "
        "In most decoder language models the first token plays that role in nearly every layer and head. ")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _trim() -> None:
    """Give freed heap back to the system (glibc's ``malloc_trim``), so what an earlier case freed but the
    allocator kept resident does not hide the next case's growth."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure(fn, device: str, repeat: int) -> tuple[float, float]:
    """(median seconds, peak bytes above the starting footprint) of ``fn()``, result held during the peak."""
    times, peaks = [], []
    for _ in range(repeat):
        gc.collect()
        _trim()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            base = _rss_kib("VmRSS") * 1024
        start = time.perf_counter()
        result = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else _rss_kib("VmHWM") * 1024
        peaks.append(max(peak - base, 0))
        del result
    return statistics.median(times), statistics.median(peaks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024, help="sequence length in tokens")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="default", help="'default', a Hugging Face id or a saved model's folder")
    args = parser.parse_args()

    loaded = load(args.model, device=args.device)
    source = Path(loaded.model.name_or_path)
    models = {impl: AutoModelForCausalLM.from_pretrained(source, attn_implementation=impl, dtype=torch.float32,
                                                         use_safetensors=True).to(args.device).eval()
              for impl in ("sdpa", "eager")}
    text = loaded.tokenizer.decode(loaded.tokenizer(TEXT * (args.n // 20 + 1))["input_ids"][: args.n])
    prepared = {"all": prepare(loaded, text, "fwd"),
                "one": prepare(loaded, text, "fwd", Keep(layers=(loaded.n_layers - 1,)))}
    ids = list(prepared["all"].ids)  # the capture's own tokens (within a token of N), the baselines' too
    if abs(len(ids) - args.n) > 2:
        raise SystemExit(f"could only make {len(ids)} tokens")
    input_ids = torch.tensor([ids], device=args.device)
    fwd = list(parse("fwd", loaded.n_layers).layers)

    @torch.inference_mode()
    def sdpa():
        return models["sdpa"](input_ids=input_ids, use_cache=False).logits

    @torch.inference_mode()
    def eager():
        return models["eager"](input_ids=input_ids, use_cache=False, output_attentions=True).attentions

    def capture_all():
        return prepared["all"].run()

    def capture_one():
        return prepared["one"].run()

    def engine_all():
        return engine.forward(loaded.model, input_ids, fwd)[1].probs

    short = input_ids[:, :32]
    with torch.inference_mode():  # warm-up: allocator, kernels, lazy imports
        for impl in models.values():
            impl(input_ids=short, use_cache=False)
        engine.forward(loaded.model, short, fwd)
        capture(loaded, TEXT, "fwd")

    results = {}
    for name, fn in [("sdpa_forward", sdpa), ("hf_eager_output_attentions", eager),
                     ("attnviz_capture_all", capture_all), ("attnviz_capture_one_layer", capture_one),
                     ("engine_all_whole_maps", engine_all)]:
        seconds, peak = measure(fn, args.device, args.repeat)
        results[name] = (seconds, peak)
        print(f"{name:28s} N={args.n} time_s={seconds:.3f} peak_mb={peak / 2**20:.1f}", flush=True)

    (t_all, m_all), (t_eager, m_eager) = results["attnviz_capture_all"], results["hf_eager_output_attentions"]
    t_one, t_sdpa = results["attnviz_capture_one_layer"][0], results["sdpa_forward"][0]
    print(f"capture_one_vs_sdpa N={args.n} time_ratio={t_one / t_sdpa:.3f}")
    print(f"capture_all_vs_eager N={args.n} time_ratio={t_all / t_eager:.3f} mem_ratio={m_all / m_eager:.3f}")


if __name__ == "__main__":
    main()
