"""The server's caches: loaded models and captures (shared by every session, bounded by bytes), the
memory budget they live in, and the library's capture plan under that budget."""

from __future__ import annotations

import threading
import time

import streamlit as st

from attnviz import settings
from attnviz.core.spec import arch as arch_mod
from attnviz.effects import budget as budget_mod
from attnviz.core.model import devices
from attnviz import plan as plan_mod
from attnviz.capture import Capture, Prepared, prepare
from attnviz.tokens import TooLong, tokenize
from attnviz.errors import AttnvizError
from ui.lru import ByteLRU
from attnviz.core.loading.models import LoadedModel, load
from attnviz.plan import Keep
from attnviz.recipe import Recipe
from ui import jobs, shared

def max_tokens() -> int | None:
    """The app's token limit: ``ATTNVIZ_MAX_TOKENS`` (None: the model's own context)."""
    return settings.active().max_tokens


def setting_mb(name: str) -> int:
    """A size in MB of the app's settings (``full_maps``, ``memory``, ``checkpoint``): the environment
    (``ATTNVIZ_<NAME>_MB``) first, then the app's Streamlit secrets (``.streamlit/secrets.toml``: ``[attnviz]``
    ``<name>_mb = ...``, Streamlit's place for an app's own settings, since its config.toml takes only Streamlit's
    options), then the default (:class:`attnviz.settings.Settings`, read by :func:`ui.shared.apply_settings`)."""
    return int(getattr(settings.active(), f"{name}_mb"))


def full_maps_limit() -> int:
    """Above this estimated size (``ATTNVIZ_FULL_MAPS_MB``, default 1 GB: ~1,400 tokens on the default
    model) a capture keeps statistics and 512-px max-pooled maps of every layer instead of full maps;
    regions zoom back to full resolution."""
    return setting_mb("full_maps") * 2**20


POOL = plan_mod.POOL  # cells a side of a long capture's pooled maps (the library's plan decides)
_lock = threading.Lock()
_load_lock = threading.Lock()


@st.cache_resource(show_spinner=False)
def _models() -> dict:
    return {}


def capture_budget() -> int:
    """Bytes the shared capture cache may hold: ``ATTNVIZ_MEMORY_MB`` (or ``memory_mb`` in the app's
    secrets, :func:`setting_mb`), else a quarter of the machine's memory. Bounded by bytes, not
    count: one 2,048-token capture weighs ~2.3 GB."""
    mb = setting_mb("memory")
    if mb > 0:
        return mb * 2**20
    return budget_mod.machine_bytes() // 4


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
    dtype = settings.active().dtype
    key = key + (dtype,) if dtype else key  # a model loaded in another dtype is another model
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


def models_bytes() -> int:
    """What the loaded models' weights take: they count against the memory budget."""
    return sum(budget_mod.weights_bytes(m, host_only=True) for m in list(_models().values()))


def sweep_room(models: list[str]) -> str | None:
    """Why a sweep of ``models`` started from the app would not fit the memory budget, or None.

    Its Ray worker loads its own copy of each model beside this server's, so the page runs models the
    server has loaded (their size is known) and only while one more copy fits what the budget leaves."""
    loaded = {key[0]: m for key, m in _models().items()}
    unknown = [m for m in models if m not in loaded]
    if unknown:
        return (f"the page sweeps models this server has loaded ({', '.join(loaded) or 'none yet'}), so that their "
                f"memory is known; for {', '.join(unknown)} run `attnviz sweep` from a terminal")
    need = max(budget_mod.weights_bytes(loaded[m]) for m in models)
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


def analysis_budget() -> int:
    """Bytes one analysis of many forwards (the causal scan, path patching, activation patching) may make on this
    server: the memory budget less the model weights. The captures held leave as it starts (:func:`room_for`)."""
    return max(1, capture_budget() - models_bytes())


def room_for(plan) -> None:
    """The least recently used captures leave the cache until ``plan``'s peak (an analysis's plan,
    :class:`attnviz.effects.budget.AnalysisPlan`, given before its first forward) fits beside what stays."""
    captures_left()
    _captures().reserve(min(plan.peak, _captures().budget))


def job_tokens() -> int | None:
    """The most tokens one job captures here: the server's ``ATTNVIZ_MAX_TOKENS`` and, on a shared server, its
    per-job cap (``max_tokens`` in secrets.toml, docs/sharing.md), whichever is lower; None: the model's own limit
    (a server of one's own has no cap; the memory plan still applies)."""
    caps = [max_tokens(), shared.cap("max_tokens") if shared.access().shared else None]
    return min((c for c in caps if c), default=None)


def budget() -> plan_mod.Budget:
    """What one capture may take on this server: full maps up to :func:`full_maps_limit`, what the capture cache
    has left (:func:`captures_left`), the checkpoints' share (``ATTNVIZ_CHECKPOINT_MB``) and :func:`job_tokens`."""
    return plan_mod.Budget(full_maps_limit(), captures_left(), setting_mb("checkpoint") * 2**20, job_tokens())


def _refused(what: str, err: AttnvizError) -> None:
    """A refusal in the page: a plan's with the memory budget it was measured against, a text over a shared
    server's cap with where it can run, any other with what is wrong."""
    if isinstance(err, plan_mod.CaptureTooLarge):
        st.error(f"{err} The memory budget: ATTNVIZ_MEMORY_MB {devices.mb(capture_budget())}, of which the model "
                 f"weights take {devices.mb(models_bytes())}.")
        return
    hint = ""
    if shared.access().shared and isinstance(err, TooLong):
        hint = (f" This shared server runs at most {shared.cap('max_tokens'):,} tokens a job: shorten the text, or "
                "run it on your own machine (`attnviz capture`).")
    st.error(f"{what}: {err}{hint}")


def prepare_capture(loaded: LoadedModel, text: str, recipe: Recipe, keep: Keep) -> Prepared | None:
    """The library's capture of ``text`` keeping ``keep``, planned under this server's :func:`budget` and made
    ready to run (:func:`attnviz.capture.prepare`): asked once, its refusals shown (:func:`_refused`)."""
    try:
        return prepare(loaded, text, recipe, keep, budget())
    except AttnvizError as err:
        _refused(f"Capturing {recipe.arch}", err)
    return None


def fits_full_maps(loaded: LoadedModel, text: str, hidden: bool = True) -> bool:
    """Whether a capture of ``text`` keeps full maps of every layer (else statistics and pooled maps)."""
    try:
        return prepare(loaded, text, Recipe(loaded.model_id), Keep(hidden_states=hidden), budget()).plan.full_maps
    except AttnvizError:
        return True  # get_capture says what is wrong


def get_capture(loaded: LoadedModel, text: str, recipe: Recipe, hidden: bool = True,
                extras: tuple[str, ...] = ()) -> Capture | None:
    """The capture of ``text`` under ``recipe`` (the sidebar's :meth:`ui.sidebar.Settings.recipe`), cached by
    (recipe key, text, keep): moving a layer or head slider never re-runs the model.

    ``extras`` names what else the pass keeps, only for the views that ask: "scores" (pre-softmax),
    "value_norms", "activations"; the default capture stays as cheap as it was. The library decides, in one call
    (:func:`prepare_capture`), what a long text keeps (statistics and pooled maps) and refuses what does not fit;
    older captures leave the cache before a new one is computed, so the server's resident size stays near its
    budget.
    """
    asked = Keep.of(tuple(sorted(extras)), hidden_states=hidden and not recipe.residual)  # a variant keeps none
    prepared = prepare_capture(loaded, text, recipe, asked)
    if prepared is None:
        return None
    for note in prepared.plan.notes:  # how it runs, where that matters (a statistic the fused kernel lacks)
        st.caption(note)
    made = jobs.run(prepared.key, prepared.label, prepared.run_reporting, store=_captures(),
                    reserve=prepared.plan.estimate)
    shared.fell_back(made)  # where the fused kernel failed in this capture: the visitor is told, with the reason
    return made


def get_seq2seq_capture(loaded: LoadedModel, source: str, target: str, spec: str):
    """An encoder-decoder's three attention stacks (attnviz.seq2seq), cached like captures."""
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
                                                             max_tokens=max_tokens(), on_layer=progress),
                    store=_captures())


def _text_fits(loaded: LoadedModel, text: str, made: Recipe) -> bool:
    """The text tokenizes within this server's cap (:func:`job_tokens`); else the reason is shown."""
    try:
        tokenize(loaded, text, job_tokens(), made.prepend)
    except AttnvizError as err:
        _refused("The text", err)
        return False
    return True


def get_residual(loaded: LoadedModel, text: str, made: Recipe):
    """One recorded residual stream (attnviz.effects.explain.KeptForward) per recipe and text, in the capture
    cache: the Why page's attribution, diagnosis and query-key view all read it."""
    from attnviz.effects.explain import KeptForward

    if not _text_fits(loaded, text, made):
        return None
    return jobs.run(("residual", made.key, text), f"Recording the residual stream under {made.arch}",
                    lambda progress: KeptForward(loaded, text, made, on_layer=progress), store=_captures())


def get_flow(loaded: LoadedModel, text: str, made: Recipe):
    """Every layer's contributions (attnviz.flow.trace) per recipe and text, in the capture cache: the Routes page's
    graph, sink share and logit lens all read it."""
    from attnviz import flow

    if not _text_fits(loaded, text, made):
        return None
    return jobs.run(("routes", made.key, text), f"Measuring contributions under {made.arch}",
                    lambda progress: flow.trace(loaded, text, made, max_tokens=max_tokens(), on_layer=progress),
                    store=_captures())
