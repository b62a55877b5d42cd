"""A whole `attnviz sinks` command on a long text against a plain SDPA forward of the same text.

    python bench/command.py [--n 4096] [--repeat 3] [--model default]

- ``sdpa``: in its own process, the model loaded (the default one unless ``--model`` names another) and warmed
  up, then one stock forward of the text (transformers' SDPA attention, no maps): the forward alone is timed, as
  `bench/long.py` does.
- ``command``: `attnviz sinks --model M --text-file F --json` as a user runs it, timed from the process's start to
  its exit: interpreter, imports, model load, tokenizing, the statistics capture and the JSON.
Both load the model on the device ``attnviz.load`` chooses (``ATTNVIZ_DEVICE``, else CUDA where present).
Medians of ``--repeat`` runs, alternating. Ends with
``command n=<N> command_s=<s> sdpa_s=<s> ratio=<command/sdpa>`` (goal at 4,096 tokens: ratio <= 2.0).
Measure on a quiet machine: nothing else running.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ids_on, timed

ATTNVIZ = [sys.executable, "-m", "attnviz"]


def sdpa_child(model: str, path: str) -> dict:
    import torch

    from attnviz import load

    lm = load(model)
    lm.model.set_attn_implementation("sdpa")
    ids = lm.tokenizer(Path(path).read_text(encoding="utf-8"))["input_ids"]
    with torch.inference_mode():
        lm.model(input_ids=ids_on(lm.model, [1, 2, 3]))
        seconds = timed(lm.model, lambda: lm.model(input_ids=ids_on(lm.model, ids)))
    return {"side": "sdpa", "seconds": seconds, "tokens": len(ids)}


def text_of(model: str, n: int) -> str:
    from attnviz import corpus, load

    lm = load(model)
    ids = corpus.head_ids(lm.tokenizer, corpus.stdlib().text, n)
    return corpus.text_of(lm.tokenizer, ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", default="default", help="'default', a Hugging Face id or a saved model's folder")
    parser.add_argument("--sdpa-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sdpa_child:
        print(json.dumps(sdpa_child(args.model, args.sdpa_child)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "text.txt"
        path.write_text(text_of(args.model, args.n), encoding="utf-8")
        times: dict[str, list[float]] = {"sdpa": [], "command": []}
        tokens = None
        for _ in range(args.repeat):
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--sdpa-child", str(path)],
                                 check=True, capture_output=True, text=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            times["sdpa"].append(row["seconds"])
            start = time.perf_counter()
            out = subprocess.run(ATTNVIZ + ["sinks", "--model", args.model, "--text-file", str(path), "--json"],
                                 check=True, capture_output=True, text=True)
            times["command"].append(time.perf_counter() - start)
            tokens = json.loads(out.stdout)["n_tokens"]
            print(json.dumps({"sdpa_s": round(row["seconds"], 3), "command_s": round(times["command"][-1], 3)}),
                  flush=True)
    command, sdpa = statistics.median(times["command"]), statistics.median(times["sdpa"])
    print(f"command n={tokens} command_s={command:.2f} sdpa_s={sdpa:.2f} ratio={command / sdpa:.2f}")


if __name__ == "__main__":
    main()
