"""The path-patching findings of docs/findings.md, measured again: which receivers carry each necessary writer to the sink.

    .venv/bin/python scripts/paths_findings.py [--out assets/paper]

On the first 256 tokens of the stdlib corpus (Python's reference docs, read at run time), under FWD, for both real
models (SmolLM2-135M-Instruct and Gemma 3 270M): the causal scan's necessary writers, each cut from the receivers
and groups docs/findings.md names (``attnviz paths --senders ... --receivers ...``); prints one line per path (its drop on
the scan's scale, over the layers it reaches, the perplexity, and the sink's attention in every layer before and
after: docs/findings.md's per-layer figures) and writes the bar figure of each model as
``paths_<model>.png`` and ``.pdf`` (docs/methods.md#path-patching). About three minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: model -> sender -> the receivers docs/findings.md reports for it (a single receiver, a group, or groups joined by +)
ASKED = {
    "default": {
        "embed": "attn.*,keys.*,mlp.*,all",
        "mlp.0": "mlp.11,attn.*,keys.*,mlp.*,attn.*+mlp.11,attn.*+mlp.1,attn.*+mlp.1-2,attn.1-10+mlp.1-10,all",
        "mlp.11": "keys.28,keys.29,attn.*,keys.*,mlp.*,attn.*+mlp.12,attn.*+mlp.12-14,mlp.*+keys.*,all",
    },
    "gemma3-270m": {
        "embed": "attn.*,keys.*,mlp.0,mlp.0-1,mlp.*,all",
        "mlp.1": "mlp.2,mlp.3,mlp.2-3,attn.*,keys.*,mlp.*,all",
        "mlp.3": "mlp.4,mlp.4-5,mlp.4-9,attn.*,keys.*,mlp.*,mlp.*+keys.*,all",
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "assets" / "paper"))
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    from attnviz import load
    from attnviz.corpus import load as corpus, text_of
    from attnviz.effects.causal import scan
    from attnviz.effects.evaluate import token_ids
    from attnviz.effects.paths import Paths, paths
    from attnviz.figures import export
    from attnviz.figures.why import paths_bars_figure

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for model, asked in ASKED.items():
        lm = load(model)
        text = text_of(lm.tokenizer, token_ids(lm, corpus("stdlib").text, args.tokens))
        necessary = scan(lm, text, "fwd", leaders=False).necessary
        print(f"{model}: the scan's necessary writers {necessary}")
        before = None
        merged = None
        for sender in necessary:
            if sender not in asked:
                print(f"  {sender}: necessary, but docs/findings.md names no receivers for it")
                continue
            found = paths(lm, text, "fwd", sender, asked[sender])
            if before is None:
                before = found.before.attention
                print("  the sink's attention by layer, before: " + " ".join(f"{a:.3f}" for a in before))
            for receiver in found.receivers(sender):
                after = found.after[sender, receiver]
                print(f"  {sender} -> {receiver}: drop {found.drop(sender, receiver):+.3f} (from layer "
                      f"{found.reach_from(sender, receiver)}: {found.reached(sender, receiver):+.3f}), perplexity "
                      f"{found.before.perplexity:.1f} -> {after.perplexity:.1f}")
                print("    after: " + " ".join(f"{a:.3f}" for a in after.attention))
            if merged is None:
                merged = Paths(found.recipe, found.tokens, found.value, found.before, [])
            merged.senders.append(sender)
            merged.after.update(found.after)
            merged.cut.update(found.cut)
        fig = paths_bars_figure(merged, single=None)
        meta = {"model": model, "figure": "paths", "tokens": merged.tokens, "arch": "fwd"}
        (out / f"paths_{model}.pdf").write_bytes(export.figure_bytes(fig, "pdf", meta, preset="paper-double",
                                                                    title=False))
        (out / f"paths_{model}.png").write_bytes(export.figure_bytes(fig, "png", meta, preset="paper-double",
                                                                    title=False, scale=1.5))
        print(f"wrote {out}/paths_{model}.pdf and .png", flush=True)


if __name__ == "__main__":
    main()
