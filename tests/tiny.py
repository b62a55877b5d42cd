"""Tiny random-init decoders built from configs: no weights are downloaded."""

import torch
from transformers import AutoModelForCausalLM

from attnviz.core.loading.models import LoadedModel

VOCAB = 96


def _configs():
    from transformers import (Gemma2Config, GPT2Config, GptOssConfig, LlamaConfig, MistralConfig,
                              Phi3Config, Qwen2Config)

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, max_position_embeddings=512)
    return {
        "llama": LlamaConfig(num_key_value_heads=2, **common),
        "qwen2": Qwen2Config(num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                             max_window_layers=1, **common),
        "mistral": MistralConfig(num_key_value_heads=1, sliding_window=5, **common),
        "gemma2": Gemma2Config(num_key_value_heads=2, head_dim=8, sliding_window=4,
                               attn_logit_softcapping=5.0, final_logit_softcapping=30.0, **common),
        "phi3": Phi3Config(num_key_value_heads=4, pad_token_id=0, **common),
        "gpt2": GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=512),
        "gpt_oss": GptOssConfig(num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=4, **common),
    }


ARCHS = tuple(_configs())


def _more_configs():
    """Tiny random configs of the decoder families beyond :data:`ARCHS` that transformers builds: the conformance
    matrix's (tests/test_conformance.py). Each family's own options are set so its particular case is exercised:
    windows, q/k norms, post-norms, parallel blocks, partial rotary, NoPE layers, a residual multiplier, experts and
    multi-head latent attention."""
    from transformers import AutoConfig

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    own = {
        "qwen3": dict(head_dim=8),
        "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8),
        "gemma3_text": dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
        "olmo2": {},
        "olmo3": dict(sliding_window=4),
        "gpt_neox": dict(rotary_pct=0.5),
        "smollm3": dict(no_rope_layer_interval=2, pad_token_id=0),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
        "granite": dict(residual_multiplier=0.5, embedding_multiplier=2.0, attention_multiplier=0.3, logits_scaling=2.0),
        "starcoder2": dict(sliding_window=4),
        "cohere2": dict(sliding_window=4),
        "phi": dict(partial_rotary_factor=0.5),
        "gemma": dict(head_dim=8),
        "glm4": dict(head_dim=8, pad_token_id=0),
        "exaone4": dict(sliding_window=4),
        "seed_oss": dict(head_dim=8),
        "apertus": {},
        "ernie4_5": {},
        "olmoe": dict(num_experts=4, num_experts_per_tok=2),
        "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                            first_k_dense_replace=1, n_group=1, topk_group=1),
    }
    return {name: AutoConfig.for_model(name, **{**common, **extra}) for name, extra in own.items()}


MORE = ("qwen3", "qwen3_moe", "gemma3_text", "olmo2", "olmo3", "gpt_neox", "smollm3", "mixtral", "granite",
        "starcoder2", "cohere2", "phi", "gemma", "glm4", "exaone4", "seed_oss", "apertus", "ernie4_5", "olmoe",
        "deepseek_v3")
FAMILIES = tuple(a for a in ARCHS if a != "gpt2") + MORE + ("gpt2",)  # every decoder family the matrix covers


def build(kind: str, attn: str = "eager", seed: int = 0):
    torch.manual_seed(seed)
    config = _configs()[kind] if kind in ARCHS else _more_configs()[kind]
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    model.eval()
    if kind == "gpt_oss":  # random sinks far from 0 so the learned sink visibly takes mass
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def pair(kind: str, seed: int = 0):
    """The same weights twice: stock eager, and a copy attnviz will switch over."""
    stock = build(kind, "eager", seed)
    ours = build(kind, "eager", seed)
    ours.load_state_dict(stock.state_dict())
    return stock, ours


class CharTokenizer:
    """One token per character (ids 3..), enough for capture() on tiny models."""

    def __call__(self, text, add_special_tokens=True, **kwargs):  # HF tokenizers take verbose= etc.
        return {"input_ids": [3 + (ord(c) % (VOCAB - 3)) for c in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def loaded(kind: str = "llama", seed: int = 0) -> LoadedModel:
    return LoadedModel(build(kind, "eager", seed), CharTokenizer(), f"tiny-{kind}", None, 0.0)


# --- encoder-decoders (attnviz.seq2seq) ---------------------------------------------------------
S2S_VOCAB = 128


def char_tokenizer():
    """A real fast tokenizer (one token per printable character, ``</s>`` appended) that saves with
    ``save_pretrained`` and loads back with ``AutoTokenizer``, like a Hub one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{chr(c): c - 29 for c in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def seq2seq_config(kind: str):
    from transformers import BartConfig, T5Config

    if kind == "t5":
        return T5Config(vocab_size=S2S_VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                        num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return BartConfig(vocab_size=S2S_VOCAB, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                      decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
                      pad_token_id=0, eos_token_id=1, bos_token_id=1, decoder_start_token_id=1,
                      forced_eos_token_id=None)


S2S = ("t5", "bart")


def seq2seq_pair(kind: str, seed: int = 0):
    """The same random encoder-decoder twice: stock eager, and a copy attnviz will switch over."""
    from transformers import AutoModelForSeq2SeqLM

    models = []
    for _ in range(2):
        torch.manual_seed(seed)
        models.append(AutoModelForSeq2SeqLM.from_config(seq2seq_config(kind), attn_implementation="eager").eval())
    models[1].load_state_dict(models[0].state_dict())
    return models


def seq2seq_loaded(kind: str = "t5", seed: int = 0) -> LoadedModel:
    return LoadedModel(seq2seq_pair(kind, seed)[1], char_tokenizer(), f"tiny-{kind}", None, 0.0)


def half_agrees(reference: LoadedModel, half: LoadedModel, text: str) -> None:
    """What the deep pages run holds on ``half`` (a half-precision copy of ``reference``, on any device): the doctor's
    checks of score attribution, ``patch`` and routes pass against stock transformers, and the top layer's sink-key
    score and the causal check's sink drop agree with ``reference``'s within 2 % and 0.05 (docs/methods.md#devices)."""
    import pytest

    from attnviz import doctor
    from attnviz.effects import causal
    from attnviz.effects.explain import explain

    for check in doctor.capabilities(half, text):
        assert check.status == "PASS", check.line()
    ref, got = (explain(m, text, "fwd", layer=-1, head=0, query="all", key=0) for m in (reference, half))
    assert got.score == pytest.approx(ref.score, rel=0.02, abs=0.02)
    drops = [causal.check(m, text, "fwd", ["mlp.0"])[0].drop() for m in (reference, half)]
    assert drops[1] == pytest.approx(drops[0], abs=0.05)


def long_kernel_case(device: str, dtype: torch.dtype, causal: bool, one_pass: bool = True,
                     tile: tuple[int, int] = (64, 64)) -> tuple[dict, dict]:
    """The fused statistics kernel at a launch geometry (``tile``: 64 x 64 by default; head dim 128, grouped queries) on
    600 causal keys (a partial last block) with a factor-64 pooled map (one cell a tile), given every row's
    log-sum-exp (``one_pass``, as the attention kernel gives it) or finding it; and the same sums computed in
    float64 from the full probabilities: (kernel's, expected), float64 on the CPU, keyed alike."""
    from attnviz.core.spec import allowsets
    from attnviz.core.kernel import kernels
    from attnviz.core.record.reduce import pool_factor

    n, heads, kv_heads, dim, cells = 600, 4, 2, 128, 10
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(heads, n, dim, generator=gen).to(dtype)
    k = torch.randn(kv_heads, n, dim, generator=gen).to(dtype)
    allow = torch.ones(n, n, dtype=torch.bool).tril()
    delim = (torch.arange(n) % 9 == 4).float()
    factor = pool_factor(n, cells)
    assert factor == kernels.BLOCK_M == kernels.BLOCK_N  # one cell a default tile; larger tiles span cells
    scores = (q.double() @ k.double().repeat_interleave(heads // kv_heads, 0).transpose(-1, -2)) * dim ** -0.5
    lse = torch.logsumexp(scores.masked_fill(~allow, float("-inf")), -1).float().to(device) if one_pass else None
    raw = kernels.layer_statistics(q.to(device), k.to(device), None if causal else allow.to(device),
                                   allowsets._block_ranges(allow[None, None], tile[0]), dim ** -0.5,
                                   delim.to(device), factor, (cells, cells), causal=causal, lse=lse, block=tile)
    probs = torch.softmax(scores.masked_fill(~allow, float("-inf")), -1)
    side = cells * factor  # padded with zero probabilities to whole cells (a maximum of probabilities is >= 0)
    padded = torch.nn.functional.pad(probs, (0, side - n, 0, side - n))
    expected = {"rowsum": probs.sum(-1), "plogp": torch.special.xlogy(probs, probs).sum(-1), "colsum": probs.sum(1),
                "diag": torch.diagonal(probs, dim1=-2, dim2=-1), "key0": probs[:, :, 0],
                "delim": probs @ delim.double(),
                "pooled": padded.reshape(heads, cells, factor, cells, factor).amax(dim=(2, 4))}
    return {name: raw[name].double().cpu() for name in expected}, expected


def lab_training(kind: str):
    """A tiny lab model of ``kind`` ready for a training forward through the recipe (width 32, two heads,
    Bigram-Backcopy of 16 tokens): ``(model, loaded, built, x)``, x one batch of 4 sequences."""
    from attnviz import recipe
    from attnviz.core import engine
    from attnviz.lab import train as lab
    from attnviz.lab.tasks import BigramBackcopy

    setup = lab.Setup(kind=kind, width=32, heads=2, batch=4, device="cpu",
                      task=BigramBackcopy(vocab=16, triggers=2, length=16))
    model = lab.build(setup)
    engine.prepare(model)
    lm = LoadedModel(model, setup.tokenizer(), "lab", None, 0.0)
    return model, lm, recipe.build(lm, "fwd"), setup.task.batch(setup.batch, 1)
