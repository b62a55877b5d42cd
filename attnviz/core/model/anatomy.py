"""A loaded decoder's anatomy: where its layers, blocks, norms and residual writes are, found from the model
itself, never from a list of family names (docs/methods.md#the-model-anatomy; docs/layout.md says where a family is taught).

Two sources, in this order:

1. **What transformers declares.** A config's ``base_model_pp_plan`` names the decoder's embedding, its layer list
   and its final norm; ``base_model_tp_plan`` names, under ``layers.*``, the attention block (the parent of
   ``q_proj`` / ``qkv_proj`` / ``query_key_value``), its output projection (``o_proj`` / ``dense``) and the MLP
   (or MoE) block. Where a config declares nothing (GPT-2), the module tree is read: the base model's
   ``ModuleList`` of ``num_hidden_layers`` layers, a child whose class is an attention, one that is an MLP or
   mixture of experts.
2. **A probe.** One forward of eight tokens with hooks on every layer, block and norm shows, by tensor identity,
   which norm feeds which block (a pre-norm, or none as in OLMo 2), which norm takes a block's output (Gemma 2 and
   3, OLMo 2 and 3, Exaone 4's post-norms: the residual stream adds the norm's output), whether the MLP reads the
   layer input (parallel blocks: GPT-NeoX, Phi, Cohere) or the stream after attention, and the scale of the
   writes (Granite's residual multiplier, solved from the numbers). The probe then checks that the layer's
   output is its input plus the scaled writes; a layer that does not add up is refused with one line naming
   what did not.

Each capability reads what it needs from here: ``patch`` and the causal check the write modules, resuming a
forward the layer list and its rotary embedding, residual variants the pre-norms, score attribution the blocks
and norms. The anatomy is made once per model (under a lock: the shared server's sessions share a model).
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass

import torch

# output_tensor: the residual variants read it here
from attnviz.core.model.probe import output_tensor, probe, same_tensor, write_scale, writes_add_up  # noqa: F401
from attnviz.errors import InputError

_LOCK = threading.Lock()
# the keyword arguments (given a value) a decoder layer is called with that resuming a forward can make again;
# any argument the probe saw passed as None is passed as None
RESUMABLE_KWARGS = {"hidden_states", "attention_mask", "position_ids", "use_cache", "cache_position",
                    "position_embeddings", "output_attentions"}


@dataclass(frozen=True)
class Layer:
    """One decoder layer: its blocks, the norms before them, the modules whose outputs the residual stream adds
    (the block itself, or its post-norm) and how (``parallel``: the MLP reads the layer input; ``scale``: the
    writes are multiplied by it, Granite's residual multiplier)."""

    index: int
    module: torch.nn.Module
    attn: torch.nn.Module
    mlp: torch.nn.Module
    attn_norm: torch.nn.Module | None
    mlp_norm: torch.nn.Module | None
    attn_write: torch.nn.Module
    mlp_write: torch.nn.Module
    parallel: bool = False
    scale: float = 1.0
    window: int | None = None  # the model's own sliding window in this layer, if any
    layer_type: str | None = None  # config.layer_types[i] where the config has them

    @property
    def post_norms(self) -> bool:
        """The residual stream adds a norm's output (Gemma 2 and 3, OLMo 2 and 3, Exaone 4, GLM-4)."""
        return self.attn_write is not self.attn or self.mlp_write is not self.mlp


@dataclass(frozen=True)
class Anatomy:
    family: str  # config.model_type: a label for messages and tables, never a key to behaviour
    base: torch.nn.Module
    layer_list: torch.nn.ModuleList
    layers: tuple[Layer, ...]
    embed: torch.nn.Module | None
    final_norm: torch.nn.Module | None
    rotary: torch.nn.Module | None  # the base model's rotary embedding (None: learned or no positions)
    rotary_takes_type: bool = False  # rotary(x, positions, layer_type) (Gemma 3: local and global frequencies)
    layer_kwargs: frozenset = frozenset()  # the keyword arguments the base model calls a layer with
    attn_kwargs: frozenset = frozenset()  # ... and a layer calls its attention with
    resumable: bool = True  # a forward can resume at any layer from that layer's input
    why_not_resumable: str = ""  # where it cannot, why (one line, for a refusal)
    embed_scaled: bool = False  # the first layer's input is not the embedding table's row (Gemma: × √d)

    def __getitem__(self, index: int) -> Layer:
        return self.layers[index]

    def position_embeddings(self, hidden: torch.Tensor, positions: torch.Tensor, layer: Layer):
        """What the base model passes ``layer`` as its position embeddings (None without a rotary embedding)."""
        if self.rotary is None:
            return None
        if self.rotary_takes_type and layer.layer_type is not None:
            return self.rotary(hidden, positions, layer.layer_type)
        return self.rotary(hidden, positions)


def of(model) -> Anatomy:
    """The model's anatomy (made once, kept on the model), or an :class:`InputError` in one line naming what was
    not found."""
    found = model.__dict__.get("_attnviz_anatomy")
    if found is None:
        with _LOCK:
            found = model.__dict__.get("_attnviz_anatomy")
            if found is None:
                try:
                    found = _discover(model)
                except InputError as err:  # a refusal is kept too: no second probe, which may run under hooks
                    found = err
                model.__dict__["_attnviz_anatomy"] = found  # not a submodule, not in the state dict
    if isinstance(found, InputError):
        raise InputError(str(found))
    return found


# --- discovery ---------------------------------------------------------------------------------------------

def _config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _declared(config, leaf_names) -> str | None:
    """The child of ``layers.*`` that holds one of ``leaf_names`` in the config's tensor-parallel plan."""
    for key in getattr(config, "base_model_tp_plan", None) or {}:
        parts = key.split(".")
        if len(parts) >= 4 and parts[0] == "layers" and parts[1] == "*" and parts[-1] in leaf_names:
            return parts[2]
    return None


def _is_norm(module) -> bool:
    return isinstance(module, torch.nn.LayerNorm) or "norm" in type(module).__name__.lower()


def _layer_list(model, config) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    base = model.base_model
    n = int(config.num_hidden_layers)
    plan = getattr(config, "base_model_pp_plan", None) or {}
    for name in plan:
        value = getattr(base, name, None)
        if isinstance(value, torch.nn.ModuleList) and len(value) >= n:
            return base, value
    for name, value in base.named_children():  # no declaration: the base model's list of n layers
        if isinstance(value, torch.nn.ModuleList) and len(value) == n:
            return base, value
    raise InputError(f"no list of {n} decoder layers found in {type(base).__name__} ({config.model_type}), so its "
                     "blocks cannot be mapped")


def _child(layer, config, declared, test, what: str):
    name = declared
    if name is not None and isinstance(getattr(layer, name, None), torch.nn.Module):
        return getattr(layer, name)
    hits = [module for child, module in layer.named_children() if test(child, module)]
    if len(hits) != 1:
        raise InputError(f"{config.model_type}: no single {what} block found in {type(layer).__name__} "
                         f"(children: {', '.join(n for n, _ in layer.named_children())})")
    return hits[0]


def _attention(layer, config):
    declared = _declared(config, {"q_proj", "qkv_proj", "query_key_value", "q_a_proj", "o_proj"})
    return _child(layer, config, declared, lambda name, m: "attention" in type(m).__name__.lower()
                  and "norm" not in type(m).__name__.lower(), "attention")


def _mlp(layer, config):
    declared = _declared(config, {"down_proj", "c_proj", "fc2", "dense_4h_to_h", "experts"})
    names = ("mlp", "feed_forward", "block_sparse_moe", "moe")
    return _child(layer, config, declared,
                  lambda name, m: name in names or any(k in type(m).__name__.lower() for k in ("mlp", "moe", "expert")),
                  "MLP")


def _window(config, attn, index: int) -> tuple[int | None, str | None]:
    types = getattr(config, "layer_types", None)
    layer_type = types[index] if types and index < len(types) else None
    window = getattr(attn, "sliding_window", None)
    if window is None and layer_type == "sliding_attention":
        window = getattr(config, "sliding_window", None)
    elif window is None and layer_type is None and getattr(config, "use_sliding_window", True):
        window = getattr(config, "sliding_window", None)  # one window in every layer (Mistral, Mixtral, StarCoder 2)
    return (int(window) if window else None), layer_type


def _discover(model) -> Anatomy:
    config = _config(model)
    family = getattr(config, "model_type", type(model).__name__)
    if getattr(model.config, "is_encoder_decoder", False):
        raise InputError(f"{family} is an encoder-decoder: its blocks are not mapped (decoders only)")
    base, layer_list = _layer_list(model, config)
    n = int(config.num_hidden_layers)
    seen, ids = probe(model, base, layer_list, n, _attention, _mlp, _is_norm, config)
    dtype = next(model.parameters()).dtype
    layers = []
    for index, record in enumerate(seen):
        parts = record["parts"]
        where = f"{family} layer {index}"
        h, y = record.get("layer_in"), record.get("layer_out")
        a_in, a_out, m_in, m_out = (record.get(k) for k in ("attn_in", "attn_out", "mlp_in", "mlp_out"))
        if any(t is None for t in (h, y, a_in, a_out, m_in, m_out)):
            raise InputError(f"{where}: the probe did not see the layer's attention and MLP run with their hidden "
                             "states, so their writes cannot be mapped")
        norms = record["norms"]
        modules = dict(parts["layer"].named_children())

        def norm_feeding(tensor):
            return next((modules[name] for name, (_, out) in norms.items() if same_tensor(out, tensor)), None)

        def norm_taking(tensor):
            return next((modules[name] for name, (inp, _) in norms.items() if same_tensor(inp, tensor)), None)

        attn_norm, mlp_norm = norm_feeding(a_in), norm_feeding(m_in)
        attn_post, mlp_post = norm_taking(a_out), norm_taking(m_out)
        a = norms[_name(modules, attn_post)][1] if attn_post is not None else a_out
        f = norms[_name(modules, mlp_post)][1] if mlp_post is not None else m_out
        mlp_source = norms[_name(modules, mlp_norm)][0] if mlp_norm is not None else m_in
        if attn_norm is None and not same_tensor(a_in, h):
            raise InputError(f"{where}: the attention's input is neither the layer's input nor a norm of it")
        parallel = same_tensor(mlp_source, h)

        def adds_up(s):
            if parallel:
                return writes_add_up(y - h, a + f, s, dtype, y)
            return writes_add_up(mlp_source - h, a, s, dtype, mlp_source) and writes_add_up(y - mlp_source, f, s, dtype, y)

        if parallel:
            s = write_scale(y - h, a + f)
        else:  # one scale of both writes: in half precision a small write alone rounds far from it
            s = write_scale(torch.cat([(mlp_source - h).flatten(), (y - mlp_source).flatten()]),
                       torch.cat([a.flatten(), f.flatten()]))
        s = 1.0 if adds_up(1.0) else s  # no multiplier where the writes add up without one (rounding is no scale)
        ok = adds_up(s)
        if not ok:
            raise InputError(f"{where}: its output is not its input plus its attention and MLP writes "
                             f"({'parallel' if parallel else 'in sequence'}), so the writes cannot be mapped")
        window, layer_type = _window(config, parts["attn"], index)
        layers.append(Layer(index, parts["layer"], parts["attn"], parts["mlp"], attn_norm, mlp_norm,
                            attn_post or parts["attn"], mlp_post or parts["mlp"], parallel,
                            1.0 if abs(s - 1.0) < 1e-3 else round(s, 6), window, layer_type))
    plan = list(getattr(config, "base_model_pp_plan", None) or {})
    embed = getattr(base, plan[0], None) if plan else None
    embed = embed if isinstance(embed, torch.nn.Embedding) else next(
        (m for m in base.children() if isinstance(m, torch.nn.Embedding)), None)
    final = next((getattr(base, name) for name in reversed(plan) if _is_norm(getattr(base, name, None))), None)
    if final is None:
        final = next((m for name, m in base.named_children() if _is_norm(m)), None)
    rotary = next((m for name, m in base.named_children() if "rotary" in name), None)
    takes_type = rotary is not None and len(inspect.signature(rotary.forward).parameters) >= 3
    with torch.no_grad():
        embedded = embed(ids[None].to(embed.weight.device)) if embed is not None else None
    embed_scaled = embedded is None or not torch.allclose(embedded.to(seen[0]["layer_in"].dtype),
                                                          seen[0]["layer_in"], atol=1e-6)
    anatomy = Anatomy(family, base, layer_list, tuple(layers), embed, final, rotary, rotary_takes_type=takes_type,
                      embed_scaled=embed_scaled)
    return _with_resume(anatomy, seen, ids)


def _name(modules: dict, module) -> str:
    return next(name for name, m in modules.items() if m is module)


def _with_resume(anatomy: Anatomy, seen, ids) -> Anatomy:
    """Whether a forward can resume at any layer from that layer's input: every layer is called with keyword
    arguments the engine can make again, and its position embeddings are the base model's rotary embedding of
    the positions (checked against what the probe's forward passed)."""
    from dataclasses import replace

    why = ""
    extra = sorted(set().union(*(r.get("kwargs", set()) for r in seen)) - RESUMABLE_KWARGS)
    if extra:
        why = f"its layers take {', '.join(extra)}"
    elif anatomy.rotary is None and any(r.get("position_embeddings") is not None for r in seen):
        why = "its position embeddings do not come from one rotary embedding"
    elif anatomy.rotary is None:
        pass  # learned positions are added before the first layer: a layer's input already holds them
    else:
        positions = torch.arange(len(ids))[None]
        for record, layer in zip(seen, anatomy.layers):
            given = record.get("position_embeddings")
            if given is None:
                why = "its layers are not given position embeddings"
                break
            h = record["layer_in"]
            with torch.no_grad():
                made = anatomy.position_embeddings(h, positions.to(h.device), layer)
            if not all(torch.allclose(x, y) for x, y in zip(made, given)):
                why = "its layers' position embeddings are not its rotary embedding's"
                break
    names = frozenset().union(*(r.get("names", set()) for r in seen)) - {"hidden_states"}
    attn_names = frozenset().union(*(r.get("attn_names", set()) for r in seen)) - {"hidden_states"}
    return replace(anatomy, resumable=not why,
                   why_not_resumable=why and f"{anatomy.family} cannot resume a forward from a layer: {why}",
                   layer_kwargs=names, attn_kwargs=attn_names)


def decoder_layers(model) -> "torch.nn.ModuleList | None":
    """The decoder layers a forward can resume from (:func:`attnviz.core.engine.forward.resume`), or None for a model that
    must run from its embeddings (its anatomy says why: :attr:`Anatomy.why_not_resumable`)."""
    if getattr(model.config, "is_encoder_decoder", False):
        return None
    try:
        found = of(model)
    except InputError:
        return None
    return found.layer_list if found.resumable else None
