"""The anatomy's probe (:mod:`attnviz.core.model.anatomy`): one forward of a few tokens with hooks on every layer, block and
norm, and the arithmetic that checks a layer adds up (its output is its input plus its scaled writes)."""

from __future__ import annotations

import threading

import torch

PROBE_TOKENS = 8


def output_tensor(out) -> torch.Tensor:
    """A block's output as the residual stream adds it: attention and MoE blocks return tuples."""
    return out[0] if isinstance(out, tuple) else out


def _first_input(args, kwargs):
    value = args[0] if args else kwargs.get("hidden_states")
    return value if isinstance(value, torch.Tensor) else None


def same_tensor(a, b) -> bool:
    """Both given and the same values (the probe tells which module fed which by the tensors it saw)."""
    return a is not None and b is not None and (a is b or (a.shape == b.shape and torch.equal(a, b)))


def probe(model, base, layer_list, n_layers, attention, mlp, is_norm, config):
    """One forward of a few tokens through the base model with hooks on every layer, block and norm: their
    inputs and outputs by layer, and the keyword arguments each layer was called with. ``attention(layer, config)``
    and ``mlp(layer, config)`` find a layer's blocks, ``is_norm(module)`` its norms (the anatomy's rules)."""
    seen: list[dict] = [dict(norms={}) for _ in range(n_layers)]
    handles = []
    owner = threading.get_ident()  # the model may be shared: another thread's forward is not the probe's

    def keep(index, key):
        def pre(module, args, kwargs=None):  # torch adds a hook and marks it as taking keywords in two steps: a
            # forward of another thread between them calls it without them (docs/methods.md#sites)
            if threading.get_ident() != owner:
                return
            seen[index][key + "_in"] = _first_input(args, kwargs)
            if key == "layer":
                seen[index]["kwargs"] = {k for k, v in kwargs.items() if v is not None and v is not False}
                seen[index]["names"] = set(kwargs)
                seen[index]["position_embeddings"] = kwargs.get("position_embeddings")
            if key == "attn":
                seen[index]["attn_names"] = set(kwargs)

        def post(module, args, kwargs, out=None):
            if threading.get_ident() != owner:
                return
            seen[index][key + "_out"] = output_tensor(out)
        return pre, post

    def keep_norm(index, name):
        def post(module, args, out):
            if threading.get_ident() != owner:
                return
            seen[index]["norms"][name] = (args[0] if args else None, output_tensor(out))
        return post

    try:
        for index, layer in enumerate(layer_list[:n_layers]):
            parts = {"layer": layer, "attn": attention(layer, config), "mlp": mlp(layer, config)}
            seen[index]["parts"] = parts
            for key, module in parts.items():
                pre, post = keep(index, key)
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(module.register_forward_hook(post, with_kwargs=True))
            for name, child in layer.named_children():
                if is_norm(child):
                    handles.append(child.register_forward_hook(keep_norm(index, name)))
        vocab = int(getattr(config, "vocab_size", 0) or 0) or 100
        ids = (torch.arange(PROBE_TOKENS) * 7 + 3) % vocab
        device = next(model.parameters()).device
        with torch.no_grad():
            base(input_ids=ids[None].to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return seen, ids


def _tolerance(dtype) -> float:
    return 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2


def write_scale(delta: torch.Tensor, write: torch.Tensor) -> float:
    """The scalar s with delta = s · write (least squares), or NaN when write is zero."""
    w = write.double().flatten()
    denominator = float(w @ w)
    return float(delta.double().flatten() @ w) / denominator if denominator > 0 else float("nan")


def writes_add_up(delta, write, s, dtype, stream=None) -> bool:
    """delta = s · write within the dtype's tolerance of delta, plus the rounding of the ``stream`` delta was taken
    from (in bfloat16 a stream of massive activations rounds its small writes by more than the writes' own
    tolerance)."""
    error = (delta.double() - s * write.double()).norm()
    rounding = 0.0 if stream is None else 2 * torch.finfo(dtype).eps * float(stream.double().norm())
    return bool(error <= _tolerance(dtype) * max(float(delta.double().norm()), 1e-6) + rounding)
