"""Fine-tune a model with a residual variant (seed 003), then evaluate it as the seed's table does.

torch's AdamW with transformers' linear warm-up schedule, a seeded and reproducible run, on
fixed-length chunks of a corpus: the last ``eval_fraction`` of the chunks is held out. The metrics
are the seed's: ``eval_loss``, ``eval_perplexity``, ``eval_accuracy`` (argmax hits), runtime.

Checkpoints are written to a temporary directory beside ``out`` and moved into place with one
rename, so an interrupted run (Ctrl-C) leaves the last complete checkpoint loadable, never a
half-written directory. ``--model out`` loads it back with its variant and weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from attnviz import recipe
from attnviz.core import engine
from attnviz.core.engine import residual
from attnviz.core.loading import plain
from attnviz.core.loading.models import LoadedModel
from attnviz.errors import InputError

METRICS_FILE = "metrics.json"

MAX_TOKENS = 60_000  # corpus tokens `attnviz finetune` reads by default


@dataclass
class FinetuneResult:
    out: str
    residual: str | None
    arch: str
    steps: int
    losses: list[float] = field(repr=False)
    metrics: dict = field(default_factory=dict)
    interrupted: bool = False
    variant: object = field(default=None, repr=False)

    def as_json(self) -> dict:
        """The seed's held-out metrics after (and ``before``) fine-tuning, and the first and last training loss."""
        keep = ("residual", "arch", "steps", "seed", "eval_loss", "eval_perplexity", "eval_accuracy", "eval_runtime",
                "eval_samples", "before")
        return {"out": self.out, **{k: self.metrics[k] for k in keep}, "train_loss_first": self.losses[0],
                "train_loss_last": self.losses[-1]}


def chunks(ids: list[int], seq_len: int, eval_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) sequences of ``seq_len`` tokens, the held-out ones taken from the end."""
    n = len(ids) // seq_len
    if n < 2:
        raise InputError(f"the corpus has {len(ids)} tokens: at least 2 sequences of {seq_len} are needed")
    data = torch.tensor(ids[: n * seq_len]).view(n, seq_len)
    held = max(1, int(round(n * eval_fraction)))
    return data[: n - held], data[n - held:]


def logits_of(loaded: LoadedModel, variant, ids: torch.Tensor, masks) -> torch.Tensor:
    """Logits under the architecture, with the variant if any; differentiable outside no_grad."""
    return recipe.forward(loaded, variant, ids, masks, None, engine.Feed(grad=True))[0]


def _loss_and_hits(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    targets = ids[:, 1:].to(logits.device)
    flat = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets.reshape(-1)), (flat.argmax(-1) == targets.reshape(-1))


@torch.no_grad()
def evaluate_chunks(loaded: LoadedModel, variant, data: torch.Tensor, masks, batch: int = 8) -> dict:
    started = time.perf_counter()
    total, count, hits = 0.0, 0, 0
    for start in range(0, len(data), batch):
        ids = data[start:start + batch]
        loss, hit = _loss_and_hits(logits_of(loaded, variant, ids, masks), ids)
        total += float(loss) * hit.numel()
        count += hit.numel()
        hits += int(hit.sum())
    loss = total / count
    return {"eval_loss": round(loss, 6), "eval_perplexity": round(math.exp(loss), 6),
            "eval_accuracy": round(hits / count, 6), "eval_runtime": round(time.perf_counter() - started, 3),
            "eval_samples": len(data)}


def check_out(out: str | Path) -> Path:
    """Refuse an output directory that cannot be written, before any training."""
    out = Path(out).expanduser().resolve()
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=parent, prefix=".attnviz-probe-", delete=True)
        probe.close()
    except OSError as err:
        raise InputError(f"cannot write --out '{out}': {err.strerror or err}") from None
    if out.exists() and not out.is_dir():
        raise InputError(f"--out '{out}' exists and is not a directory")
    return out


def save_checkpoint(loaded: LoadedModel, variant, out: Path, metrics: dict) -> None:
    """Write everything to a temporary sibling, then swap it in: never a half-written ``out``."""
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        loaded.model.save_pretrained(tmp, safe_serialization=True)
        plain.mark(tmp, loaded.model.config)  # a lab model's kind stays loud under plain transformers
        loaded.tokenizer.save_pretrained(tmp)
        if variant is not None:
            variant.save(tmp)
        (tmp / METRICS_FILE).write_text(json.dumps(metrics, indent=1))
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def finetune(loaded: LoadedModel, ids: list[int], out: str | Path, residual_name: str | None = None,
             recipe: str = "fwd", steps: int = 200, seq_len: int = 128, batch: int = 8, lr: float = 5e-5,
             seed: int = 0, eval_fraction: float = 0.1, save_every: int = 50,
             on_step: Callable[[int, int, float], None] | None = None) -> FinetuneResult:
    """Fine-tune ``loaded`` (in place) with the variant under ``recipe``; evaluate before and after."""
    from transformers import get_linear_schedule_with_warmup

    if steps <= 0:
        raise InputError(f"--steps must be positive, got {steps}")
    from attnviz.recipe import Recipe, build

    if isinstance(recipe, Recipe):  # its variant is the one trained, unless one is named
        residual_name = residual_name or recipe.residual
        recipe = dataclasses.replace(recipe, residual=None)
    architecture = build(loaded, recipe).only("fine-tuning").architecture.require_causal("fine-tune")
    variant = None
    if residual_name:
        residual.check_family(loaded.model)
        variant = residual.Variant(residual_name, loaded.n_layers).to(loaded.model.device)
    out = check_out(out)
    train, held = chunks(ids, seq_len, eval_fraction)
    masks = list(architecture.layers)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    before = evaluate_chunks(loaded, variant, held, masks, batch)
    params = [p for p in loaded.model.parameters() if p.requires_grad]
    if variant is not None:
        params += [p for p in variant.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = get_linear_schedule_with_warmup(optimizer, max(1, steps // 10), steps)
    losses: list[float] = []
    meta = {"residual": variant.name if variant else "baseline", "arch": architecture.spec, "seed": seed,
            "seq_len": seq_len, "batch": batch, "lr": lr, "train_sequences": len(train), "before": before}
    interrupted = False
    loaded.model.train()
    try:
        for step in range(1, steps + 1):
            rows = torch.randint(0, len(train), (min(batch, len(train)),), generator=generator)
            loss, _ = _loss_and_hits(logits_of(loaded, variant, train[rows], masks), train[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            if on_step:
                on_step(step, steps, losses[-1])
            if step % save_every == 0 and step < steps:
                loaded.model.eval()
                save_checkpoint(loaded, variant, out, {**meta, "steps": step, "train_loss": losses})
                loaded.model.train()
    except KeyboardInterrupt:
        interrupted = True
    loaded.model.eval()
    if interrupted:  # the last complete checkpoint stays as it is
        return FinetuneResult(str(out), variant.name if variant else None, architecture.spec, len(losses), losses,
                              {}, interrupted=True, variant=variant)
    after = evaluate_chunks(loaded, variant, held, masks, batch)
    metrics = {**meta, "steps": steps, "train_loss": losses, **after}
    save_checkpoint(loaded, variant, out, metrics)
    return FinetuneResult(str(out), variant.name if variant else None, architecture.spec, steps, losses, metrics,
                          variant=variant)
