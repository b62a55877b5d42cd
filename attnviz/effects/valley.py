"""The compression valley (docs/methods.md#the-compression-valley): per layer, the matrix-based entropy of the residual
stream entering it, beside the sink rate and the first token's norm, from one forward under a recipe.

Queipo-de-Llano et al. 2025 (arXiv 2510.06477, Fig. 1) find that the layers where the first token's norm explodes are
where the sink appears and where the representation compresses (its entropy falls). The entropy is measured here at
the named site ``resid_pre`` of each layer (:mod:`attnviz.core.engine.sites`), in the same forward the capture runs,
so every recipe (architecture, intervention, BOS control) is measured as it runs; no hidden state outlives its layer.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from attnviz.core.engine import sites
from attnviz.core.engine.hooks import layer_input_norms
from attnviz.core.model.anatomy import decoder_layers
from attnviz.plan import Keep
from attnviz.stats import metrics, spectrum

#: the variant measured, in one line (the JSON's ``entropy_variant``)
VARIANT = ("matrix-based entropy of resid_pre (the residual stream entering each layer), not centred, rows not "
           "normalised: H = -sum p_i log p_i / log n, p_i = lambda_i / sum lambda, lambda the eigenvalues of Z Z^T")
ROWS = 1024  # rows of Z in one product when the d x d matrix Z^T Z is summed: the working memory stays d^2 + ROWS * d
_FAST_FP64 = {(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)}  # CUDA's data-centre chips: float64 at half float32's rate


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device computes it at speed (the CPU; P100, V100, A100, H100, B200), else float32."""
    if device.type == "cpu":
        return torch.float64
    if device.type == "cuda" and torch.cuda.get_device_capability(device) in _FAST_FP64:
        return torch.float64
    return torch.float32


def gram_spectrum(z: torch.Tensor, rows: int = ROWS) -> np.ndarray:
    """The eigenvalues of the Gram matrix Z Z^T of ``z`` (n, d), float64 on the host: from Z Z^T itself where n <= d,
    else from the d x d matrix Z^T Z (the same nonzero eigenvalues), summed ``rows`` rows at a time; on z's device in
    :func:`accumulation_dtype`, so a long text costs d^2, never n^2. The eigenvalues are found in float64, on the
    host where the device is slow at it."""
    dtype = accumulation_dtype(z.device)
    n, d = z.shape
    if n <= d:
        gram = z.to(dtype) @ z.to(dtype).T
    else:
        gram = torch.zeros(d, d, dtype=dtype, device=z.device)
        for block in z.split(rows):
            block = block.to(dtype)
            gram += block.T @ block
    if dtype != torch.float64:
        gram = gram.cpu().to(torch.float64)
    return torch.linalg.eigvalsh(gram).cpu().numpy()


@contextmanager
def layer_entropies(model):
    """Inside, every forward of this thread records, per decoder layer, the matrix-based entropy H of the residual
    stream entering it (:func:`attnviz.stats.spectrum.matrix_entropy` of :func:`gram_spectrum`, the batch's first
    row), a float by layer index: d^2 numbers at a time, no hidden state kept. Other threads' forwards are not read;
    a model the anatomy does not map reads nothing."""
    entropies: dict[int, float] = {}

    def entropy_of(index):
        def fn(value):
            z = value[0].detach()
            # a stream that overflowed (float16) has no spectrum: NaN here, and the forward's own overflow check
            # refuses the run in one line at the layer's attention
            if not bool(torch.isfinite(z).all()):
                entropies[index] = float("nan")
                return
            try:
                entropies[index] = spectrum.matrix_entropy(gram_spectrum(z), z.shape[0])
            except torch.linalg.LinAlgError:  # float64 on the d x d Gram converges; recorded as undefined if not
                entropies[index] = float("nan")
        return fn

    pairs = [(sites.Site("resid_pre", index), entropy_of(index)) for index in range(len(decoder_layers(model) or []))]
    with sites.hooks(model, pairs):
        yield entropies


@dataclass
class Valley:
    """Per layer of one text under one recipe: H entering it, the first token's residual norm entering it, and the
    attention sink (alpha at key 0 and at the layer's sink key, docs/methods.md#auto-key), from one forward."""

    model: str
    arch: str
    tokens: list[str]
    layers: list[int]
    entropy: list[float]  # NaN where a layer's input was not seen (or the text has one token)
    first_norm: list[float]  # ||z_0|| entering each layer, NaN where not seen
    keys: list[int]  # each layer's sink key (0 under FWD, m under NoSink-m)
    alpha_key: np.ndarray = field(repr=False)  # (layers, heads) alpha at each layer's sink key
    alpha0: np.ndarray = field(repr=False)  # (layers, heads) alpha at key 0 (NaN where only query 0 sees it)
    recipe: dict | None = None
    variant: str = VARIANT

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def sink_rate(self, eps: float = metrics.SINK_EPS, key0: bool = False) -> list[float]:
        """The sink rate of each layer (docs/methods.md#sink-rate) at its sink key, or at key 0 (``key0``)."""
        alphas = self.alpha0 if key0 else self.alpha_key
        return [metrics.sink_rate(row, eps) for row in alphas]

    def valley(self) -> int | None:
        """The layer of the lowest entropy (None where none is defined)."""
        values = np.asarray(self.entropy, dtype=np.float64)
        return None if not np.isfinite(values).any() else self.layers[int(np.nanargmin(values))]

    def rows(self, eps: float = metrics.SINK_EPS) -> list[dict]:
        """One row a layer: ``layer``, ``key``, ``entropy``, ``first_norm``, ``sink_rate`` (at the key),
        ``sink_rate_key0``; NaN becomes None."""
        rate, rate0 = self.sink_rate(eps), self.sink_rate(eps, key0=True)
        return [{"layer": layer, "key": self.keys[i], "entropy": _none(self.entropy[i]),
                 "first_norm": _none(self.first_norm[i]), "sink_rate": _none(rate[i]),
                 "sink_rate_key0": _none(rate0[i])}
                for i, layer in enumerate(self.layers)]

    def as_json(self, eps: float = metrics.SINK_EPS) -> dict:
        """The document `attnviz sinks` and the page read; ``null_reasons`` says why any value is null."""
        eps = metrics.check_eps(eps)
        rows = self.rows(eps)
        why = null_reasons(self.n_tokens, rows)
        return {"model": self.model, "arch": self.arch, "n_tokens": self.n_tokens, "eps": eps,
                "entropy_variant": self.variant, "valley_layer": self.valley(),
                **({"recipe": self.recipe} if self.recipe else {}), "layers": rows,
                **({"null_reasons": why} if why else {})}


def null_reasons(n_tokens: int, rows: list[dict]) -> dict:
    """Why the nulls of a per-layer document are null, one line a field that has one (empty where none is)."""
    why = {}
    if any(r.get("entropy", 0) is None for r in rows):
        why["entropy"] = ("a one-token text has no spread to measure (the entropy needs two or more tokens)"
                          if n_tokens < 2 else "the layer's input was not read, or was not finite (an overflow)")
    rates = [k for r in rows for k in ("sink_rate", "sink_rate_key0") if k in r and r[k] is None]
    if rates:
        why["sink_rate"] = ("alpha is the attention a key receives from the queries after it: a one-token text has "
                            "none (docs/methods.md#sink-metrics)" if n_tokens < 2 else
                            "no head's alpha is defined at that key: no later query may see it under the mask")
    return why


def _none(x):
    return None if x is None or not np.isfinite(x) else round(float(x), 6)


def of_capture(cap, entropies: dict, norms: dict) -> Valley:
    """A :class:`Valley` from a capture that kept alpha (every layer recorded) and the entropies and residual norms
    its forward recorded (:func:`layer_entropies`, :func:`attnviz.core.engine.hooks.layer_input_norms`)."""
    keys = [metrics.auto_key(cap.allowed[layer]) for layer in cap.layers]
    alphas = [cap.stat(layer, "alpha") for layer in cap.layers]
    return Valley(model=cap.meta["model"], arch=cap.arch, tokens=list(cap.tokens), layers=list(cap.layers),
                  entropy=[float(entropies.get(layer, np.nan)) for layer in cap.layers],
                  first_norm=[float(norms[layer][0]) if layer in norms else float("nan") for layer in cap.layers],
                  keys=keys, alpha_key=np.stack([a[:, k] for a, k in zip(alphas, keys)]),
                  alpha0=np.stack([a[:, 0] for a in alphas]),
                  recipe=cap.recipe.to_dict() if cap.recipe else None)


def measure(loaded, text: str, recipe="fwd", budget=None, max_tokens: int | None = None, on_layer=None) -> Valley:
    """The compression valley of ``text`` under ``recipe`` (an architecture string or a
    :class:`~attnviz.recipe.Recipe`): one forward (a capture keeping alpha only), the entropy and the residual norms
    read at each layer's input as it runs. ``budget`` / ``max_tokens`` as :func:`attnviz.capture.prepare`'s
    (``max_tokens`` a whole number, at least 1); ``on_layer(i)`` after each layer."""
    from attnviz.capture import prepare
    from attnviz.tokens import check_max_tokens

    check_max_tokens(max_tokens)
    prepared = prepare(loaded, text, recipe, Keep(statistics=("alpha",)), budget, max_tokens)
    with layer_input_norms(loaded.model) as norms, layer_entropies(loaded.model) as entropies:
        cap = prepared.run(on_layer)
    return of_capture(cap, entropies, norms)
