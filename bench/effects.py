"""Evaluation and streaming cost on a model, against stock transformers in the same run.

    python bench/effects.py [--eval-tokens 2048] [--window 512] [--stream-tokens 200] [--repeat 3] [--model default]

The model is the default one unless ``--model`` names another, on the device ``attnviz.load`` chooses
(``ATTNVIZ_DEVICE``, else CUDA where present); the stock model is loaded from the same folder, in the same dtype
and on the same device.

- eval: attnviz ``evaluate`` under FWD against a stock SDPA model's forward + loss (``labels=``) on
  the same windows of the stdlib corpus (goal <= 1.2x);
- stream: attnviz ``stream`` with a dense cache against ``model.generate`` producing the same number
  of tokens with its own dense cache, per token (goal <= 1.3x).

Medians of ``--repeat`` runs, the two sides alternating. Ends with the line
``effects eval_ratio=<attnviz/HF> stream_ratio=<attnviz/generate per token>``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from attnviz import corpus, load
from attnviz.effects.evaluate import evaluate, token_ids, windows
from attnviz.effects.streaming import stream
from common import ids_on, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval-tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--stream-tokens", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", default="default", help="'default', a Hugging Face id or a saved model's folder")
    args = parser.parse_args()

    loaded = load(args.model)
    stock = AutoModelForCausalLM.from_pretrained(Path(loaded.model.name_or_path), attn_implementation="sdpa",
                                                 dtype=loaded.model.dtype, use_safetensors=True)
    stock = stock.to(loaded.model.device).eval()
    stock.generation_config.eos_token_id = None
    ids = token_ids(loaded, corpus.stdlib().text, args.eval_tokens)
    spans = windows(len(ids), args.window, args.window)

    @torch.inference_mode()
    def hf_eval():
        total = 0.0
        for start, end, first in spans:
            labels = ids_on(stock, ids[start:end])
            labels[0, : first - start] = -100
            total += float(stock(ids_on(stock, ids[start:end]), labels=labels).loss) * (end - first)
        return total

    def ours_eval():
        return evaluate(loaded, ids, "fwd", window=args.window)

    n = args.stream_tokens
    stream_ids = ids[: n + 1]

    @torch.inference_mode()
    def hf_generate():
        return stock.generate(ids_on(stock, stream_ids[:1]), max_new_tokens=n, min_new_tokens=n, do_sample=False)

    def ours_stream():
        return stream(loaded, stream_ids, "dense")

    with torch.inference_mode():  # warm-up
        stock(ids_on(stock, ids[:32]))
    warm = ids[:64]
    evaluate(loaded, warm, "fwd", window=len(warm))

    times: dict[str, list[float]] = {name: [] for name in ("hf_eval", "ours_eval", "hf_generate", "ours_stream")}
    for _ in range(args.repeat):
        for name, fn in [("hf_eval", hf_eval), ("ours_eval", ours_eval), ("hf_generate", hf_generate),
                         ("ours_stream", ours_stream)]:
            times[name].append(timed(loaded.model, fn))
    med = {name: statistics.median(values) for name, values in times.items()}
    print(f"hf_forward_loss   tokens={len(ids)} window={args.window} time_s={med['hf_eval']:.3f}")
    print(f"attnviz_eval_fwd  tokens={len(ids)} window={args.window} time_s={med['ours_eval']:.3f}")
    print(f"hf_generate_dense tokens={n} per_token_ms={1000 * med['hf_generate'] / n:.1f}")
    print(f"attnviz_stream    tokens={n} per_token_ms={1000 * med['ours_stream'] / n:.1f}")
    print(f"effects eval_ratio={med['ours_eval'] / med['hf_eval']:.3f} "
          f"stream_ratio={med['ours_stream'] / med['hf_generate']:.3f}")


if __name__ == "__main__":
    main()
