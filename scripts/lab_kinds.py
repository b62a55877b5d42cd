"""The lab's default setup trained under several attention kinds and seeds (docs/lab.md#what-each-kind-does): at a few
steps, the attention each head puts on the first token from the queries that need no attention, the value drain
per head, the residual peak after the layer, and the training loss. One thread a process; a JSON file a run.

Usage: ``PYTHONPATH=. python scripts/lab_kinds.py OUT KIND[,KIND...] SEED[,SEED...] [STEPS]``, e.g.
``scripts/lab_kinds.py runs/kinds softmax,softpick 0,1,2``."""
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from attnviz.core.engine.attention import prepare
from attnviz.lab.tasks import BigramBackcopy
from attnviz.lab.train import Setup, build

torch.set_num_threads(1)
out, kinds_, seeds = Path(sys.argv[1]), sys.argv[2].split(","), [int(s) for s in sys.argv[3].split(",")]
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 4000
AT = [0, 250, 500, 1000, 2000, 3000, 4000]


def measures(model, task):
    x = task.batch(64, 10**6)
    quiet = ~task.needs_attention(x)
    quiet[:, 0] = False
    with torch.no_grad():
        o = model(x, output_attentions=True, output_hidden_states=True)
        a = o.attentions[0]  # (B, H, n, n)
        layer = model.model.layers[0]
        v = layer.self_attn.v_proj(layer.input_layernorm(o.hidden_states[0]))  # (B, n, H*d)
        v = v.view(*v.shape[:2], a.shape[1], -1).norm(dim=-1)  # (B, n, H)
        drain = (v[:, 0] / v[:, 1:].median(dim=1).values).mean(0)  # per head
        h = o.hidden_states[-1] if len(o.hidden_states) > 1 else o.hidden_states[0]
        # the stream after the last layer, before the final norm (hidden_states[-1] is after it in Llama): rebuild
        after = o.hidden_states[0] + layer.self_attn(layer.input_layernorm(o.hidden_states[0]),
                                                       position_embeddings=model.model.rotary_emb(
                                                           o.hidden_states[0], torch.arange(x.shape[1])[None]),
                                                       attention_mask=None)[0]
        norms = after.norm(dim=-1)
        peak = float((norms[:, 0] / norms[:, 1:].median(dim=1).values).mean())
        first = [float(a[:, hd, :, 0][quiet].mean()) for hd in range(a.shape[1])]
    return {"first_token": first, "value_drain": drain.tolist(), "residual_peak_after": peak}


for kind in kinds_:
    for seed in seeds:
        setup = Setup(seed=seed, steps=steps, task=BigramBackcopy(seed=seed))
        model = build(setup)
        if kind != "softmax":
            model.config.attnviz_kind = kind
        prepare(model)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=setup.lr, weight_decay=setup.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / setup.warmup))
        rows, losses, t0 = [], [], time.perf_counter()
        for step in range(0, steps + 1):
            if step in AT:
                model.eval()
                rows.append({"step": step, "loss": sum(losses[-50:]) / max(len(losses[-50:]), 1) if losses else None,
                             **measures(model, setup.task)})
                model.train()
                print(kind, seed, rows[-1]["step"], rows[-1]["loss"], [round(f, 2) for f in rows[-1]["first_token"]],
                      f"{time.perf_counter() - t0:.0f}s", flush=True)
            if step == steps:
                break
            x = setup.task.batch(setup.batch, step + 1)
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
        folder = out / f"{kind}-seed{seed}"
        model.save_pretrained(folder, safe_serialization=True)
        (folder / "measures.json").write_text(json.dumps({"kind": kind, "seed": seed, "steps": steps,
                                                         "seconds": time.perf_counter() - t0, "rows": rows}, indent=1))
