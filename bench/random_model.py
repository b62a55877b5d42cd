"""A loadable model directory with random weights, from a model's config and tokenizer files: what the GPU
machines (which hold no weights and reach no network) load where a bench wants the default model's shapes and
tokenizer.

    python bench/random_model.py CONFIG_DIR OUT_DIR [--dtype bfloat16]

``CONFIG_DIR`` holds ``config.json`` and the tokenizer's files (``lm.tokenizer.save_pretrained`` and
``lm.model.config.save_pretrained`` of a loaded model write them); ``OUT_DIR`` gets the same files and the random
weights as safetensors, which ``attnviz.load(OUT_DIR)`` loads. Times depend on shapes, not on weights, except where
a pass skips work by what the numbers are (routes' bound): a bench run on such a model says so.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.config_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    out = Path(args.out_dir)
    model.save_pretrained(out, safe_serialization=True)
    for path in Path(args.config_dir).iterdir():
        if path.name != "config.json" and path.is_file():
            shutil.copy(path, out / path.name)
    print(f"random model {config.model_type} {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M -> {out}")


if __name__ == "__main__":
    main()
