"""Train the lab's default setup with one seed and print, at every checkpoint, the attention each head puts on the
first token from the queries that need no attention (Bigram-Backcopy's non-trigger ones). Usage:
``PYTHONPATH=. python scripts/lab_sink.py SEED [OUT]`` (docs/lab.md)."""
import sys, time, torch

from attnviz.lab.train import Setup, train
from attnviz.lab.tasks import BigramBackcopy
from transformers import LlamaForCausalLM
seed = int(sys.argv[1]); out = sys.argv[2] if len(sys.argv) > 2 else f"runs/bigram-backcopy-{seed}"
setup = Setup(seed=seed, task=BigramBackcopy(seed=seed))
t = time.perf_counter()
train(setup, out, on_step=lambda s, n, l: print(s, round(l, 3), f"{time.perf_counter()-t:.0f}s", flush=True) if s % 500 == 0 else None)
x = setup.task.batch(64, 10**6)
quiet = ~setup.task.needs_attention(x)
for step in setup.checkpoints():
    m = LlamaForCausalLM.from_pretrained(f"{out}/step-{step}", attn_implementation="eager")
    with torch.no_grad():
        a = m(x, output_attentions=True).attentions[0]  # (B, H, n, n)
    first = a[..., 0]  # attention on key 0
    q = quiet.clone(); q[:, 0] = False
    print("step", step, "first-token attention of non-trigger queries by head:", [round(float(first[:, h][q].mean()), 3) for h in range(a.shape[1])])
