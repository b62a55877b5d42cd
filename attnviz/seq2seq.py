"""Encoder-decoder models (T5, BART, Marian ...): encoder self-attention, decoder self-attention and
decoder → encoder cross-attention from one teacher-forced forward (docs/methods.md#cross-attention, seed 004).

The architecture applies to the encoder's self-attention, which is how seed 004's "encoder with a
causal mask" is built; the stock encoder is ``bidir``. The decoder's self-attention stays causal
and cross-attention sees every real source token (only source padding is masked). Each stack comes
back as an ordinary :class:`~attnviz.capture.Capture`, so heatmaps, exports and data downloads
work unchanged; cross-attention's rows are target tokens (``query_tokens``) and its columns
source tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from attnviz.capture import Capture, versions
from attnviz.tokens import tokenize
from attnviz.core.spec import arch as arch_mod
from attnviz.core import engine
from attnviz.core.record import recorders
from attnviz.core.loading.models import LoadedModel
from attnviz.errors import InputError, ModelLoadError

#: The attention stacks of an encoder-decoder, by name.
STACKS = {"encoder": "encoder self-attention", "decoder": "decoder self-attention",
         "cross": "cross-attention (target → source)"}
STOCK_ENCODER = "bidir"
MAX_NEW_TOKENS = 32


@dataclass
class Seq2SeqCapture:
    source: str
    target: str
    generated: bool  # the target is the model's own greedy output under the encoder architecture
    encoder: Capture
    decoder: Capture
    cross: Capture

    def as_json(self) -> dict:
        """What `attnviz capture` prints of an encoder-decoder beside the files it wrote (docs/cli.md)."""
        return {"model": self.encoder.meta["model"], "encoder_arch": self.encoder.arch, "target": self.target,
                "generated": self.generated, "n_source_tokens": self.encoder.n_tokens,
                "n_target_tokens": self.decoder.n_tokens, "forward_s": round(self.encoder.timing["forward_s"], 4)}

    def view(self, stack: str) -> Capture:
        """The capture of one stack of :data:`STACKS`."""
        if stack not in STACKS:
            raise InputError(f"unknown attention type '{stack}'; choose one of {', '.join(STACKS)}")
        return getattr(self, stack)


def require(loaded: LoadedModel) -> None:
    if not loaded.is_encoder_decoder:
        raise InputError(f"{loaded.model_id} is a decoder-only model: it has no encoder and no cross-attention "
                         "(load an encoder-decoder such as T5, BART or Marian)")


def attention_stacks(model) -> dict[str, list]:
    """Each stack's attention modules, bottom layer first, or a refusal naming what is missing.

    Attention modules are the ``*Attention`` modules with a ``layer_idx``; in the decoder the causal
    ones are self-attention and the others cross-attention (``is_causal``, as T5 and BART set it).
    """
    def found(root):
        mods = [m for m in root.modules() if type(m).__name__.endswith("Attention")
                and hasattr(m, "layer_idx") and hasattr(m, "is_causal")]
        return sorted(mods, key=lambda m: m.layer_idx)

    encoder, decoder = found(model.get_encoder()), found(model.get_decoder())
    stacks = {"encoder": encoder, "decoder": [m for m in decoder if m.is_causal],
              "cross": [m for m in decoder if not m.is_causal]}
    if not encoder or not stacks["decoder"] or len(stacks["decoder"]) != len(stacks["cross"]):
        raise ModelLoadError(f"cannot find the encoder, decoder and cross-attention modules of "
                             f"{type(model).__name__}; attnviz knows T5-, BART- and Marian-style layouts")
    return stacks


def _runs(model, src_ids: torch.Tensor, tgt_len: int, encoder_masks: list, storage_dtype, on_layer,
          which=tuple(STACKS), record: bool = True) -> engine.Stacks:
    stacks = attention_stacks(model)
    if len(encoder_masks) != len(stacks["encoder"]):
        raise ValueError(f"{len(encoder_masks)} masks for an encoder with {len(stacks['encoder'])} layers")
    n_dec = len(stacks["decoder"])
    src_pos, src_valid = torch.arange(src_ids.shape[1])[None], torch.ones_like(src_ids, dtype=torch.bool)
    tgt_pos = torch.arange(tgt_len)[None]
    masks = {"encoder": list(encoder_masks), "decoder": list(arch_mod.parse("fwd", n_dec).layers),
             "cross": list(arch_mod.parse("bidir", n_dec).layers)}
    done = [0]
    total = sum(len(stacks[s]) for s in which)

    def step(_layer):
        done[0] += 1
        if on_layer:
            on_layer(done[0], total)

    runs = {}
    for stack in which:
        q_pos = tgt_pos if stack != "encoder" else None
        positions, valid = (tgt_pos, torch.ones_like(tgt_pos, dtype=torch.bool)) if stack == "decoder" \
            else (src_pos, src_valid)
        runs[stack] = engine.Run(masks[stack], frozenset(range(len(masks[stack])) if record else ()), positions, valid,
                                 recorders=recorders.for_record(engine.Record(storage_dtype=storage_dtype)),
                                 on_layer=step, q_positions=q_pos)
    routes = {id(m): (stack, i) for stack in which for i, m in enumerate(stacks[stack])}
    return engine.Stacks(runs, routes)


def _check_routed(stacks: engine.Stacks, model) -> None:
    for stack, run in stacks.runs.items():
        if len(run.probs) != len(run.masks):
            raise ModelLoadError(f"{type(model).__name__} computed {stack} attention outside transformers' attention "
                                 "interface, so attnviz cannot record it")


@torch.inference_mode()
def forward(model, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor, encoder_masks: list,
            storage_dtype=torch.float16, on_layer=None):
    """One teacher-forced forward recording every stack; returns ``(model_output, Stacks)``."""
    engine.prepare(model)
    stacks = _runs(model, input_ids, decoder_input_ids.shape[1], encoder_masks, storage_dtype, on_layer)
    with engine.active(stacks):
        output = model(input_ids=input_ids.to(model.device), decoder_input_ids=decoder_input_ids.to(model.device),
                       use_cache=False)
    _check_routed(stacks, model)
    return output, stacks


@torch.inference_mode()
def generate(model, input_ids: torch.Tensor, encoder_masks: list, max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    """Greedy output with the encoder under ``encoder_masks`` (the decoder is stock): what the
    masked model itself says, decoder start token first."""
    engine.prepare(model)
    stacks = _runs(model, input_ids, 1, encoder_masks, torch.float16, None, which=("encoder",),
                   record=False)  # nothing to keep: SDPA under the masks
    with engine.active(stacks):
        encoded = model.get_encoder()(input_ids=input_ids.to(model.device))
    ids = model.generate(encoder_outputs=encoded, attention_mask=torch.ones_like(input_ids).to(model.device),
                         max_new_tokens=max_new_tokens, do_sample=False, num_beams=1)
    return ids[0].tolist()


def _heads(probs: dict) -> list[int]:
    return list(range(next(iter(probs.values())).shape[1]))


def capture_seq2seq(loaded: LoadedModel, source: str, target: str | None = None, arch="bidir",
                    max_tokens: int | None = None, max_new_tokens: int = MAX_NEW_TOKENS,
                    storage_dtype: torch.dtype = torch.float16, on_layer=None) -> Seq2SeqCapture:
    """Capture the three stacks for ``source`` → ``target``; an empty target is generated greedily
    (``max_new_tokens``) under the same encoder architecture. ``on_layer(done, total)`` reports progress."""
    require(loaded)
    started = time.perf_counter()
    model, tokenizer = loaded.model, loaded.tokenizer
    n_enc = len(attention_stacks(model)["encoder"])
    architecture = arch_mod.resolve(arch, n_enc)
    src_ids, src_tokens = tokenize(loaded, source, max_tokens)
    input_ids = torch.tensor([src_ids])
    generated = not (target or "").strip()
    if generated:
        if max_new_tokens < 1:
            raise InputError("max_new_tokens must be at least 1")
        dec_ids = generate(model, input_ids, list(architecture.layers), max_new_tokens)
    else:
        tgt = tokenizer(text_target=target)["input_ids"]
        dec_ids = [int(model.config.decoder_start_token_id)] + list(tgt)
    limit = max_tokens or loaded.max_tokens
    if len(dec_ids) > limit:
        raise InputError(f"the target is {len(dec_ids)} tokens long; at most {limit}: shorten it")
    dec_tokens = [tokenizer.decode([i]) for i in dec_ids]
    t0 = time.perf_counter()
    output, stacks = forward(model, input_ids, torch.tensor([dec_ids]), list(architecture.layers),
                             storage_dtype, on_layer)
    forward_s = time.perf_counter() - t0
    target_text = tokenizer.decode(dec_ids[1:]) if generated else target
    meta = {"model": loaded.model_id, "model_file": loaded.model_file, "encoder_arch": architecture.spec,
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "storage_dtype": str(storage_dtype).replace("torch.", ""), "device": str(model.device),
            "source": source, "target": target_text, "generated": generated, "versions": versions()}
    timing = {"forward_s": forward_s, "total_s": time.perf_counter() - started}

    def build(stack, text, tokens, ids, spec, layer_names, query_tokens=None, next_logprobs=None):
        run = stacks.runs[stack]
        layers = sorted(run.probs)
        return Capture(text=text, tokens=tokens, token_ids=list(ids), arch=spec, layer_masks=layer_names,
                       layers=layers, kv_groups=_heads(run.probs),
                       allowed=run.host_allowed(layers),
                       probs={l: run.probs[l][0].numpy() for l in layers}, next_logprobs=next_logprobs,
                       query_tokens=query_tokens, timing=dict(timing),
                       meta={**meta, "attention": stack, "n_layers": len(layers)})

    n_dec = len(stacks.runs["decoder"].masks)
    logprobs = torch.log_softmax(output.logits[0, -1].float(), -1).cpu().numpy()
    return Seq2SeqCapture(
        source=source, target=target_text, generated=generated,
        encoder=build("encoder", source, src_tokens, src_ids, architecture.spec, architecture.layer_names),
        decoder=build("decoder", target_text, dec_tokens, dec_ids, "fwd", ["fwd"] * n_dec, next_logprobs=logprobs),
        cross=build("cross", source, src_tokens, src_ids, "cross", ["cross"] * n_dec, query_tokens=dec_tokens),
    )
