"""Residual recompute variants of seed 003 (docs/methods.md#residual-variants): Methods 1, 2, 3.1, 3.2, 4.1, 4.2.

Baseline pre-norm layer l: a_l = Attn(N1(h_{l-1})), u_l = h_{l-1} + a_l, f_l = MLP(N2(u_l)),
h_l = u_l + f_l, with h_{-1} = X the token embeddings. Each layer p is recomputed once on X with
its own first-pass probabilities P_p (from the attnviz run, under the layer's mask):
ã_p = O_p(P_p · V_p(N1_p(X))) and f̃_p = MLP_p(N2_p(X + ã_p)).

- Methods 1 and 3.x replace the MLP residual u_l by R_l = X + Σ_{p<l} w_{l,p} f̃_p;
- Methods 2 and 4.x replace the attention residual h_{l-1} by S_l = X + Σ_{p<l} w_{l,p} ã_p;
- w = 1 (Methods 1, 2), 1/l (3.1, 4.1) or learned scalars initialised to 1/l (3.2, 4.2).

Our reading of the seed (its Chinese text says "the residual becomes the accumulated recomputed
outputs of the previous layers"): X is part of the sum, as the first layer's residual is X, and
for l = 0 the sum is X alone. The recomputation is defined on sequential pre-norm layers whose writes the
stream adds as they are, with separate v_proj / o_proj and unscaled embeddings: the model's anatomy
(:mod:`attnviz.core.model.anatomy`) says whether a model's layers are such (Llama, Mistral, Qwen2 and 3, SmolLM3,
Mixtral and other MoE decoders among them); others are refused with the reason (docs/methods.md#residual-variants).
"""

from __future__ import annotations

import dataclasses

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from attnviz.core import engine
from attnviz.errors import ArchitectureError, ModelLoadError

METHODS = ("method1", "method2", "method3.1", "method3.2", "method4.1", "method4.2")
CONFIG_FILE = "attnviz_residual.json"
WEIGHTS_FILE = "attnviz_residual.safetensors"

#: Seed 003's table (143 eval samples, 5 epochs of fine-tuning): perplexity and accuracy.
SEED_TABLE = {"baseline": (13.1821, 0.4966), "method1": (12.5021, 0.5025), "method2": (13.1291, 0.4966),
              "method3.1": (12.494, 0.5029), "method3.2": (12.5057, 0.5032), "method4.1": (13.01, 0.4979),
              "method4.2": (12.94, 0.4985)}


@dataclass(frozen=True)
class Method:
    name: str

    @property
    def target(self) -> str:
        """'mlp' (Methods 1, 3.x: the MLP residual) or 'attn' (Methods 2, 4.x: the attention residual)."""
        return "mlp" if self.name in ("method1", "method3.1", "method3.2") else "attn"

    @property
    def weighting(self) -> str:
        """'sum' (Methods 1, 2), 'mean' (w = 1/l: 3.1, 4.1) or 'learned' (3.2, 4.2)."""
        if self.name in ("method1", "method2"):
            return "sum"
        return "mean" if self.name.endswith(".1") else "learned"


def method(name: str) -> Method:
    key = (name or "").strip().lower().replace(" ", "")
    key = {"1": "method1", "2": "method2", "3.1": "method3.1", "3.2": "method3.2", "4.1": "method4.1",
           "4.2": "method4.2"}.get(key, key)
    if key not in METHODS:
        raise ArchitectureError(f"unknown residual variant '{name}'; expected one of {', '.join(METHODS)}")
    return Method(key)


def why_not(found) -> str:
    """Why seed 003's recomputation is not defined on a model of this anatomy ("" when it is)."""
    layers = found.layers
    if any(l.parallel for l in layers):
        return "its attention and MLP read the same input (parallel blocks)"
    if any(l.post_norms for l in layers):
        return "the residual stream adds its blocks' outputs after post-norms"
    if any(l.attn_norm is None or l.mlp_norm is None for l in layers):
        return "its blocks have no pre-norm"
    if any(l.scale != 1.0 for l in layers):
        return "its residual writes are scaled"
    if found.rotary is None:
        return "it has no rotary embedding"
    if found.embed_scaled:
        return "its first layer's input is not the token embedding (scaled embeddings)"
    if not all(isinstance(getattr(l.attn, name, None), nn.Linear) for l in layers for name in ("v_proj", "o_proj")):
        return "its attention has no separate v_proj and o_proj"
    return ""


def check_family(model) -> None:
    """Refuse, in one line, a model on which the recomputation is not defined (:func:`why_not`)."""
    from attnviz.core.model import anatomy
    from attnviz.errors import InputError

    config = model.config.get_text_config()
    try:
        why = why_not(anatomy.of(model))
    except InputError as err:
        why = str(err)
    if why:
        raise ModelLoadError(f"residual variants need sequential pre-norm layers with separate v_proj and o_proj; "
                             f"'{config.model_type}' is not such a decoder: {why}")


class Variant(nn.Module):
    """A residual method and, for 3.2 / 4.2, its learned weights w[l, p] (p < l), initialised to 1/l."""

    def __init__(self, name: str, n_layers: int):
        super().__init__()
        self.method = method(name)
        self.n_layers = n_layers
        init = torch.zeros(n_layers, n_layers)
        for l in range(1, n_layers):
            init[l, :l] = 1.0 / l
        if self.method.weighting == "learned":
            self.weights = nn.Parameter(init)
        else:
            self.register_buffer("weights", init if self.method.weighting == "mean" else (init > 0).float())

    @property
    def name(self) -> str:
        return self.method.name

    def save(self, directory: Path) -> None:
        from safetensors.torch import save_file

        (directory / CONFIG_FILE).write_text(json.dumps({"residual": self.name, "n_layers": self.n_layers}))
        save_file({"weights": self.weights.detach().cpu().contiguous()}, str(directory / WEIGHTS_FILE))

    @classmethod
    def load(cls, directory: Path) -> "Variant | None":
        path = Path(directory) / CONFIG_FILE
        if not path.is_file():
            return None
        from safetensors.torch import load_file

        meta = json.loads(path.read_text())
        variant = cls(meta["residual"], int(meta["n_layers"]))
        with torch.no_grad():
            variant.weights.copy_(load_file(str(Path(directory) / WEIGHTS_FILE))["weights"])
        return variant


def resolve(loaded, name: str | None) -> "Variant | None":
    """The variant to run: ``name`` if given (the loaded directory's learned weights when it is the
    same method), else the one a fine-tuned directory was saved with, else None."""
    saved = getattr(loaded, "residual", None)
    if not name:
        return saved
    check_family(loaded.model)
    if saved is not None and saved.name == method(name).name:
        return saved
    return Variant(name, engine.n_layers(loaded.model)).to(loaded.model.device)


def _recompute_attention(attn, x_normed: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """O_p(P_p · V_p(x)): the layer's attention output with its first-pass probabilities, input x."""
    batch, n, _ = x_normed.shape
    values = attn.v_proj(x_normed).view(batch, n, -1, attn.head_dim).transpose(1, 2)  # (B, KVH, n, d)
    heads = probs.shape[1]
    values = values.repeat_interleave(heads // values.shape[1], dim=1)
    mixed = torch.matmul(probs.to(values.dtype), values)  # (B, H, n, d)
    return attn.o_proj(mixed.transpose(1, 2).reshape(batch, n, -1))


def forward(model, variant: Variant, input_ids: torch.Tensor, computes, record: "engine.Record | None" = None):
    """The variant's forward under per-layer masks (``computes``, as in :func:`engine.forward`): ``(logits, run)``;
    differentiable outside ``torch.no_grad``. Recorded layers' probabilities (and what ``record`` asks the
    run to record) are kept in the run as usual; by default nothing is recorded."""
    check_family(model)
    total = engine.n_layers(model)
    record = dataclasses.replace(engine.NOTHING if record is None else record, keep_graph=True)
    from attnviz.core.model import anatomy, head

    found = anatomy.of(model)
    run = engine.make_run(model, input_ids, computes, record)
    ids = input_ids.to(model.device)
    positions = run.positions.to(model.device)
    with engine.active(run):
        x = found.embed(ids)
        h, recomputed = x, []
        weights = variant.weights.to(x.device, x.dtype)
        for l, layer in enumerate(found.layers[:total]):
            position_embeddings = found.position_embeddings(x, positions, layer)
            a, _ = layer.attn(layer.attn_norm(h), position_embeddings=position_embeddings, attention_mask=None)
            probs = run.live.pop(l)
            a_tilde = _recompute_attention(layer.attn, layer.attn_norm(x), probs)
            # a running sum of scaled terms: autograd keeps no stacked copy per layer (memory O(L), not O(L^2))
            past = x + sum(weights[l, p] * r for p, r in enumerate(recomputed)) if recomputed else x
            u = (past if variant.method.target == "attn" else h) + a
            f = anatomy.output_tensor(layer.mlp(layer.mlp_norm(u)))
            if variant.method.target == "mlp":
                h = past + f
                recomputed.append(anatomy.output_tensor(layer.mlp(layer.mlp_norm(x + a_tilde))))
            else:
                h = u + f
                recomputed.append(a_tilde)
        logits = head.logits(model, h)  # the model's own head: final norm, output layer, the family's scalings
    return logits, run


def results_table(directory: str | Path) -> list[dict]:
    """Seed 003's table beside ours: one row per method, ours read from the ``metrics.json`` of every
    fine-tuned directory under ``directory`` (``attnviz finetune --out DIR/NAME``)."""
    ours: dict[str, dict] = {}
    root = Path(directory).expanduser()
    for path in sorted(root.glob("*/metrics.json")) if root.is_dir() else []:
        try:
            metrics = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if "eval_perplexity" in metrics:
            ours[metrics.get("residual", "baseline")] = {**metrics, "dir": path.parent.name}
    rows = []
    for name in ("baseline", *METHODS):
        seed_ppl, seed_acc = SEED_TABLE[name]
        got = ours.get(name, {})
        rows.append({"method": name, "seed ppl": seed_ppl, "seed acc": seed_acc,
                     "ours ppl": got.get("eval_perplexity"), "ours acc": got.get("eval_accuracy"),
                     "ours ppl before": got.get("before", {}).get("eval_perplexity"),
                     "steps": got.get("steps"), "dir": got.get("dir")})
    return rows
