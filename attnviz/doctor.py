"""``attnviz doctor``: whether attnviz is right, and how fast, on this machine and this model.

Run it first on a GPU (docs/gpu.md): the GPU route was built and tested through Triton's interpreter
and compiled for sm_80/sm_90 on a CPU, and this is how a user checks it where it actually runs.

1. **Environment**: torch, transformers, Triton and attnviz versions; every device with its free
   memory; the device and dtype the model runs in.
2. **Equivalence** on a short text of the model's own tokenizer (Python's reference docs), every route
   that can run here against stock transformers' eager ``output_attentions`` or against each other,
   within the tolerances of docs/methods.md#devices (1e-4 in float32, 2e-2 in bfloat16/float16):
   - full maps of every layer (the block engine, where a layer's probabilities are recorded);
   - the top layer alone, the layers under it through SDPA (unrecorded layers);
   - the model in its own dtype, where that is not float32;
   - statistics from the block engine against the same statistics of the full maps;
   - on CUDA, statistics from the fused Triton kernel against the block engine (a kernel that does not
     compile or launch is a FAIL that names the fallback attnviz then uses: the block engine);
   - long mode: pooled maps against the max-pooled full maps.
3. **Speed** on a ``tokens``-long text: a statistics capture against a plain SDPA forward of the same
   tokens (the ratio, under a limit); on CUDA also the fused kernel against the block engine.

Every check is PASS, FAIL or SKIP (with why) and carries what it measured and its limit; the command
exits 0 only when nothing failed. ``--json`` prints the whole report, to paste into a bug report.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from attnviz.core import devices
from attnviz.core.models import LoadedModel

FP32_TOLERANCE = 1e-4  # docs/methods.md#devices
HALF_TOLERANCE = 2e-2
FP16_STEP = 2.0 ** -10  # one float16 step, relative: what a pooled map (kept in float16) may differ by
MIN_TIMED_S = 0.05  # a plain forward shorter than this times Python's per-layer overhead, not attention
EQUIVALENCE_TOKENS = 48
SPEED_LIMIT = {"cpu": 3.0, "cuda": 2.0, "mps": 3.0}  # statistics capture / plain SDPA forward
STATISTICS = ("column_mean", "alpha", "entropy")  # compared between routes


@dataclass
class Check:
    name: str
    status: str  # "PASS" | "FAIL" | "SKIP"
    measured: float | None = None
    limit: float | None = None
    detail: str = ""
    ratio: float | None = None  # speed checks

    @classmethod
    def against(cls, name: str, measured: float, limit: float, **more) -> "Check":
        """PASS when ``measured`` is within ``limit``, else FAIL."""
        return cls(name, "PASS" if measured <= limit else "FAIL", measured, limit, **more)

    def line(self) -> str:
        numbers = "" if self.measured is None else f": measured {self.measured:.3g} (limit {self.limit:.3g})"
        return f"{self.status:4} {self.name}{numbers}{' · ' + self.detail if self.detail else ''}"

    def as_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and (k != "detail" or v)}


@dataclass
class Report:
    environment: dict
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.status != "FAIL" for c in self.checks)

    def as_json(self) -> dict:
        return {"environment": self.environment, "checks": [c.as_json() for c in self.checks], "ok": self.ok}

    def text(self) -> str:
        env = self.environment
        head = [f"attnviz {env['attnviz']} · torch {env['torch']} · transformers {env['transformers']} · "
                f"triton {env['triton'] or 'not installed'} · {env['platform']}",
                "devices: " + "; ".join(f"{d['name']} ({d['free_mb'] or '?'} MB free)" for d in env["devices"]),
                f"model: {env['model']} on {env['device']} in {env['dtype']}"]
        return "\n".join(head + [c.line() for c in self.checks]
                         + [f"{'all checks passed' if self.ok else 'FAILED'}: "
                            f"{sum(c.status == 'PASS' for c in self.checks)} passed, "
                            f"{sum(c.status == 'FAIL' for c in self.checks)} failed, "
                            f"{sum(c.status == 'SKIP' for c in self.checks)} skipped"])


def pick_device(asked: str = "auto") -> str:
    """``auto``: CUDA, else MPS, else the CPU; an asked device that is not here is refused in one line."""
    from attnviz.errors import InputError

    have = {"cpu": True, "cuda": torch.cuda.is_available(),
            "mps": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())}
    if asked == "auto":
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
           "devices": found, "fused_kernel": os.environ.get("ATTNVIZ_FUSED", "auto")}
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


@torch.no_grad()
def stock_attentions(loaded: LoadedModel, ids: list[int]) -> list[np.ndarray]:
    """Stock transformers' eager ``output_attentions`` of ``ids``, (H, n, n) float32 per layer."""
    model = loaded.model
    with _implementation(model, "eager"):
        out = model(torch.tensor([ids], device=model.device), output_attentions=True)
    return [a[0].float().cpu().numpy() for a in out.attentions]


def _max_diff(a: np.ndarray, b: np.ndarray, allowed: np.ndarray | None = None) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if allowed is not None:
        a, b = np.where(allowed, a, 0.0), np.where(allowed, b, 0.0)
    both = ~(np.isnan(a) & np.isnan(b))
    return float(np.nanmax(np.abs(a - b)[both])) if both.any() else 0.0


def _timed(fn, device: str, repeat: int = 3) -> float:
    """The median of ``repeat`` runs after one warm-up, synchronised on the device."""
    fn()
    devices.synchronize(torch.device(device))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        devices.synchronize(torch.device(device))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _text(loaded: LoadedModel, n: int) -> str:
    from attnviz import corpus

    return corpus.text_of(loaded.tokenizer, corpus.head_ids(loaded.tokenizer, corpus.stdlib().text, n))


def equivalence(loaded: LoadedModel, text: str) -> list[Check]:
    """Every route that can run here, against stock eager attention or against each other."""
    from attnviz.capture import capture
    from attnviz.core import kernels
    from attnviz.figures.style import max_pool

    checks = []
    dtype = loaded.model.dtype
    half = dtype in (torch.bfloat16, torch.float16)
    limit = HALF_TOLERANCE if half else FP32_TOLERANCE
    cap = capture(loaded, text, "fwd", storage_dtype=torch.float32)
    stock = stock_attentions(loaded, cap.token_ids)
    worst = max(_max_diff(cap.layer_probs(l), stock[l], cap.allowed[l]) for l in cap.layers)
    checks.append(Check.against(f"maps of every layer vs stock eager ({_dtype_name(dtype)}, block engine)", worst, limit))

    top = loaded.n_layers - 1
    only = capture(loaded, text, "fwd", layers=[top], storage_dtype=torch.float32)
    worst = _max_diff(only.layer_probs(top), stock[top], only.allowed[top])
    checks.append(Check.against("top layer after SDPA layers vs stock eager", worst, limit))

    if half:  # the same in float32: the model cast for the check, then back (bf16 -> fp32 -> bf16 is exact)
        loaded.model.float()
        try:
            cap32 = capture(loaded, text, "fwd", storage_dtype=torch.float32)
            stock32 = stock_attentions(loaded, cap32.token_ids)
        finally:
            loaded.model.to(dtype)
        worst = max(_max_diff(cap32.layer_probs(l), stock32[l], cap32.allowed[l]) for l in cap32.layers)
        checks.append(Check.against("maps of every layer vs stock eager (float32)", worst, FP32_TOLERANCE))
    else:
        checks.append(Check("maps in a half-precision dtype", "SKIP",
                            detail=f"the model runs in {_dtype_name(dtype)} here"))

    with _setting("ATTNVIZ_FUSED", "0"):
        blocks = capture(loaded, text, "fwd", reduce=True, pool=8, storage_dtype=torch.float32)
    worst = max(_max_diff(blocks.stat(l, s), cap.stat(l, s)) for l in cap.layers for s in STATISTICS)
    checks.append(Check.against("statistics, block engine vs full maps", worst, FP32_TOLERANCE))
    worst = 0.0  # pooled maps are kept in float16 (docs/methods.md#devices): relative error, one float16 step
    for l in cap.layers:
        pooled, _ = blocks.layer_view(l)
        factor = blocks.pool_factor(l)
        expected = np.stack([max_pool(np.where(cap.allowed[l], m, np.nan), 8, factor) for m in cap.layer_probs(l)])
        big = np.nan_to_num(expected) > 1e-4
        if big.any():
            worst = max(worst, float(np.max(np.abs(pooled[big] - expected[big]) / expected[big])))
    limit_pooled = max(limit, FP16_STEP)
    checks.append(Check.against("long mode: pooled maps vs max-pooled full maps (relative)", worst, limit_pooled))

    if str(loaded.model.device).startswith("cuda") and kernels.available():
        kernels._disabled.clear()
        try:
            with _setting("ATTNVIZ_FUSED", "1"):
                fused = capture(loaded, text, "fwd", reduce=True, pool=8, storage_dtype=torch.float32)
        except Exception as err:  # noqa: BLE001 - a kernel that fails here is the finding
            kernels.disable(err)
            fused = None
        if fused is None or kernels._disabled:
            why = kernels._disabled[0] if kernels._disabled else "no result"
            checks.append(Check("statistics, fused kernel vs block engine", "FAIL",
                                detail=f"the fused kernel failed ({why.splitlines()[0][:200]}); attnviz falls back "
                                       "to the block engine, which computes the same statistics, slower"))
        else:
            worst = max(_max_diff(fused.stat(l, s), blocks.stat(l, s)) for l in cap.layers for s in STATISTICS)
            checks.append(Check.against("statistics, fused kernel vs block engine", worst, limit))
    else:
        checks.append(Check("statistics, fused kernel vs block engine", "SKIP",
                            detail="needs CUDA and Triton (on a CPU the tests run it through Triton's interpreter)"))
    return checks


def speed(loaded: LoadedModel, text: str, device: str) -> list[Check]:
    """A statistics capture against a plain SDPA forward of the same tokens; on CUDA the fused kernel
    against the block engine."""
    from attnviz.capture import capture, tokenize

    ids, _ = tokenize(loaded, text)
    model = loaded.model
    stock = "sdpa"
    try:  # a family without an SDPA path in transformers (Gemma 2) is timed against its eager forward
        with _implementation(model, stock):
            pass
    except ValueError:
        stock = "eager"

    def plain():
        with _implementation(model, stock), torch.inference_mode():
            model(torch.tensor([ids], device=model.device), logits_to_keep=1)

    base = _timed(plain, device)
    stats = _timed(lambda: capture(loaded, text, "fwd", reduce=True), device)
    limit = SPEED_LIMIT.get(device, 3.0)
    ratio = stats / base
    name = f"speed: statistics of {len(ids)} tokens vs a plain {'SDPA' if stock == 'sdpa' else stock} forward"
    if base < MIN_TIMED_S:
        return [Check(name, "SKIP", ratio=ratio,
                      detail=f"too small to time: the plain forward takes {base * 1000:.0f} ms (< "
                             f"{MIN_TIMED_S * 1000:.0f} ms), so the ratio {ratio:.2f} is fixed overhead; "
                             "give more --tokens")]
    checks = [Check.against(name, ratio, limit, detail=f"{stats:.2f} s vs {base:.2f} s", ratio=ratio)]
    if device == "cuda":
        from attnviz.core import kernels

        if kernels.available() and not kernels._disabled:
            with _setting("ATTNVIZ_FUSED", "1"):
                fused = _timed(lambda: capture(loaded, text, "fwd", reduce=True), device)
            with _setting("ATTNVIZ_FUSED", "0"):
                blocks = _timed(lambda: capture(loaded, text, "fwd", reduce=True), device)
            ratio = fused / blocks
            checks.append(Check.against("speed: fused kernel vs block engine", ratio, 1.0,
                                        detail=f"{fused:.2f} s vs {blocks:.2f} s", ratio=ratio))
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
    say(f"speed on {tokens} tokens")
    limit = getattr(loaded.model.config, "max_position_embeddings", None) or tokens
    report.checks += speed(loaded, _text(loaded, min(tokens, limit)), device)
    return report
