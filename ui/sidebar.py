"""The shared sidebar: model, text, architecture, intervention, BOS control and residual variant,
kept in session state across pages, and what a page reads of it."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import streamlit as st

from attnviz.capture import Capture
from attnviz.core.spec import arch as arch_mod
from attnviz.core.model import devices
from attnviz.core.spec import interventions, kinds, masks
from attnviz.errors import AttnvizError
from attnviz.recipe import Recipe
from attnviz.core.loading.models import DEFAULT, SHIPPED, LoadedModel, shipped_installed
from attnviz.core.engine.residual import METHODS

from ui import shared
from ui.cache import get_capture, get_model

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
PICKS = ["FWD", "BACK", "BIDIR", "NoSink-FWD", "NoSink-BIDIR", "INPLACE-BIDIR", "INPLACE-BACK", "MASK0-FWD",
         "MASK0-BIDIR", "MASK0-ALL", "MASK0&BIDIR", "StableMask", "Sliding window", "Dilated window",
         "Global + sliding", "Advanced (string)"]

OWN = "the model's own"
#: the sidebar's attention kinds: the model's own, or one of the kinds without trained parameters (a what-if)
KINDS = [OWN, *kinds.what_ifs()]


@dataclass
class Settings:
    model: str
    text: str
    arch: str
    residual: str | None = None  # a seed-003 variant (docs/methods.md#residual-variants), or None
    intervene: str | None = None  # interventions beside the architecture (docs/methods.md#interventions), or None
    prepend: str | None = None  # the BOS control: "bos", or None
    kind: str | None = None  # the attention kind (docs/methods.md#attention-kinds), or None for the model's own

    def recipe(self, loaded: LoadedModel, arch: str | None = None, **changes) -> Recipe | None:
        """The recipe these settings make on ``loaded`` (:class:`attnviz.recipe.Recipe`): a page may change the
        architecture (``arch``) or ``intervene`` / ``prepend``. A bad string is shown with ``st.error``, labelled
        with the control it came from, and gives None. Nothing runs on the model's device."""
        fields = {"arch": arch or self.arch, "intervene": self.intervene, "prepend": self.prepend,
                  "residual": self.residual, "kind": self.kind, **changes}
        for label, check in (("Architecture", lambda: arch_mod.parse(fields["arch"], loaded.n_layers)),
                             ("Intervention", lambda: interventions.parse(fields["intervene"], loaded.n_layers,
                                                                          loaded.n_heads))):
            try:
                check()
            except AttnvizError as err:
                st.error(f"{label}: {err}")
                return None
        try:
            return Recipe.of(loaded, **fields)
        except AttnvizError as err:
            st.error(f"Capturing {fields['arch']}: {err}")
            return None


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
        m = st.slider("m: hidden first keys", 1, 8, arch_mod.MASKS.defaults(pick.lower())["m"], key="arch_m")
        return pick.lower() + (f"(m={m})" if m > 1 else "")
    if pick == "StableMask":
        horizon = st.number_input("SM-I: training length T (0: full StableMask)", 0, 1 << 20, 0, key="arch_T",
                                  help="SM-I folds the future slots up to T into one logit per row: it works with "
                                       "a KV cache and equals StableMask at n = T")
        suffix = f", T={horizon}" if horizon else ""
        if st.toggle("per-head ALiBi slopes", key="arch_alibi"):
            return f"stablemask(slopes=alibi{suffix})"
        gamma = st.slider("gamma", 0.05, 2.0, masks.stablemask().stable, 0.05, key="arch_gamma")  # the library's gamma
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
        g = st.number_input("g: global tokens", 0, 64, arch_mod.MASKS.defaults("global")["g"], key="arch_g")
        return f"global(w={w}, g={g})"
    if pick == "Advanced (string)":
        return st.text_input("Architecture string (docs/methods.md#the-call-syntax)", "fwd*22 + bidir*4 + nosink-bidir*4", key="arch_text",
                             help="e.g. mask0&bidir(k=8, k0=4) or fwd*26 + nosink-bidir*4")
    return pick.lower()


INTERVENTIONS = ["none", "sinkscale (ACT)", "sinklogit", "temperature", "ablate heads", "patch a block",
                 "Advanced (string)"]


def _intervention_controls(n_layers: int, n_heads: int) -> str | None:
    """The sidebar's "Intervention" (docs/methods.md#interventions): a picker with its parameters, or a free string. The
    string is checked where it is used (Settings.recipe), which shows what is wrong."""
    pick = st.selectbox("Intervention", INTERVENTIONS, key="iv_pick",
                        help="Beyond the mask: turn the sink down (ACT), give attention somewhere else to go (a sink "
                             "logit), sharpen or flatten it, remove heads, or remove a block's write at some tokens "
                             "(patch); composes with any architecture")
    if pick == "none":
        return None
    if pick == "Advanced (string)":
        return st.text_input("Intervention string (docs/methods.md#interventions)", "sinkscale(beta=0.3)@20-29; ablate(heads=0,3)@5",
                             key="iv_text", help=interventions.USAGE)
    top = f"{max(0, n_layers - 10)}-{n_layers - 1}"
    layers = st.text_input("in layers (e.g. 20-29 or 0,5,7; empty: all)", top, key="iv_layers").strip()
    where = f"@{layers}" if layers else ""
    if pick == "sinkscale (ACT)":
        beta = st.slider("beta: share of the sink's attention kept", 0.0, 1.0, 0.3, 0.05, key="iv_beta")
        key = st.number_input("sink key K", 0, 1 << 20, interventions.INTERVENTIONS.defaults("sinkscale")["key"], key="iv_key")
        return f"sinkscale(key={key}, beta={beta:g}){where}"
    if pick == "sinklogit":
        b = st.number_input("b: the extra logit (0: softmax-off-by-one)", -20.0, 20.0,
                            interventions.INTERVENTIONS.defaults("sinklogit")["b"], 0.5, key="iv_b")
        return f"sinklogit(b={b:g}){where}"
    if pick == "temperature":
        t = st.number_input("t: scores divided by t", 0.05, 20.0, 2.0, 0.05, key="iv_t")
        return f"temperature(t={t:g}){where}"
    if pick == "patch a block":
        block = st.radio("block", ["mlp", "attn"], horizontal=True, key="iv_block")
        tokens = st.text_input("at tokens (0, 0,1 or sink: each layer's sink key)", "sink", key="iv_tokens").strip()
        value = st.radio("its output there becomes", ["zero", "mean"], horizontal=True, key="iv_value")
        return f"patch(block={block}, tokens={tokens or 'sink'}, value={value}){where}"
    heads = st.multiselect("heads", list(range(n_heads)), [0], key="iv_heads")
    how = st.radio("replaced by", ["zero", "mean"], horizontal=True, key="iv_how")
    return f"ablate(heads={','.join(map(str, heads))}, how={how}){where}" if heads else None


def _pick_offline() -> None:
    """The offline model picked: it goes into the model box, which is what loads."""
    st.session_state["model"] = st.session_state["offline_model"]


@contextmanager
def _placed(elsewhere: str | None):
    """The sidebar; on a page that reads none of its settings (``elsewhere``: what that page reads instead), that
    said first, and the settings folded away below it. They are still drawn, so that they keep their values for the
    other pages (a widget that is not drawn in a run loses its state)."""
    with st.sidebar:
        st.markdown("### attnviz")
        if not elsewhere:
            yield
            return
        st.info(elsewhere)
        with st.expander("Model, text and recipe of the other pages", expanded=False):
            yield


def sidebar(needs_model: bool = True, elsewhere: str | None = None) -> tuple[Settings, LoadedModel | None]:
    """Model, text and architecture controls shared by every page; ``needs_model=False`` (walkthrough,
    mask designer) uses the model only if it is already loaded; ``elsewhere``: the page reads none of them, and this
    line says what it reads instead (:func:`_placed`)."""
    st.session_state.update(st.session_state.pop("_carried", {}))  # settings kept across a switch (switch_page)
    with _placed(elsewhere):
        rules = shared.access()
        offline = shipped_installed()
        if len(offline) > 1:  # the real models installed here, one click each; the box below takes any other
            st.selectbox("Offline model", offline, key="offline_model", on_change=_pick_offline,
                         format_func=lambda key: SHIPPED[key].name.split(" (")[0] + ("" if key == DEFAULT else f" ({key})"),
                         help="Models shipped as PyPI packages: no download. "
                              + "; ".join(f"{SHIPPED[k].name.split(' (')[0]}: {SHIPPED[k].license}" for k in offline))
        model = st.text_input("Model", DEFAULT, key="model",
                              help="'default' (SmolLM2-135M-Instruct, offline), 'gemma3-270m' (Gemma 3 270M, offline "
                                   "with attnviz[gemma3]), a Hugging Face id or a local path"
                                   + (f"; this shared server loads {', '.join(rules.models)} and model directories "
                                      f"under {', '.join(map(str, rules.roots))}" if rules.shared else ""))
        if rules.shared:  # a visitor who turns it on runs code on the server: only its own configuration may
            trust = rules.remote_code(False)
        else:
            trust = st.toggle("trust remote code", False, key="trust_remote_code",
                              help="Only for models you trust: runs the model repository's own Python code")
        allowed = shared.checked(rules.model, model)
        spread = st.selectbox("Device map", ["none", "auto"], key="device_map",
                              help="'auto' spreads a model larger than one GPU over the GPUs, the CPU and disk "
                                   "(accelerate); attnviz keeps each layer's statistics on that layer's device")
        example = st.selectbox("Example text", list(EXAMPLES), key="example")
        if st.session_state.get("_example_shown") != example:
            st.session_state["text"] = EXAMPLES[example]
            st.session_state["_example_shown"] = example
        text = st.text_area("Text", key="text", height=150)
        loaded = None if allowed is None else get_model(allowed, trust, wait=needs_model,
                                                        device_map=None if spread == "none" else spread)
        if loaded is not None:
            st.caption(f"runs on `{devices.describe(loaded.model)}` · statistics in float32")
        n_layers = loaded.n_layers if loaded else 30
        spec = _arch_controls(n_layers)
        intervene = _intervention_controls(n_layers, loaded.n_heads if loaded else 9)
        kind = st.selectbox("Attention kind", KINDS, key="kind",
                            help="What turns a row of scores into weights (docs/methods.md#attention-kinds): the "
                                 "model's own, or a what-if on its weights\n\n" + kinds.lines())
        bos = st.toggle("Prepend the BOS token", False, key="bos",
                        help="The first token becomes the tokenizer's BOS token (Barbero et al. 2025): the sink "
                             "pages show what that changes")
        variant = st.selectbox("Residual variant (seed 003)", ["none", *METHODS], key="residual",
                               help="Methods 1–4 of seed 003 (sequential pre-norm decoders, docs/methods.md#residual-variants): the MLP or attention residual "
                                    "becomes the sum of earlier layers recomputed on the embeddings")
        st.caption(f"architecture: `{spec}`" + (f" · intervention `{intervene}`" if intervene else "")
                   + ("" if variant == "none" else f" · residual `{variant}`") + (" · BOS prepended" if bos else "")
                   + ("" if kind == OWN else f" · kind `{kind}`"))
    return Settings(model=model, text=text, arch=spec, residual=None if variant == "none" else variant,
                    intervene=intervene, prepend="bos" if bos else None, kind=None if kind == OWN else kind), loaded


SETTINGS_KEYS = ("model", "offline_model", "trust_remote_code", "device_map", "example", "text", "bos", "residual", "kind",
                 "arch_pick", "arch_text", "arch_k", "arch_m", "arch_w", "arch_d", "arch_dw", "arch_g", "arch_gw",
                 "arch_gamma", "arch_alibi", "iv_pick", "iv_text", "iv_layers", "iv_heads", "iv_how", "iv_b", "iv_beta",
                 "iv_key", "iv_t", "iv_block", "iv_tokens", "iv_value")


def own_kind_only(settings: Settings, what: str) -> bool:
    """Where ``what`` runs the model's own attention kind only: with another kind picked in the sidebar, one line
    saying so (``st.info``), and True. Captures read the sidebar's kind; these analyses do not."""
    if settings.kind:
        st.info(f"{what} runs the model's own attention kind, not the sidebar's {settings.kind} "
                "(docs/methods.md#attention-kinds): pick the model's own to run it")
        return True
    return False


def switch_page(path) -> None:
    """``st.switch_page`` keeping the sidebar's settings: a switch from a script starts the next page without the
    browser's widget values, so the text and recipe are carried as plain session state and given back to the
    sidebar's widgets before they are drawn (:func:`sidebar`)."""
    st.session_state["_carried"] = {key: st.session_state[key] for key in SETTINGS_KEYS if key in st.session_state}
    st.switch_page(str(path))


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
    recipe = settings.recipe(loaded, spec)
    return None if recipe is None else get_capture(loaded, settings.text, recipe, extras=extras)
