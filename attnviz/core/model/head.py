"""The model's head, written once: a last layer's output to the next-token logits as the model's own forward makes
them (its final norm, its output layer with its bias, and the scalings families add in their config). The engine's
resumed forwards (``attnviz.core.engine.forward.head_logits``), the residual variants and the logit lens
(``attnviz.flow.lens``) all read it here (docs/methods.md#routes says what the lens does with each part).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnviz.core.model import anatomy


@dataclass(frozen=True)
class Head:
    """The final norm (None where a family has none), the output layer, the scalings (Granite's ``logits_scaling``
    divides by ``divisor``, Cohere's ``logit_scale`` multiplies by ``factor``: 1 elsewhere) and ``cap`` (Gemma 2's
    ``final_logit_softcapping``, None elsewhere), applied in that order as their forwards do."""

    norm: torch.nn.Module | None
    output: torch.nn.Module
    divisor: float = 1.0
    factor: float = 1.0
    cap: float | None = None

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden) if self.norm is not None else hidden

    def scaled(self, z: torch.Tensor) -> torch.Tensor:
        """The output layer's values ``z`` under the family's scalings (linear: a part is scaled as the whole is)."""
        z = z / self.divisor if self.divisor != 1.0 else z
        return z * self.factor if self.factor != 1.0 else z

    def capped(self, z: torch.Tensor) -> torch.Tensor:
        """The soft cap, ``cap · tanh(z / cap)``, of scaled values ``z`` (``z`` itself without one)."""
        return self.cap * torch.tanh(z / self.cap) if self.cap else z

    def cap_ratio(self, z: torch.Tensor) -> torch.Tensor:
        """What the soft cap multiplies each scaled value ``z`` by (``capped(z) / z``; 1 at 0 and without a cap)."""
        if not self.cap:
            return torch.ones_like(z)
        small = z.abs() < 1e-12
        return torch.where(small, torch.ones_like(z), self.capped(z) / torch.where(small, torch.ones_like(z), z))

    def output32(self, normed: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """The output layer in float32 (its weight and bias cast), for readings computed in float32 from a
        half-precision run's activations; ``bias=False`` leaves the bias out (a part of a stream that is not all of
        it)."""
        given = getattr(self.output, "bias", None) if bias else None
        return torch.nn.functional.linear(normed.float(), self.output.weight.float(),
                                          None if given is None else given.float())

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of ``hidden`` (..., d), in the output layer's dtype: final norm, output layer (its bias
        included), scale, cap. Differentiable (the residual variants train through it)."""
        return self.capped(self.scaled(self.output(self.normed(hidden))))


def of(model) -> Head:
    """The head of ``model``, read from its anatomy (the final norm), its output embedding and its config."""
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    divisor = float(getattr(config, "logits_scaling", None) or 1.0)
    factor = getattr(config, "logit_scale", None)
    factor = float(factor) if factor and not isinstance(factor, bool) else 1.0
    cap = getattr(config, "final_logit_softcapping", None)
    return Head(anatomy.of(model).final_norm, model.get_output_embeddings(), divisor, factor,
                float(cap) if cap else None)


def logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The model's logits of a last layer's output ``hidden`` (..., d): :class:`Head` of ``model`` applied."""
    return of(model)(hidden)
