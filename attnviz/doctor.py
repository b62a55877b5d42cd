"""``attnviz doctor``: whether attnviz is right, and how fast, on this machine and this model.

Run it first on a GPU (docs/gpu.md). Every correctness check is PASS, FAIL or SKIP (with why), and carries
what it compared, what it measured, its limit and why the limit is what it is; the command exits 0 only when
no correctness check failed. Speed is reported, never judged: a speed check is TIME, with its ratio and the
ratio attnviz is built to stay under, and a plain "slower than expected" when the ratio is above it. A slow
machine is not a broken install (a 2-core Xeon with AMX runs stock bfloat16 SDPA several times faster than
the statistics route, which has no AMX path), so no timing can make the command exit non-zero.
``--json`` prints the whole report, to paste into a bug report.

1. **Environment**: torch, transformers, Triton and attnviz versions; every device with its free
   memory; the device and dtype the model runs in.
2. **Equivalence** on a short text of the model's own tokenizer (Python's reference docs). Routes are
   compared where they must agree, **layer by layer with the same layer input** (docs/methods.md#devices):
   the input every decoder layer received in attnviz's route is fed to the same layer of the reference
   (stock transformers' eager ``output_attentions``, or the full maps), so only one layer's rounding
   separates them, never the drift of hidden states through every layer below. In half precision that
   drift is larger than any sensible limit (stock bfloat16 itself differs from stock float32 by ~0.04 in
   a probability over 30 layers), while one layer's rounding is a couple of steps of the dtype:
   - full maps of every layer (the block engine) and every layer's output;
   - the top layer alone, and the outputs of the layers under it, which run through SDPA;
   - end to end in float32 (the model cast for the check when it runs in half precision): the whole
     forward, no input fed, within 1e-4: what catches an error that only shows across layers;
   - every statistic of a statistics capture against its numpy definition on the full maps;
   - long mode: pooled maps against the max-pooled full maps;
   - on CUDA, the fused kernel's statistics and pooled maps against the same definitions, on a 192-token
     text so that its one-cell pooling and, in half precision, its full tiles run (a kernel that does not
     compile or launch is a FAIL that names the fallback attnviz then uses: the block engine).
3. **Speed** on a ``tokens``-long text (at most the model's own limit): a statistics capture against a
   plain SDPA forward of the same tokens. Each timed window repeats the call until the plain forward has
   run for at least a quarter of a second (a small model's forward on a GPU takes milliseconds), timed
   with CUDA events on a GPU; on CUDA also the fused kernel against the block engine. Each is a TIME line
   (ratio, expected ratio, and "slower than expected" above it), never a FAIL.

Tolerances (:func:`tolerance`): 1e-4 in float32 (docs/methods.md#devices); two steps of the dtype at 1 in
bfloat16 (0.0156) and float16 (0.00195): each route rounds a layer's probabilities once in the dtype (half
a step at 1) and may round its scores differently by a step. Relative errors of outputs use the same
number, relative to the output's norm.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from attnviz.core import devices, precision
from attnviz.core.models import LoadedModel
from attnviz.flow import contributions

FP32_TOLERANCE = precision.FP32_TOLERANCE  # docs/methods.md#devices
FP16_STEP = 2.0 ** -10  # one float16 step, relative: what a pooled map (kept in float16) may differ by
MIN_WINDOW_S = 0.25  # a timed window runs the plain forward at least this long (repetitions fill it)
MAX_REPEATS = 200
EQUIVALENCE_TOKENS = 48
SPEED_EXPECTED = {"cpu": 3.0, "cuda": 2.0, "mps": 3.0}  # statistics capture / plain SDPA forward: what we aim for


def tolerance(dtype: torch.dtype) -> tuple[float, str]:
    """The limit for one layer's numbers computed in ``dtype`` by two routes fed the same layer input, and why
    (:func:`attnviz.core.precision.tolerance`)."""
    return precision.tolerance(dtype)


@dataclass
class Check:
    name: str
    status: str  # "PASS" | "FAIL" | "SKIP" for correctness; "TIME" for a speed report (never a verdict)
    measured: float | None = None
    limit: float | None = None
    detail: str = ""
    ratio: float | None = None  # speed checks
    compared: str = ""  # what was compared with what
    why: str = ""  # why the limit is what it is

    @classmethod
    def against(cls, name: str, measured: float, limit: float, **more) -> "Check":
        """PASS when ``measured`` is within ``limit`` (NaN is not), else FAIL."""
        return cls(name, "PASS" if measured <= limit else "FAIL", measured, limit, **more)

    @classmethod
    def timed(cls, name: str, ratio: float, expected: float, **more) -> "Check":
        """A speed report: ``ratio`` against the ratio attnviz aims for. Its status is TIME whatever the ratio;
        above ``expected`` its detail says "slower than expected" (a machine's speed is not a defect)."""
        slow = not ratio <= expected
        detail = more.pop("detail", "")
        note = f"slower than expected (aimed for at most {expected:g}x)" if slow else f"as expected (at most {expected:g}x)"
        return cls(name, "TIME", ratio, expected, detail=f"{detail} · {note}" if detail else note, ratio=ratio, **more)

    def line(self, say_why: bool = True) -> str:
        """``PASS name: measured … (limit …)``, and under it what was compared and why the limit is what it is."""
        if self.measured is None:
            numbers = ""
        elif self.status == "TIME":
            numbers = f": ratio {self.measured:.3g}"
        else:
            numbers = f": measured {self.measured:.3g} (limit {self.limit:.3g})"
        head = f"{self.status:4} {self.name}{numbers}{' · ' + self.detail if self.detail else ''}"
        label = "expected" if self.status == "TIME" else "limit"  # a timing has no limit: it is never a verdict
        said = "; ".join(part for part in (self.compared, self.why and say_why and f"{label}: {self.why}") if part)
        return head + (f"\n       {said}" if said else "")

    def as_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and (v != "" or k == "name")}


@dataclass
class Report:
    environment: dict
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.status != "FAIL" for c in self.checks)  # a TIME line is never a verdict

    def as_json(self) -> dict:
        return {"environment": self.environment, "checks": [c.as_json() for c in self.checks], "ok": self.ok}

    def text(self) -> str:
        env = self.environment
        head = [f"attnviz {env['attnviz']} · torch {env['torch']} · transformers {env['transformers']} · "
                f"triton {env['triton'] or 'not installed'} · {env['platform']}",
                "devices: " + "; ".join(f"{d['name']} ({d['free_mb'] or '?'} MB free)" for d in env["devices"]),
                f"model: {env['model']} on {env['device']} in {env['dtype']}"]
        lines, said = [], set()
        for check in self.checks:  # a limit's reason is said once, under the first check it applies to
            lines.append(check.line(say_why=check.why not in said))
            said.add(check.why)
        return "\n".join(head + lines
                         + [f"{'all checks passed' if self.ok else 'FAILED'}: "
                            f"{sum(c.status == 'PASS' for c in self.checks)} passed, "
                            f"{sum(c.status == 'FAIL' for c in self.checks)} failed, "
                            f"{sum(c.status == 'SKIP' for c in self.checks)} skipped, "
                            f"{sum(c.status == 'TIME' for c in self.checks)} timed"])


def pick_device(asked: str = "auto") -> str:
    """``auto``: ``ATTNVIZ_DEVICE`` when set, else CUDA, else MPS, else the CPU; an asked device that is not here
    is refused in one line."""
    from attnviz.errors import InputError

    have = {"cpu": True, "cuda": torch.cuda.is_available(),
            "mps": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())}
    if asked == "auto":
        if os.environ.get("ATTNVIZ_DEVICE"):
            return devices.default_device()
        return "cuda" if have["cuda"] else "mps" if have["mps"] else "cpu"
    if asked not in have:
        raise InputError(f"unknown device '{asked}': expected auto, cpu, cuda or mps")
    if not have[asked]:
        raise InputError(f"this machine has no {asked} device (torch {torch.__version__} sees: "
                         f"{', '.join(d for d, ok in have.items() if ok)})")
    return asked


def environment(loaded: LoadedModel | None = None) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    try:  # the host's available memory (Linux, macOS); None where the system does not say
        free_cpu = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20
    except (ValueError, OSError, AttributeError):
        free_cpu = None
    found = [{"name": "cpu", "free_mb": free_cpu, "cores": os.cpu_count()}]
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        free, total = torch.cuda.mem_get_info(i)
        found.append({"name": f"cuda:{i} {torch.cuda.get_device_name(i)}", "free_mb": free // 2**20,
                      "total_mb": total // 2**20,
                      "capability": ".".join(map(str, torch.cuda.get_device_capability(i)))})
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        found.append({"name": "mps", "free_mb": None})
    env = {"attnviz": v("attnviz") or "source", "torch": torch.__version__, "transformers": v("transformers"),
           "triton": v("triton"), "python": platform.python_version(), "platform": platform.platform(terse=True),
           "devices": found, "fused_kernel": os.environ.get("ATTNVIZ_FUSED", "auto"),
           # routes' exact correction on the CPU: the compiled loop where numba is installed, else torch's gathers
           # (the same numbers, about 2.4 times the time: docs/methods.md#contributions)
           "routes_correction": (f"compiled (numba {v('numba')})" if contributions._kernel() is not None
                                 else "torch (numba not installed)")}
    if loaded is not None:
        env.update(model=loaded.model_id, device=str(loaded.model.device), dtype=_dtype_name(loaded.model.dtype),
                   layers=loaded.n_layers, heads=loaded.n_heads)
    return env


@contextlib.contextmanager
def _setting(name: str, value: str | None):
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def _implementation(model, name: str):
    """The model's attention switched to transformers' ``name`` ("eager", "sdpa") inside, and back after."""
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _decoder_layers(model) -> list[torch.nn.Module]:
    """Every decoder layer, bottom first: the anatomy's (:mod:`attnviz.core.anatomy`), else the module holding each
    self-attention module."""
    from attnviz.core import anatomy
    from attnviz.errors import InputError

    try:
        return [layer.module for layer in anatomy.of(model).layers]
    except InputError:
        pass
    modules = dict(model.named_modules())
    return [modules[name.rpartition(".")[0]] for name, _ in model.named_modules()
            if name.endswith(("self_attn", ".attn")) and "." in name]


@dataclass
class LayerIO:
    """What every decoder layer received and returned in one forward, by layer index."""

    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)


@contextlib.contextmanager
def layer_io(model, feed: dict[int, torch.Tensor] | None = None):
    """Keep every decoder layer's input and output hidden states of the forwards inside; with ``feed``, each
    layer named there gets that input instead of the one the layer below handed on (the same layer input
    for two routes). Hooks on the layers, removed after."""
    seen, handles = LayerIO(), []

    def before(index, module, args, kwargs):
        if feed is not None and index in feed:
            if args:
                args = (feed[index], *args[1:])
            else:
                kwargs = {**kwargs, "hidden_states": feed[index]}
        seen.inputs[index] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
        return args, kwargs

    def after(index, module, args, kwargs, output):
        seen.outputs[index] = (output[0] if isinstance(output, tuple) else output).detach().clone()

    for index, layer in enumerate(_decoder_layers(model)):
        handles.append(layer.register_forward_pre_hook(functools.partial(before, index), with_kwargs=True))
        handles.append(layer.register_forward_hook(functools.partial(after, index), with_kwargs=True))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def stock(loaded: LoadedModel, ids: list[int], feed: dict[int, torch.Tensor] | None = None
          ) -> tuple[list[np.ndarray], LayerIO]:
    """Stock transformers' eager ``output_attentions`` of ``ids`` ((H, n, n) float32 per layer) and every
    layer's input and output; with ``feed``, the layers get those inputs (:func:`layer_io`)."""
    model = loaded.model
    with _implementation(model, "eager"), layer_io(model, feed) as seen, torch.inference_mode():
        out = model(torch.tensor([ids], device=model.device), output_attentions=True)
    return [a[0].float().cpu().numpy() for a in out.attentions], seen


def _max_diff(a: np.ndarray, b: np.ndarray, allowed: np.ndarray | None = None) -> float:
    """The largest absolute difference (cells outside ``allowed`` count as 0 on both sides); NaN on both sides
    agrees, NaN on one side only is an infinite difference."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if allowed is not None:
        a, b = np.where(allowed, a, 0.0), np.where(allowed, b, 0.0)
    if a.shape != b.shape:
        return float("inf")
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if (nan_a != nan_b).any():
        return float("inf")
    both = ~nan_a
    return float(np.max(np.abs(a - b)[both])) if both.any() else 0.0


def _relative(ours: dict[int, torch.Tensor], reference: dict[int, torch.Tensor], layers) -> float:
    """The largest ‖ours − reference‖ / ‖reference‖ over ``layers`` (hidden states, in float32)."""
    worst = 0.0
    for layer in layers:
        a, b = ours[layer].float().cpu(), reference[layer].float().cpu()
        worst = max(worst, float((a - b).norm() / b.norm().clamp(min=1e-30)))
    return worst


def _text(loaded: LoadedModel, n: int) -> str:
    from attnviz import corpus

    return corpus.text_of(loaded.tokenizer, corpus.head_ids(loaded.tokenizer, corpus.stdlib().text, n))


def _statistics_error(reduced, full, layers) -> tuple[float, str]:
    """The largest difference between a statistics capture and every statistic's numpy definition
    (docs/methods.md#sink-metrics) on the full maps, and which statistic and layer it is in."""
    from attnviz.stats import metrics

    worst, where = 0.0, ""
    for layer in layers:
        probs, allowed = full.layer_probs(layer), full.allowed[layer]
        for statistic in metrics.STATISTICS:
            if statistic.name not in reduced.stats[layer]:
                return float("inf"), f"{statistic.name} missing in layer {layer}"
            diff = _max_diff(reduced.stats[layer][statistic.name], statistic.reference(probs, allowed, full.tokens))
            if diff > worst or not where:
                worst, where = max(worst, diff), f"largest: {statistic.name}, layer {layer}"
    return worst, where


def _pooled_error(reduced, full, pool: int, floor: float | None = None,
                  relative: bool = False) -> tuple[float, str]:
    """The largest difference between a statistics capture's pooled maps (``pool`` cells a side) and the maximum of
    each cell's full-map cells, over the cells above ``floor`` (None: every seen cell), relative to the cell where
    asked; inf where the two differ in shape or in which cells are seen. With the layer it is in."""
    from attnviz.figures.style import max_pool

    worst, where = 0.0, ""
    for layer in full.layers:
        pooled, _ = reduced.layer_view(layer)
        factor = reduced.pool_factor(layer)
        expected = np.stack([max_pool(np.where(full.allowed[layer], m, np.nan), pool, factor)
                             for m in full.layer_probs(layer)])
        if pooled.shape != expected.shape or (np.isnan(pooled) != np.isnan(expected)).any():
            return float("inf"), f"layer {layer}: cells differ in shape or in which are empty"
        cells = ~np.isnan(expected) if floor is None else np.nan_to_num(expected) > floor
        if cells.any():
            error = np.abs(pooled[cells] - expected[cells])
            error = float(np.max(error / expected[cells] if relative else error))
            if error > worst or not where:
                worst, where = max(worst, error), f"largest: layer {layer} (pooling factor {factor})"
    return worst, where


FUSED_TOKENS = 192  # three of the kernel's 64-row blocks: the last two have full tiles below the diagonal
FUSED_POOL = 3  # cells a side: a factor of 64 at 192 tokens, so each of the kernel's 64 x 64 tiles pools to one cell
FUSED_NAMES = ("statistics, fused kernel vs their definitions on the full maps",
               "pooled maps, fused kernel vs max-pooled full maps")


def fused_kernel(loaded: LoadedModel, limit: float, why: str, force: bool = False) -> list[Check]:
    """On CUDA (or with ``force``, in Triton's interpreter), the fused statistics kernel at the geometry a long
    text launches: a 192-token text, so most rows see full tiles below the diagonal (in half precision: a float32
    kernel masks every tile), and a 3-cell map, so each 64 x 64 tile pools to one cell; every statistic against
    its definition on the full maps and every pooled cell against the maximum of its full-map cells, each layer
    fed the same input (a model shorter than 192 tokens: as long as it takes). A kernel that does not
    compile or run is a FAIL (attnviz falls back to the block engine)."""
    from attnviz.capture import capture
    from attnviz.core import kernels
    from attnviz.plan import Keep

    model = loaded.model
    if not ((force or str(model.device).startswith("cuda")) and kernels.available()):
        return [Check(name, "SKIP", detail="needs CUDA and Triton (on a CPU the tests run it through Triton's "
                                           "interpreter)") for name in FUSED_NAMES]
    n = min(FUSED_TOKENS, loaded.max_tokens)
    text, same = _text(loaded, n), "fed the same layer input"
    with layer_io(model) as ours:
        cap = capture(loaded, text, "fwd", Keep(storage_dtype=torch.float32))
    kernels._disabled.clear()
    try:
        with _setting("ATTNVIZ_FUSED", "1"), layer_io(model, feed=ours.inputs):
            fused = capture(loaded, text, "fwd", Keep(statistics=True, pool=FUSED_POOL, storage_dtype=torch.float32))
    except Exception as err:  # noqa: BLE001 - a kernel that fails here is the finding
        kernels.disable(err)
        fused = None
    if fused is None or kernels._disabled:
        problem = kernels._disabled[0] if kernels._disabled else "no result"
        return [Check(name, "FAIL", detail=f"the fused kernel failed ({problem.splitlines()[0][:200]}); attnviz "
                                           "falls back to the block engine, which computes the same statistics, "
                                           "slower") for name in FUSED_NAMES]
    worst, where = _statistics_error(fused, cap, cap.layers)
    checks = [Check.against(FUSED_NAMES[0], worst, limit, detail=where, why=why,
                            compared=f"every statistic of the fused Triton kernel and its numpy definition on the "
                                     f"full maps of a {n}-token text, {same}")]
    worst, where = _pooled_error(fused, cap, FUSED_POOL)
    checks.append(Check.against(FUSED_NAMES[1], worst, max(limit, FP16_STEP), detail=where,
                                why=why + "; and one float16 step (2^-10): pooled maps are kept in float16",
                                compared=f"each pooled cell of the fused kernel and the maximum of its full-map "
                                         f"cells, {same}"))
    return checks


def equivalence(loaded: LoadedModel, text: str) -> list[Check]:
    """Every route that can run here, layer by layer with the same layer input, against stock eager attention
    or the statistics' definitions; and the whole forward in float32 (see the module docstring)."""
    from attnviz.capture import capture
    from attnviz.plan import Keep

    from attnviz.core import anatomy
    from attnviz.errors import InputError

    checks = []
    model = loaded.model
    try:  # the anatomy's probe runs its own short forward: made now, before the checks' hooks feed layer inputs
        anatomy.of(model)
    except InputError:
        pass  # a model it does not map: the captures below say what they can
    dtype = model.dtype
    name = _dtype_name(dtype)
    limit, why = tolerance(dtype)
    forced = len(_decoder_layers(model)) == loaded.n_layers
    if not forced:
        return [Check("equivalence", "SKIP", detail=f"cannot find the {loaded.n_layers} decoder layers of "
                                                    f"{type(model).__name__} to feed them the same input")]
    same = "fed the same layer input"

    with layer_io(model) as ours:
        cap = capture(loaded, text, "fwd", Keep(storage_dtype=torch.float32))
    maps, theirs = stock(loaded, cap.token_ids, feed=ours.inputs)
    worst = max(_max_diff(cap.layer_probs(l), maps[l], cap.allowed[l]) for l in cap.layers)
    checks.append(Check.against(f"maps of every layer vs stock eager ({name}, block engine)", worst, limit, why=why,
                                compared=f"attnviz's full maps and stock eager output_attentions, each layer {same}"))
    worst = _relative(ours.outputs, theirs.outputs, cap.layers)
    checks.append(Check.against(f"layer outputs vs stock eager ({name}, block engine, relative)", worst, limit,
                                why=why, compared=f"every decoder layer's output, attnviz's route and stock eager, "
                                                  f"{same}; relative to the output's norm"))

    top = loaded.n_layers - 1
    with layer_io(model) as ours_top:
        only = capture(loaded, text, "fwd", Keep(layers=[top], storage_dtype=torch.float32))
    maps_top, theirs_top = stock(loaded, only.token_ids, feed=ours_top.inputs)
    worst = _max_diff(only.layer_probs(top), maps_top[top], only.allowed[top])
    checks.append(Check.against("top layer after SDPA layers vs stock eager", worst, limit, why=why,
                                compared=f"the top layer recorded alone, the layers under it unrecorded; its map and "
                                         f"stock eager's, {same}"))
    if top > 0:
        worst = _relative(ours_top.outputs, theirs_top.outputs, range(top))
        checks.append(Check.against("unrecorded (SDPA) layers' outputs vs stock eager (relative)", worst, limit,
                                    why=why, compared=f"the output of every layer under the top one, which attnviz "
                                                      f"runs through SDPA, and stock eager's, {same}"))

    with _setting("ATTNVIZ_FUSED", "0"), layer_io(model, feed=ours.inputs):
        blocks = capture(loaded, text, "fwd", Keep(statistics=True, pool=8, storage_dtype=torch.float32))
    worst, where = _statistics_error(blocks, cap, cap.layers)
    checks.append(Check.against("statistics, block engine vs their definitions on the full maps", worst, limit,
                                detail=where, why=why,
                                compared=f"every statistic of a statistics capture (block engine) and its numpy "
                                         f"definition on the full maps, {same}"))

    # pooled maps are kept in float16 (docs/methods.md#devices)
    worst, _ = _pooled_error(blocks, cap, 8, floor=1e-4, relative=dtype == torch.float32)
    if dtype == torch.float32:
        checks.append(Check.against("long mode: pooled maps vs max-pooled full maps (relative)", worst, FP16_STEP,
                                    why="one float16 step (2^-10), relative: pooled maps are kept in float16",
                                    compared=f"each pooled cell above 1e-4 and the maximum of its full-map cells, {same}"))
    else:
        checks.append(Check.against("long mode: pooled maps vs max-pooled full maps", worst, max(limit, FP16_STEP),
                                    why=why + "; absolute, since a step of a logit moves a small probability by a "
                                              "large fraction of itself",
                                    compared=f"each pooled cell above 1e-4 and the maximum of its full-map cells, {same}"))

    checks += fused_kernel(loaded, limit, why)
    checks.append(_float32_end_to_end(loaded, text))  # last: the model is cast for it
    return checks


def _float32_end_to_end(loaded: LoadedModel, text: str) -> Check:
    """The whole forward in float32, no layer input fed: attnviz's full maps of every layer against stock
    eager's, within 1e-4. A half-precision model is cast for it and back (bf16 → fp32 → bf16 is exact)."""
    from attnviz.capture import capture
    from attnviz.plan import Keep

    model = loaded.model
    dtype = model.dtype
    name = "maps of every layer vs stock eager (float32, end to end)"
    compared = "attnviz's full maps and stock eager output_attentions, each route running the whole forward"
    if getattr(model, "hf_device_map", None) and dtype != torch.float32:
        return Check(name, "SKIP", detail="a model spread by a device map is not cast to float32 here")
    with _in_float32(model):
        cap = capture(loaded, text, "fwd", Keep(storage_dtype=torch.float32))
        maps, _ = stock(loaded, cap.token_ids)
    worst = max(_max_diff(cap.layer_probs(l), maps[l], cap.allowed[l]) for l in cap.layers)
    return Check.against(name, worst, FP32_TOLERANCE, compared=compared,
                         why="float32: 1e-4 (docs/methods.md#devices), the whole forward: in float32 nothing drifts "
                             "that far, so an error that only shows across layers fails here"
                             + ("" if dtype == torch.float32 else f"; the {_dtype_name(dtype)} model cast for it"))


@contextlib.contextmanager
def _in_float32(model):
    """The model in float32 inside, and every parameter and buffer back in its own dtype after: a bfloat16
    model keeps some buffers in float32 (the rotary frequencies), which ``model.to(bfloat16)`` would round."""
    def tables():
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                yield from ((table, key, t) for key, t in table.items() if t is not None)

    before = [(table, key, t.dtype) for table, key, t in tables()]
    model.float()
    try:
        yield
    finally:
        for table, key, dtype in before:
            if table[key].dtype != dtype:
                table[key].data = table[key].data.to(dtype)


class _Clock:
    """Seconds of the calls inside, on the device: CUDA events on a GPU, the wall clock elsewhere."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    @contextlib.contextmanager
    def window(self, into: list):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            end.synchronize()
            into.append(start.elapsed_time(end) / 1000)
        else:
            devices.synchronize(torch.device("cpu"))
            begun = time.perf_counter()
            yield
            into.append(time.perf_counter() - begun)


def _timed(fn, device: str, repeats: int, windows: int = 3) -> float:
    """Seconds per call of ``fn``: the median over ``windows`` timed windows of ``repeats`` calls each, after one
    warm-up call."""
    clock, times = _Clock(device), []
    fn()
    devices.synchronize(torch.device(device))
    for _ in range(windows):
        with clock.window(times):
            for _ in range(repeats):
                fn()
    return float(np.median(times)) / repeats


def repeats_for(one_call_s: float) -> int:
    """Calls in a timed window so that it lasts at least ``MIN_WINDOW_S`` (at most ``MAX_REPEATS``)."""
    return int(min(MAX_REPEATS, max(1, np.ceil(MIN_WINDOW_S / max(one_call_s, 1e-6)))))


def speed(loaded: LoadedModel, text: str, device: str) -> list[Check]:
    """A statistics capture against a plain SDPA forward of the same tokens; on CUDA the fused kernel
    against the block engine. Never skipped: a short forward is repeated inside each timed window."""
    from attnviz.capture import capture
    from attnviz.tokens import tokenize
    from attnviz.plan import Keep

    ids, _ = tokenize(loaded, text)
    model = loaded.model
    reference = "sdpa"
    try:  # a family without an SDPA path in transformers (Gemma 2) is timed against its eager forward
        with _implementation(model, reference):
            pass
    except ValueError:
        reference = "eager"
    tensor = torch.tensor([ids], device=model.device)

    def plain():
        with _implementation(model, reference), torch.inference_mode():
            model(tensor, logits_to_keep=1)

    repeats = repeats_for(_timed(plain, device, 1, windows=1))
    base = _timed(plain, device, repeats)
    stats = _timed(lambda: capture(loaded, text, "fwd", Keep(statistics=True)), device, repeats)
    expected = SPEED_EXPECTED.get(device, 3.0)
    ratio = stats / base
    name = f"speed: statistics of {len(ids)} tokens vs a plain {'SDPA' if reference == 'sdpa' else reference} forward"
    timing = f"{repeats} call{'s' if repeats > 1 else ''} a window, median of 3 windows"
    checks = [Check.timed(name, ratio, expected, detail=f"{stats * 1000:.1f} ms vs {base * 1000:.1f} ms a call",
                          compared=f"a statistics capture and a plain forward of the same tokens ({timing}"
                                   f"{', CUDA events' if device == 'cuda' else ''})",
                          why=f"{expected:g}x on {device}: what the statistics route aims for over the forward it "
                              "records; a report, not a verdict (stock kernels may be much faster on some CPUs)")]
    if device == "cuda":
        from attnviz.core import kernels

        if kernels.available() and not kernels._disabled:
            with _setting("ATTNVIZ_FUSED", "1"):
                fused = _timed(lambda: capture(loaded, text, "fwd", Keep(statistics=True)), device, repeats)
            with _setting("ATTNVIZ_FUSED", "0"):
                blocks = _timed(lambda: capture(loaded, text, "fwd", Keep(statistics=True)), device, repeats)
            ratio = fused / blocks
            checks.append(Check.timed("speed: fused kernel vs block engine", ratio, 1.0,
                                      detail=f"{fused * 1000:.1f} ms vs {blocks * 1000:.1f} ms a call",
                                      compared=f"a statistics capture through each route ({timing})",
                                      why="the fused kernel exists to be faster than the block engine"))
        else:
            checks.append(Check("speed: fused kernel vs block engine", "SKIP", detail="the fused kernel is not in use"))
    return checks


def run(loaded: LoadedModel, tokens: int = 4096, progress=None) -> Report:
    """The whole report (see the module docstring) for a loaded model on its device."""
    say = progress or (lambda message: None)
    device = loaded.model.device.type
    report = Report(environment(loaded))
    say(f"equivalence on {EQUIVALENCE_TOKENS} tokens")
    report.checks += equivalence(loaded, _text(loaded, EQUIVALENCE_TOKENS))
    say("score attribution, patch and routes")
    report.checks += capabilities(loaded, _text(loaded, EQUIVALENCE_TOKENS))
    n = min(tokens, loaded.max_tokens)
    say(f"speed on {n} tokens")
    report.checks += speed(loaded, _text(loaded, n), device)
    return report


# --- what the pages run: score attribution, patch, routes ---------------------------------------------------------

ATTRIBUTION_HALF = 0.02  # relative: attribution's sources against the captured score in half precision (docs/methods.md#devices)


def capabilities(loaded: LoadedModel, text: str) -> list[Check]:
    """The three deepest pages' arithmetic in the model's own dtype, on the doctor's short text
    (docs/cli.md#check-attnviz-on-this-machine): score attribution (the Why page), ``patch`` (its "Test it") and
    routes (the Routes page). Each is a PASS or FAIL against a limit that follows the dtype; a capability this
    model does not have (a family attribution cannot split) is a SKIP that says why."""
    from attnviz.errors import AttnvizError

    checks = []
    for check in (_attribution_check, _patch_check, _routes_check):
        try:
            checks.append(check(loaded, text))
        except AttnvizError as err:  # the model's refusal (a family not split, a float16 overflow): not a defect
            checks.append(Check(check.__doc__.split(":")[0], "SKIP", detail=str(err)))
    return checks


def _attribution_check(loaded: LoadedModel, text: str) -> Check:
    """score attribution: every head of the top layer, its sink key's score averaged over the queries that see it,
    split by source on the key side; the sources' sum against the score a capture records (pre-softmax, after a
    soft-cap's where the family caps)."""
    from attnviz.capture import capture
    from attnviz.effects.explain import Residual
    from attnviz.plan import Keep
    from attnviz.stats import metrics

    dtype = loaded.model.dtype
    top = loaded.n_layers - 1
    cap = capture(loaded, text, "fwd", Keep(layers=[top], scores=True, storage_dtype=torch.float32))
    run = Residual(loaded, text, "fwd", upto=top)
    allowed = run.allowed(top).cpu().numpy()
    key = metrics.auto_key(allowed)
    scores = cap.layer_scores(top)
    worst = 0.0
    for head in range(loaded.n_heads):
        e = run.explain(top, head, "all", key)
        captured = float(scores[head][allowed[:, key], key].mean())
        made = e.softcapped_score if e.softcapped_score is not None else sum(e.key_sources.values())
        size = float(np.abs(scores[head][allowed]).mean())  # a score near 0 is held to the head's typical size
        worst = max(worst, abs(made - captured) / max(abs(captured), size, 1e-6))
    half = precision.half(dtype)
    limit = ATTRIBUTION_HALF if half else 1e-3
    why = (f"{limit:g} relative in {precision.name(dtype)}: the split is computed in float32 from the run's own "
           "activations, the captured score from the run's rounded queries and keys" if half else
           "1e-3 relative in float32: two float32 routes to one score (the split's sum and the engine's product)")
    return Check.against("score attribution: the sources sum to the captured score", worst, limit, why=why,
                         compared=f"the top layer's {loaded.n_heads} heads at their sink key {key}, averaged over every "
                                  "query that sees it: the key side's sources summed, and the engine's pre-softmax "
                                  "score; relative to the score, or to the head's mean |score| where that is larger")


def _patch_check(loaded: LoadedModel, text: str) -> Check:
    """patch: the MLP's write at the first token removed in the middle layer by attnviz's ``patch`` against the same
    write removed by a forward hook written here on stock transformers; the last layer's output compared."""
    from attnviz.core import anatomy
    from attnviz.core import engine
    from attnviz.recipe import build
    from attnviz.tokens import tokenize

    model = loaded.model
    layer = loaded.n_layers // 2
    built = build(loaded, "fwd", intervene=f"patch(block=mlp, tokens=0)@{layer}")
    ids, _ = tokenize(loaded, text)
    built.check_text(len(ids))
    with torch.no_grad():
        _, hidden, _ = built.forward(loaded, torch.tensor([ids]), engine.Record(frozenset()),
                                     engine.Feed(hidden_states=True, last_logits_only=True))
    ours = hidden[-1][0].float().cpu()

    def zero_first(module, args, out):
        tensor = out[0] if isinstance(out, tuple) else out
        tensor = tensor.clone()
        tensor[:, 0] = 0
        return (tensor, *out[1:]) if isinstance(out, tuple) else tensor

    handle = anatomy.of(model)[layer].mlp_write.register_forward_hook(zero_first)
    try:
        with torch.inference_mode():
            out = model(torch.tensor([ids], device=model.device), output_hidden_states=True)
    finally:
        handle.remove()
    theirs = out.hidden_states[-1][0].float().cpu()
    worst = float((ours - theirs).norm() / theirs.norm().clamp(min=1e-30))
    limit, why = precision.tolerance(model.dtype)
    if precision.half(model.dtype):  # the forward above the patch runs through every layer: drift, not one layer
        limit = precision.decomposition_tolerance(model.dtype)
        why = (f"{limit:.3g} relative in {precision.name(model.dtype)}: four steps, since both forwards run every "
               "layer above the patch through SDPA and may round apart")
    return Check.against("patch: equal to a stock forward hook (relative)", worst, limit, why=why,
                         compared=f"the last hidden state with layer {layer}'s MLP write zeroed at token 0, by attnviz's "
                                  "patch and by a forward hook on stock transformers; relative to its norm")


def _routes_check(loaded: LoadedModel, text: str) -> Check:
    """routes: one layer's contributions (every query, source token and head) from a trace against their written-out
    definition (docs/methods.md#contributions), made from stock eager's probabilities, the layer's values and
    streams, each write W_O·A_ij·v_j written out in full."""
    from attnviz.capture import capture
    from attnviz.core import anatomy
    from attnviz.core.modules import output_projection
    from attnviz.effects.schemes import norm_form
    from attnviz.flow import contributions
    from attnviz.flow.trace import trace
    from attnviz.plan import Keep

    model = loaded.model
    found = anatomy.of(model)
    layer = loaded.n_layers // 2
    L = found[layer]
    with layer_io(model) as ours:
        flow = trace(loaded, text, "fwd", floor=0.0)
    feed = {layer: ours.inputs[layer]}
    seen: dict = {}

    def keep(name, output=False):
        def hook(module, args, kwargs, *out):
            value = out[0] if output else (args[0] if args else kwargs.get("hidden_states"))
            seen[name] = (value[0] if isinstance(value, tuple) else value)[0].detach().float().cpu()
        return hook

    handles = [L.attn_write.register_forward_pre_hook(keep("o"), with_kwargs=True),
               L.attn_write.register_forward_hook(keep("write", True), with_kwargs=True)]
    if not L.parallel:
        handles.append((L.mlp_norm or L.mlp).register_forward_pre_hook(keep("y"), with_kwargs=True))
    try:
        maps, io = stock(loaded, flow.token_ids, feed=feed)
    finally:
        for handle in handles:
            handle.remove()
    with layer_io(model, feed=feed):
        qkv = capture(loaded, text, "fwd", Keep(layers=[layer], qkv=True, storage_dtype=torch.float32)).layer_qkv(layer)
    x, out = io.inputs[layer][0].float().cpu(), io.outputs[layer][0].float().cpu()
    y = seen["y"] if "y" in seen else x + L.scale * seen["write"]
    probs = torch.from_numpy(maps[layer])  # (H, n, n)
    n_heads, n = probs.shape[0], probs.shape[-1]
    v = torch.from_numpy(qkv.v).float()  # (H_kv, n, d)
    w = output_projection(L.attn).detach().float().cpu()  # (D, H d)
    width, d = w.shape[0], v.shape[-1]
    w = w.view(width, n_heads, d)
    c = torch.full((n,), float(L.scale))
    if L.attn_write is not L.attn:  # a post-norm: its gain folded in, its scale frozen per token
        post = norm_form(L.attn_write, width, f"layer {layer}'s post-attention norm")
        c = c * post.inv(seen["o"])[:, 0].cpu()
        w = w * post.gamma.cpu()[:, None, None]
        if post.centre:
            w = w - w.mean(0, keepdim=True)
    writes = torch.einsum("hqk,q,hkd,xhd->hqkx", probs, c, v.repeat_interleave(n_heads // v.shape[0], 0), w)
    parts = torch.cat([x[None], writes.permute(0, 2, 1, 3).reshape(-1, n, width)])
    expected = contributions.proximity(parts, y)[1:].view(n_heads, n, n).permute(2, 1, 0).numpy()  # (q, k, h)
    got = flow.layers[layer].dense(n_heads, n)
    worst = float(np.abs(got - expected).max())
    dtype = model.dtype
    limit = max(1e-4, precision.decomposition_tolerance(dtype))
    why = ("1e-4 in float32 (docs/methods.md#devices)" if not precision.half(dtype) else
           f"{limit:.3g} in {precision.name(dtype)}: four steps, since the trace's probabilities and stock eager's "
           "round apart by up to two")
    return Check.against("routes: equal to the written-out definition on one layer", worst, limit, why=why,
                         compared=f"layer {layer}'s contribution of every (query, source token, head), from a trace and "
                                  "written out in full from stock eager's probabilities, fed the same layer input")
