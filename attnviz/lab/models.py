"""The lab's model family per attention kind (docs/lab.md#the-family-per-kind): stock transformers classes only,
built from a config: a kind transformers computes itself loads in plain transformers; the others, see
docs/lab.md#loading.

- ``softmax``, ``softpick``, ``sigmoid``, ``sigmoid(bias=b)``, ``sink(logit=c)``, ``relu`` (every kind without a
  stock family of its own): ``LlamaForCausalLM``, the kind in ``config.attnviz_kind`` (left out for the softmax),
  read back by the engine and by the model's own forward.
- ``sink`` (a learned logit per head): ``GptOssForCausalLM``, every layer full attention.
- ``gate`` (elementwise): ``Qwen3NextForCausalLM``, every layer full attention, every MLP dense
  (``mlp_only_layers``), rotary on the whole head (``partial_rotary_factor`` 1.0).
- ``gate(headwise)``: refused (no transformers family has a headwise gate).

Every family keeps the setup's width, heads (as many key-value heads as query heads), head size width / heads,
vocabulary and the same rotary base; without an MLP the MLP's (or the experts') weights are zero and frozen.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from attnviz.core.spec import kinds
from attnviz.errors import InputError

POSITIONS = ("rope",)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def family(kind) -> str:
    """``"llama"``, ``"gpt_oss"`` or ``"qwen3_next"``: the stock family a lab model of ``kind`` is built as, as the
    kind declares it (:meth:`attnviz.core.spec.kinds.Kind.trained_as`; gate(headwise) refused there)."""
    return kinds.parse(kind).trained_as()


def check(kind, arch: str, layers: int, positions: str) -> str:
    """Refuse in one line what the lab cannot train: an unknown kind or mask, gate(headwise), a kind the mask
    cannot carry (sigmoid, relu under StableMask), positions other than rotary. Returns the kind's canonical spec."""
    from attnviz.core.spec import arch as arch_mod

    parsed = kinds.parse(kind)
    name = family(parsed)
    if positions not in POSITIONS:
        raise InputError(f"positions {positions!r} cannot be trained: the lab's stock families have rotary "
                         "positions built in (rope) and no switch to turn them off (docs/lab.md#positions)")
    architecture = arch_mod.resolve(arch, layers)
    own = SimpleNamespace(model_type=name, attnviz_kind=None if name != "llama" else parsed.spec)
    kinds.check(parsed, own, any(m.stable is not None for m in architecture.layers))
    return parsed.spec


def config(setup, vocab: int):
    """The transformers config of ``setup`` (its kind's family) with ``vocab`` tokens."""
    name = family(setup.kind)
    head_dim = setup.width // setup.heads
    common = dict(vocab_size=vocab, hidden_size=setup.width, intermediate_size=4 * setup.width,
                  num_hidden_layers=setup.layers, num_attention_heads=setup.heads, num_key_value_heads=setup.heads,
                  head_dim=head_dim, max_position_embeddings=setup.task.length, bos_token_id=0, eos_token_id=None,
                  pad_token_id=None, tie_word_embeddings=False)
    if name == "gpt_oss":
        from transformers import GptOssConfig

        made = GptOssConfig(**common, num_local_experts=1, num_experts_per_tok=1, sliding_window=setup.task.length,
                            layer_types=["full_attention"] * setup.layers, rope_parameters=dict(ROPE),
                            attention_bias=False)
    elif name == "qwen3_next":
        from transformers import Qwen3NextConfig

        made = Qwen3NextConfig(**common, layer_types=["full_attention"] * setup.layers,
                               mlp_only_layers=list(range(setup.layers)),
                               rope_parameters={**ROPE, "partial_rotary_factor": 1.0})
    else:
        from transformers import LlamaConfig

        made = LlamaConfig(**common, rope_parameters=dict(ROPE))
        spec = kinds.parse(setup.kind).spec
        if spec != "softmax":
            made.attnviz_kind = spec
    made.attnviz_arch = setup.arch
    return made


def model_class(name: str):
    from transformers import GptOssForCausalLM, LlamaForCausalLM, Qwen3NextForCausalLM

    return {"llama": LlamaForCausalLM, "gpt_oss": GptOssForCausalLM, "qwen3_next": Qwen3NextForCausalLM}[name]


def build(setup, vocab: int):
    """A new model of ``setup``, initialised from its seed, float32."""
    made = config(setup, vocab)
    torch.manual_seed(setup.seed)
    model = model_class(family(setup.kind))(made).float()
    start = getattr(kinds.parse(setup.kind), "init", None)  # sink(init=c): every head's learned logit starts at c
    if start is not None:
        for layer in model.model.layers:
            layer.self_attn.sinks.data.fill_(float(start))
    return attention_only(model, setup)


def load(setup, folder):
    """A checkpoint's model, as trained (its MLP zero and frozen again when the setup has none)."""
    model = model_class(family(setup.kind)).from_pretrained(folder, use_safetensors=True, dtype=torch.float32)
    return attention_only(model, setup)


def attention_only(model, setup):
    """Without MLPs (``setup.mlp`` False): each MLP's (gpt-oss: the router's and the experts') weights zero and
    frozen, so each block's MLP writes exactly 0 (tested), in plain transformers too; here the zero is written
    without running the MLP (:func:`_writes_zero`): the same numbers and gradients, a step without the MLP's
    passes (gpt-oss's router and expert loop were most of a learned sink's step beyond a softmax's:
    docs/benchmarks.md#a-lab-step)."""
    if not setup.mlp:
        routed = family(setup.kind) == "gpt_oss"
        for layer in model.model.layers:
            for p in layer.mlp.parameters():
                p.data.zero_()
                p.requires_grad_(False)
            layer.mlp.forward = _writes_zero_routed if routed else _writes_zero
    return model


def _writes_zero(hidden_states):
    """A zero and frozen MLP's output, 0, without its passes. Its input times 0, not a new tensor of zeros: the
    gradient still reaches the norm before it as 0 (as through the zero weights), so AdamW's weight decay treats
    that norm's weight exactly as before."""
    return hidden_states * 0


def _writes_zero_routed(hidden_states):
    """gpt-oss's MLP returns its router's scores beside the output; its decoder layer drops them."""
    return hidden_states * 0, None


def stock_mlps(model):
    """The MLPs' own forward again (what plain transformers runs on a checkpoint): a stock baseline's."""
    for layer in model.model.layers:
        vars(layer.mlp).pop("forward", None)
    return model
