"""Sidebar controls (kept in session state across pages) and the cached model and captures."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import streamlit as st

from attnviz.core import arch as arch_mod
from attnviz.core import devices, interventions
from attnviz import plan as plan_mod
from attnviz.capture import Capture, capture, estimate_bytes, tokenize
from attnviz.errors import AttnvizError
from attnviz.core.lru import ByteLRU
from attnviz.core.models import DEFAULT, LoadedModel, load
from attnviz.recipe import Recipe
from attnviz.core.residual import METHODS
from ui import jobs

EXAMPLES = {
    "Lighthouse (English, 48 tokens)": (
        "The old lighthouse keeper climbed the narrow stairs every evening to light the lamp. "
        "Ships passing the rocky coast relied on its steady beam, and in fifty years he had never "
        "missed a single night, not even during the great storm of the winter."),
    "Causal mask (seed 001)": (
        "The causal mask stops each token from looking at the tokens after it, so the model cannot "
        "cheat by reading the word it is supposed to predict."),
    "Code": "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Short": "The cat sat on the mat.",
}
DEFAULT_EXAMPLE = "Lighthouse (English, 48 tokens)"
MAX_TOKENS = int(os.environ.get("ATTNVIZ_MAX_TOKENS", "0")) or None  # None: the model's own context


def setting_mb(name: str, default: int) -> int:
    """A size in MB: the environment (``ATTNVIZ_<NAME>_MB``) first, then the app's Streamlit secrets
    (``.streamlit/secrets.toml``: ``[attnviz]`` ``<name>_mb = ...``, Streamlit's place for an app's
    own settings, since its config.toml takes only Streamlit's options), then ``default``."""
    value = os.environ.get(f"ATTNVIZ_{name.upper()}_MB", "")
    if not value:
        try:
            value = st.secrets.get("attnviz", {}).get(f"{name.lower()}_mb", "")
        except FileNotFoundError:  # no secrets file (StreamlitSecretNotFoundError is one)
            value = ""
    return int(value or default)


def full_maps_limit() -> int:
    """Above this estimated size (``ATTNVIZ_FULL_MAPS_MB``, default 1 GB: ~1,400 tokens on the default
    model) a capture keeps statistics and 512-px max-pooled maps of every layer instead of full maps;
    regions zoom back to full resolution."""
    return setting_mb("full_maps", 1024) * 2**20


POOL = plan_mod.POOL  # cells a side of a long capture's pooled maps (the library's plan decides)
PICKS = ["FWD", "BACK", "BIDIR", "NoSink-FWD", "NoSink-BIDIR", "INPLACE-BIDIR", "INPLACE-BACK", "MASK0-FWD",
         "MASK0-BIDIR", "MASK0-ALL", "MASK0&BIDIR", "StableMask", "Sliding window", "Dilated window",
         "Global + sliding", "Advanced (string)"]
_lock = threading.Lock()
_load_lock = threading.Lock()


@dataclass
class Settings:
    model: str
    text: str
    arch: str
    residual: str | None = None  # a seed-003 variant (docs/methods.md#residual-variants), or None
    intervene: str | None = None  # interventions beside the architecture (docs/methods.md#interventions), or None
    prepend: str | None = None  # the BOS control: "bos", or None


@st.cache_resource(show_spinner=False)
def _models() -> dict:
    return {}


def capture_budget() -> int:
    """Bytes the shared capture cache may hold: ``ATTNVIZ_MEMORY_MB`` (or ``memory_mb`` in the app's
    secrets, :func:`setting_mb`), else a quarter of the machine's memory. Bounded by bytes, not
    count: one 2,048-token capture weighs ~2.3 GB."""
    mb = setting_mb("memory", 0)
    if mb > 0:
        return mb * 2**20
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


@st.cache_resource(show_spinner=False)
def _captures() -> ByteLRU:
    return ByteLRU(capture_budget())


@st.cache_resource(show_spinner=False)
def _failed_models() -> dict:
    return {}


def get_model(name: str, trust_remote_code: bool = False, wait: bool = True,
              device_map: str | None = None) -> LoadedModel | None:
    """The loaded model, shared by all sessions; shows progress on first load and errors in the page.

    A failed load is remembered for that name (every rerun would otherwise look it up again, ~24 s
    each where the Hub cannot be reached) until the user presses Retry. ``wait=False`` returns the
    model only if it is already loaded: pages that need none never wait for one.
    """
    key = (name, trust_remote_code) if device_map is None else (name, trust_remote_code, device_map)
    store, failed = _models(), _failed_models()
    if key in store:
        return store[key]
    if key in failed:
        st.error(f"Model: {failed[key]}")
        if st.button("Retry loading the model", key="model_retry"):
            failed.pop(key, None)
            st.rerun()
        return None
    if not wait:
        return None
    # One load at a time, for every session: sessions opened together would otherwise each load the
    # model, and transformers' loading is not thread-safe (concurrent loads fail on meta tensors).
    with _load_lock:
        if key in store:  # loaded by another session while this one waited
            return store[key]
        if key in failed:
            st.error(f"Model: {failed[key]}")
            return None
        try:
            with st.status(f"Loading model {name} …", expanded=False) as status:
                start = time.perf_counter()
                loaded = load(name, trust_remote_code=trust_remote_code, device_map=device_map,
                              progress=status.write)
                status.update(label=f"Loaded {loaded.model_id} in {time.perf_counter() - start:.1f} s",
                              state="complete")
        except AttnvizError as err:
            failed[key] = str(err)
            st.error(f"Model: {err}")
            return None
        with _lock:
            store[key] = loaded
    return loaded


def _weights_bytes(loaded: LoadedModel, host_only: bool = False) -> int:
    return sum(p.numel() * p.element_size() for p in loaded.model.parameters()
               if not host_only or p.device.type == "cpu")


def models_bytes() -> int:
    """What the loaded models' weights take: they count against the memory budget."""
    return sum(_weights_bytes(m, host_only=True) for m in list(_models().values()))


def sweep_room(models: list[str]) -> str | None:
    """Why a sweep of ``models`` started from the app would not fit the memory budget, or None.

    Its Ray worker loads its own copy of each model beside this server's, so the page runs models the
    server has loaded (their size is known) and only while one more copy fits what the budget leaves."""
    loaded = {key[0]: m for key, m in _models().items()}
    unknown = [m for m in models if m not in loaded]
    if unknown:
        return (f"the page sweeps models this server has loaded ({', '.join(loaded) or 'none yet'}), so that their "
                f"memory is known; for {', '.join(unknown)} run `attnviz sweep` from a terminal")
    need = max(_weights_bytes(loaded[m]) for m in models)
    left = capture_budget() - models_bytes()
    if need > left:
        return (f"a worker's copy of the model takes ~{devices.mb(need)} and the memory budget leaves "
                f"{devices.mb(max(left, 0))} (ATTNVIZ_MEMORY_MB); run `attnviz sweep` from a terminal")
    return None


def captures_left() -> int:
    """Bytes the capture cache may use: the budget less the model weights (evicting older captures)."""
    store = _captures()
    store.budget = max(0, capture_budget() - models_bytes())
    return store.budget


def _full_maps(loaded: LoadedModel, n_tokens: int, hidden: bool) -> tuple[int, int]:
    """(estimated bytes of a capture with full maps of every layer, the per-capture limit they must fit)."""
    return estimate_bytes(loaded, n_tokens, hidden_states=hidden), min(captures_left(), full_maps_limit())


def plan_capture(loaded: LoadedModel, n_tokens: int, hidden: bool, extras: tuple,
                 residual) -> tuple[dict, int] | None:
    """The library's plan (:func:`attnviz.plan.plan`) under this server's memory budget, as (capture
    options, estimated bytes); its refusal is shown with the budget it was measured against."""
    try:
        planned = plan_mod.plan(loaded, n_tokens, full_maps_limit(), captures_left(), hidden, extras, residual,
                                checkpoint_bytes=setting_mb("checkpoint", 512) * 2**20)
    except plan_mod.CaptureTooLarge as err:
        st.error(f"{err} The memory budget: ATTNVIZ_MEMORY_MB {devices.mb(capture_budget())}, of which the model "
                 f"weights take {devices.mb(models_bytes())}.")
        return None
    return planned.options, planned.estimate


_counts: OrderedDict = OrderedDict()  # (model, text) -> token count: plans ask on every rerun, decoding 8k tokens each


def token_count(loaded: LoadedModel, text: str, prepend: str | None = None) -> int:
    """The number of tokens ``capture`` will see (raising its refusals: empty text, too long), remembered
    for the last 32 texts that passed."""
    key = (loaded.model_id, text, prepend)
    with _lock:
        n = _counts.get(key)
    if n is None:
        n = len(tokenize(loaded, text, MAX_TOKENS, prepend)[0])
        with _lock:
            _counts[key] = n
            while len(_counts) > 32:
                _counts.popitem(last=False)
    return n


def fits_full_maps(loaded: LoadedModel, text: str, hidden: bool = True) -> bool:
    """Whether a capture of ``text`` keeps full maps of every layer (else statistics and pooled maps)."""
    try:
        n_tokens = token_count(loaded, text)
    except AttnvizError:
        return True  # get_capture says what is wrong
    full, limit = _full_maps(loaded, n_tokens, hidden)
    return full <= limit


def get_capture(loaded: LoadedModel, text: str, spec: str, hidden: bool = True,
                extras: tuple[str, ...] = (), residual: str | None = None, intervene: str | None = None,
                prepend: str | None = None) -> Capture | None:
    """Cached by (model, text, architecture): moving a layer or head slider never re-runs the model.

    ``extras`` names what else the pass records, only for the views that ask: "scores" (pre-softmax),
    "value_norms", "activations"; the default capture stays as cheap as it was. Long texts get
    statistics and pooled maps (:func:`plan_capture`); older captures leave the cache before a new
    one is computed, so the server's resident size stays near its budget.
    """
    try:
        architecture = arch_mod.parse(spec, loaded.n_layers)
    except AttnvizError as err:
        st.error(f"Architecture: {err}")
        return None
    try:
        acts = interventions.parse(intervene, loaded.n_layers, loaded.n_heads)
    except AttnvizError as err:
        st.error(f"Intervention: {err}")
        return None
    try:
        made_with = Recipe.of(loaded, architecture, acts, prepend, residual)
        n_tokens = token_count(loaded, text, prepend)
    except AttnvizError as err:
        st.error(f"Capturing {architecture.spec}: {err}")
        return None
    extras = tuple(sorted(extras))
    hidden = hidden and not residual  # a variant's own layer loop records no hidden states
    planned = plan_capture(loaded, n_tokens, hidden, extras, residual)
    if planned is None:
        return None
    plan, estimate = planned
    options = {"hidden_states": hidden, **plan, **{name: True for name in extras}}
    key = (made_with.key, text, tuple(sorted((k, v) for k, v in options.items() if k != "checkpoints")))
    store = _captures()
    if key not in store:
        store.reserve(estimate)
        # Evicted captures can sit in reference cycles (Streamlit's script frames and callbacks) that
        # only the cycle collector frees, and their large buffers never trigger it: collect now, so
        # their memory is back before the new capture is built (measured: +4 GB after five captures
        # without this, +90 MB with it).
        gc.collect()
    label = (f"Capturing {architecture.spec}" + (f" with {acts.spec}" if acts else "")
             + (" (long text: statistics and pooled maps)" if plan else ""))
    return jobs.run(key, label, lambda progress: capture(
        loaded, text, made_with, max_tokens=MAX_TOKENS,
        on_layer=lambda layer: progress(layer + 1, loaded.n_layers), **options), store=store)


def get_seq2seq_capture(loaded: LoadedModel, source: str, target: str, spec: str):
    """An encoder-decoder's three kinds of attention (attnviz.seq2seq), cached like captures."""
    from attnviz import seq2seq

    n_enc = len(seq2seq.attention_stacks(loaded.model)["encoder"])
    try:
        architecture = arch_mod.parse(spec, n_enc)
    except AttnvizError as err:
        st.error(f"Encoder architecture: {err}")
        return None
    key = ("seq2seq", loaded.model_id, source, target.strip(), architecture.spec)
    return jobs.run(key, f"Capturing encoder ({architecture.spec}), decoder and cross-attention",
                    lambda progress: seq2seq.capture_seq2seq(loaded, source, target, architecture,
                                                             max_tokens=MAX_TOKENS, on_layer=progress),
                    store=_captures())


def _arch_controls(n_layers: int) -> str:
    if "arch_apply" in st.session_state:  # set by the mask designer's "Use this architecture"
        st.session_state["arch_pick"] = "Advanced (string)"
        st.session_state["arch_text"] = st.session_state.pop("arch_apply")
    pick = st.selectbox("Architecture", PICKS, key="arch_pick",
                        help="Mask types and the per-layer architectures of 'Look Both Ways and No Sink'")
    top = min(8, n_layers)
    if pick in ("INPLACE-BIDIR", "INPLACE-BACK", "MASK0-FWD", "MASK0-BIDIR", "MASK0-ALL", "MASK0&BIDIR"):
        k = st.slider("k: converted top layers", 0, n_layers, min(st.session_state.get("arch_k", top), n_layers),
                      key="arch_k")
        if pick == "MASK0&BIDIR":
            k0 = st.slider("k0: top layers with NoSink-BIDIR", 0, k, min(st.session_state.get("arch_k0", k // 2), k),
                           key="arch_k0")
            return f"mask0&bidir(k={k}, k0={k0})"
        return f"{pick.lower()}(k={k})"
    if pick in ("NoSink-FWD", "NoSink-BIDIR"):
        m = st.slider("m: hidden first keys", 1, 8, 1, key="arch_m")
        return pick.lower() + (f"(m={m})" if m > 1 else "")
    if pick == "StableMask":
        horizon = st.number_input("SM-I: training length T (0: full StableMask)", 0, 1 << 20, 0, key="arch_T",
                                  help="SM-I folds the future slots up to T into one logit per row: it works with "
                                       "a KV cache and equals StableMask at n = T")
        suffix = f", T={horizon}" if horizon else ""
        if st.toggle("per-head ALiBi slopes", key="arch_alibi"):
            return f"stablemask(slopes=alibi{suffix})"
        gamma = st.slider("gamma", 0.05, 2.0, 0.5, 0.05, key="arch_gamma")
        return f"stablemask(gamma={gamma:g}{suffix})"
    if pick == "Sliding window":
        w = st.number_input("w: window", 1, 8192, 16, key="arch_w")
        return f"sliding(w={w})"
    if pick == "Dilated window":
        w = st.number_input("w: keys per window", 1, 8192, 8, key="arch_dw")
        d = st.number_input("d: dilation", 1, 64, 2, key="arch_d")
        return f"dilated(w={w}, d={d})"
    if pick == "Global + sliding":
        w = st.number_input("w: window", 1, 8192, 16, key="arch_gw")
        g = st.number_input("g: global tokens", 0, 64, 1, key="arch_g")
        return f"global(w={w}, g={g})"
    if pick == "Advanced (string)":
        return st.text_input("Architecture string (docs/methods.md#the-call-syntax)", "fwd*22 + bidir*4 + nosink-bidir*4", key="arch_text",
                             help="e.g. mask0&bidir(k=8, k0=4) or fwd*26 + nosink-bidir*4")
    return pick.lower()


INTERVENTIONS = ["none", "sinkscale (ACT)", "sinklogit", "temperature", "ablate heads", "Advanced (string)"]


def _intervention_controls(n_layers: int, n_heads: int) -> str | None:
    """The sidebar's "Intervention" (docs/methods.md#interventions): a picker with its parameters, or a free string. The
    string is checked where it is used (get_capture), which shows what is wrong."""
    pick = st.selectbox("Intervention", INTERVENTIONS, key="iv_pick",
                        help="Beyond the mask: turn the sink down (ACT), give attention somewhere else to go (a sink "
                             "logit), sharpen or flatten it, or remove heads; composes with any architecture")
    if pick == "none":
        return None
    if pick == "Advanced (string)":
        return st.text_input("Intervention string (docs/methods.md#interventions)", "sinkscale(beta=0.3)@20-29; ablate(heads=0,3)@5",
                             key="iv_text", help="sinklogit(b=B), sinkscale(key=K, beta=B), temperature(t=T), "
                                                 "ablate(heads=..., how=zero|mean), each @LAYERS, joined with ';'")
    top = f"{max(0, n_layers - 10)}-{n_layers - 1}"
    layers = st.text_input("in layers (e.g. 20-29 or 0,5,7; empty: all)", top, key="iv_layers").strip()
    where = f"@{layers}" if layers else ""
    if pick == "sinkscale (ACT)":
        beta = st.slider("beta: share of the sink's attention kept", 0.0, 1.0, 0.3, 0.05, key="iv_beta")
        key = st.number_input("sink key K", 0, 1 << 20, 0, key="iv_key")
        return f"sinkscale(key={key}, beta={beta:g}){where}"
    if pick == "sinklogit":
        b = st.number_input("b: the extra logit (0: softmax-off-by-one)", -20.0, 20.0, 0.0, 0.5, key="iv_b")
        return f"sinklogit(b={b:g}){where}"
    if pick == "temperature":
        t = st.number_input("t: scores divided by t", 0.05, 20.0, 2.0, 0.05, key="iv_t")
        return f"temperature(t={t:g}){where}"
    heads = st.multiselect("heads", list(range(n_heads)), [0], key="iv_heads")
    how = st.radio("replaced by", ["zero", "mean"], horizontal=True, key="iv_how")
    return f"ablate(heads={','.join(map(str, heads))}, how={how}){where}" if heads else None


def sidebar(needs_model: bool = True) -> tuple[Settings, LoadedModel | None]:
    """Model, text and architecture controls shared by every page; ``needs_model=False`` (walkthrough,
    mask designer) uses the model only if it is already loaded."""
    with st.sidebar:
        st.markdown("### attnviz")
        model = st.text_input("Model", DEFAULT, key="model",
                              help="'default' (SmolLM2-135M-Instruct, offline), a Hugging Face id or a local path")
        trust = st.toggle("trust remote code", False, key="trust_remote_code",
                          help="Only for models you trust: runs the model repository's own Python code")
        spread = st.selectbox("Device map", ["none", "auto"], key="device_map",
                              help="'auto' spreads a model larger than one GPU over the GPUs, the CPU and disk "
                                   "(accelerate); attnviz keeps each layer's statistics on that layer's device")
        example = st.selectbox("Example text", list(EXAMPLES), key="example")
        if st.session_state.get("_example_shown") != example:
            st.session_state["text"] = EXAMPLES[example]
            st.session_state["_example_shown"] = example
        text = st.text_area("Text", key="text", height=150)
        loaded = get_model(model.strip() or DEFAULT, trust, wait=needs_model,
                           device_map=None if spread == "none" else spread)
        if loaded is not None:
            st.caption(f"runs on `{devices.describe(loaded.model)}` · statistics in float32")
        n_layers = loaded.n_layers if loaded else 30
        spec = _arch_controls(n_layers)
        intervene = _intervention_controls(n_layers, loaded.n_heads if loaded else 9)
        bos = st.toggle("Prepend the BOS token", False, key="bos",
                        help="The first token becomes the tokenizer's BOS token (Barbero et al. 2025): the sink "
                             "pages show what that changes")
        variant = st.selectbox("Residual variant (seed 003)", ["none", *METHODS], key="residual",
                               help="Methods 1–4 of seed 003 (Llama-family models): the MLP or attention residual "
                                    "becomes the sum of earlier layers recomputed on the embeddings")
        st.caption(f"architecture: `{spec}`" + (f" · intervention `{intervene}`" if intervene else "")
                   + ("" if variant == "none" else f" · residual `{variant}`") + (" · BOS prepended" if bos else ""))
    return Settings(model=model, text=text, arch=spec, residual=None if variant == "none" else variant,
                    intervene=intervene, prepend="bos" if bos else None), loaded


def page_context() -> tuple[Settings, LoadedModel | None]:
    """The settings and model that app.py's shared sidebar put in session state.

    On a fresh server a page URL (``/compare``, a bookmark) can be the very first request. Until
    ``st.navigation`` has run once, Streamlit treats the ``pages/`` folder as old-style pages and
    runs the page without app.py (streamlit#9624), so there is no sidebar and no settings. Then we
    switch that mode off, as ``st.navigation`` itself does, and rerun: the same URL now goes
    through app.py.
    """
    if "settings" not in st.session_state:
        from streamlit.runtime.pages_manager import PagesManager

        PagesManager.uses_pages_directory = False
        st.rerun()
    return st.session_state["settings"], st.session_state["loaded"]


def current_capture(settings: Settings, loaded: LoadedModel | None, spec: str | None = None,
                    extras: tuple[str, ...] = ()) -> Capture | None:
    if loaded is None:
        return None
    if not settings.text.strip():
        st.warning("The text is empty: type something in the sidebar or pick an example.")
        return None
    if loaded.is_encoder_decoder:
        st.error(f"{loaded.model_id} is an encoder-decoder model: this page takes decoder-only models. Its encoder, "
                 "decoder and cross-attention are on the Heatmaps page.")
        return None
    return get_capture(loaded, settings.text, spec or settings.arch, extras=extras, residual=settings.residual,
                       intervene=settings.intervene, prepend=settings.prepend)
