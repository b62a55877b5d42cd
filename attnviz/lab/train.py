"""Training a small decoder from scratch (docs/lab.md): a stock transformers Llama built from a config, AdamW with
warm-up, fixed seeds, checkpoints as Hugging Face folders (safetensors, config, the run's recipe, step, loss and a
hash of the weights) every K steps, log-spaced early, and a run that resumes from its last checkpoint.

The defaults are the configuration that made a sink within four minutes of one CPU core (the issue's measurement):
one layer, attention only (the MLP's weights zero and frozen), four heads of 16, Bigram-Backcopy with 64 tokens, 3
triggers and 64 positions, batches of 32, AdamW at 3e-3 with weight decay 0.01. Branch work: softmax under a
causal mask only; the attention kinds and masks are not wired in yet.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from attnviz.errors import InputError
from attnviz.lab.tasks import BigramBackcopy


@dataclass(frozen=True)
class Setup:
    layers: int = 1
    width: int = 64
    heads: int = 4
    mlp: bool = False
    steps: int = 4000
    batch: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup: int = 100
    seed: int = 0
    every: int = 500  # a checkpoint every this many steps, and log-spaced before (1, 2, 4, ...)
    task: BigramBackcopy = field(default_factory=BigramBackcopy)

    def __post_init__(self):
        for name in ("layers", "width", "heads", "steps", "batch", "every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"{name} is a whole number of at least 1, not {value!r}")
        if self.width % self.heads:
            raise InputError(f"the width {self.width} is not a multiple of the {self.heads} heads")
        if not (self.lr > 0 and self.weight_decay >= 0 and self.warmup >= 0):
            raise InputError("the learning rate is above 0, the weight decay and the warm-up at least 0")

    def checkpoints(self) -> list[int]:
        """The steps a checkpoint is saved at: 0, powers of two below ``every``, then every ``every``, the last."""
        early = [0] + [2**k for k in range(int(math.log2(max(self.every, 1))) + 1) if 2**k < self.every]
        return sorted(set(early + list(range(self.every, self.steps + 1, self.every)) + [self.steps]))


def build(setup: Setup):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(setup.seed)
    config = LlamaConfig(vocab_size=setup.task.vocab, hidden_size=setup.width, intermediate_size=4 * setup.width,
                         num_hidden_layers=setup.layers, num_attention_heads=setup.heads,
                         num_key_value_heads=setup.heads, max_position_embeddings=setup.task.length,
                         bos_token_id=0, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    return attention_only(LlamaForCausalLM(config), setup)


def attention_only(model, setup: Setup):
    """Without MLPs (``setup.mlp`` False): each MLP's weights zero and frozen, as built and as loaded back."""
    if not setup.mlp:
        for layer in model.model.layers:
            for p in layer.mlp.parameters():
                p.data.zero_()
                p.requires_grad_(False)
    return model


def weights_hash(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def save(model, optimizer, setup: Setup, step: int, loss: float, out: Path) -> Path:
    folder = out / f"step-{step}"
    tmp = out / f".step-{step}.partial"
    model.save_pretrained(tmp, safe_serialization=True)
    torch.save({"optimizer": optimizer.state_dict()}, tmp / "optimizer.pt")
    meta = {"step": step, "loss": loss, "hash": weights_hash(model), "setup": {**asdict(setup)}}
    (tmp / "attnviz_run.json").write_text(json.dumps(meta, indent=1))
    tmp.rename(folder)  # a checkpoint is whole or absent: Ctrl-C never leaves half of one
    return folder


def last(out: Path) -> Path | None:
    steps = sorted((int(p.name.split("-")[1]), p) for p in Path(out).glob("step-*") if p.is_dir())
    return steps[-1][1] if steps else None


def train(setup: Setup, out, on_step: Callable[[int, int, float], None] | None = None) -> Path:
    """Train ``setup`` into ``out`` (resuming from its last checkpoint); returns the last checkpoint's folder."""
    from transformers import LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    found = last(out)
    model = attention_only(LlamaForCausalLM.from_pretrained(found), setup) if found else build(setup)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=setup.lr, weight_decay=setup.weight_decay)
    start = 0
    if found:
        optimizer.load_state_dict(torch.load(found / "optimizer.pt")["optimizer"])
        start = json.loads((found / "attnviz_run.json").read_text())["step"]
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / setup.warmup) if setup.warmup else 1.0, last_epoch=start - 1)
    saved = set(setup.checkpoints())
    model.train()
    loss = float("nan")
    if start == 0:
        found = save(model, optimizer, setup, 0, loss, out)
    for step in range(start + 1, setup.steps + 1):
        x = setup.task.batch(setup.batch, step)
        loss_t = model(input_ids=x, labels=x).loss
        optimizer.zero_grad(set_to_none=True)
        loss_t.backward()
        optimizer.step()
        schedule.step()
        loss = float(loss_t.detach())
        if on_step:
            on_step(step, setup.steps, loss)
        if step in saved:
            found = save(model, optimizer, setup, step, loss, out)
    return found
