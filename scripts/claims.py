"""The interventions', KV compression's and head classes' measurements on the default model, on a text no one tuned for (Python's reference
documentation, topic `compound`, read at run time). Prints one JSON line per measurement.

    .venv/bin/python scripts/claims.py [--tokens 1024]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from attnviz import corpus, load
from attnviz.effects import heads
from attnviz.stats import metrics
from attnviz.capture import capture
from attnviz.plan import Keep
from attnviz.recipe import Recipe
from attnviz.effects.evaluate import evaluate, token_ids
from attnviz.kv import compress


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--topic", default="compound")
    args = parser.parse_args()
    lm = load("default")
    text_ids = token_ids(lm, corpus.stdlib(args.topic).text, args.tokens)
    text = lm.tokenizer.decode(text_ids[1:] if text_ids[0] == lm.tokenizer.bos_token_id else text_ids)
    top = f"@{lm.n_layers - 10}-{lm.n_layers - 1}"

    def emit(**row):
        print(json.dumps(row), flush=True)

    for spec in (None, "sinklogit(b=0)", "sinkscale(beta=0)", f"sinkscale(beta=0.3){top}"):
        recipe = Recipe.of(lm, "fwd", spec)
        ev = evaluate(lm, text_ids, recipe, window=512)
        cap = capture(lm, text[:2000], recipe, Keep(statistics=True))
        rate = float(np.nanmean([metrics.sink_rate(cap.stats[l]["alpha"][:, 0]) for l in cap.layers]))
        emit(what="intervention", intervene=spec or "none", perplexity=round(ev.perplexity, 4),
             accuracy=round(ev.accuracy, 4), sink_rate_key0=round(rate, 4))

    result = compress.compress(lm, text_ids, 512, None, compress.RATIOS)
    emit(what="compress", dense=round(result.dense.perplexity, 4),
         rows=[{"press": r.press, "ratio": r.ratio, "perplexity": round(r.perplexity, 3), "accuracy": round(r.accuracy, 4),
                "kept_key0": round(r.kept_key0, 3)} for r in result.rows])

    sample = lm.tokenizer.decode(text_ids[:512])
    tax = heads.taxonomy(lm, [sample])
    emit(what="heads", sink=round(float(tax.sink.mean()), 4), streaming=round(float(tax.streaming.mean()), 4),
         inactive=round(float(tax.inactive.mean()), 4))
    dense, windowed = heads.streaming_only_perplexity(lm, sample, tax)
    emit(what="claim_streaming_heads", dense=round(dense.perplexity, 4), streaming_heads_windowed=round(windowed.perplexity, 4),
         streaming_heads=int(tax.streaming.sum()))
    for tau in (0.2, 0.5, 0.7):
        t = tax.with_thresholds(tau_inactive=tau)
        base, ablated, share = heads.ablate_inactive(lm, sample, t)
        emit(what="claim_ablate_inactive", tau=tau, share=round(share, 4), perplexity=round(base.perplexity, 4),
             ablated_perplexity=round(ablated.perplexity, 4), accuracy=round(base.accuracy, 4),
             ablated_accuracy=round(ablated.accuracy, 4))


if __name__ == "__main__":
    main()
