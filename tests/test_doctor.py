"""``attnviz doctor``: every check on this CPU, on the default model (float32 and bfloat16) and on tiny random
models of every family; each planted defect (a wrong scale, a mask off by one key, a statistic read from the
wrong row, probabilities 1 % off) fails it in both dtypes; its command-line contract and bad input. The CUDA
branch (the fused kernel, its speed, a kernel that will not compile) is in tests/test_cuda.py, marked ``cuda``.

No verdict of a speed check is asserted here: timings belong to the doctor's own report and to bench/."""

import contextvars
import dataclasses
import json
import os
import threading

import numpy as np
import pytest
import torch

from attnviz.core.kernel import kernels
from attnviz.core.engine import routes
from attnviz import doctor, load, settings
from attnviz.capture import capture
from attnviz.cli import main
from attnviz.core import engine
from attnviz.core.record import reduce
from attnviz.doctor import checks as doctor_checks, timing
from attnviz.plan import Keep

from tiny import ARCHS, char_tokenizer, build, loaded


def _equivalence(checks):
    return [c for c in checks if not c.name.startswith("speed:")]


def _assert_healthy(checks):
    """Every equivalence check that ran passed, within its limit, and says what it compared and why."""
    ran = [c for c in _equivalence(checks) if c.status != "SKIP"]
    assert len(ran) >= 6, [c.name for c in ran]
    for check in ran:
        assert check.status == "PASS" and 0 <= check.measured <= check.limit, check.line()
        assert check.compared and check.why, check


def _speed(checks):
    speed = next(c for c in checks if c.name.startswith("speed: statistics"))
    assert speed.status == "TIME" and speed.ratio == speed.measured > 0 and speed.limit > 0, speed
    assert ("slower than expected" in speed.detail) == (speed.ratio > speed.limit), speed
    return speed


@pytest.mark.parametrize("kind", ARCHS)
def test_doctor_passes_on_tiny_random_models_of_every_family(kind):
    report = doctor.run(loaded(kind), tokens=256)
    _assert_healthy(report.checks)
    skipped = {c.name for c in report.checks if c.status == "SKIP"}
    assert skipped == set(doctor.FUSED_NAMES)  # no CUDA on this route
    _speed(report.checks)  # a tiny model's forward is repeated in the timed window: a ratio, never a skip
    assert report.environment["model"] == f"tiny-{kind}" and report.environment["torch"] == torch.__version__


def test_tolerances_follow_the_dtype():
    assert doctor.tolerance(torch.float32)[0] == 1e-4
    assert doctor.tolerance(torch.bfloat16)[0] == 2 * 2.0 ** -7
    assert doctor.tolerance(torch.float16)[0] == 2 * 2.0 ** -10
    assert "bfloat16" in doctor.tolerance(torch.bfloat16)[1]


def test_a_short_forward_is_repeated_until_the_window_is_long_enough():
    assert doctor.repeats_for(1.0) == 1
    assert doctor.repeats_for(doctor.MIN_WINDOW_S / 4) == 4
    assert doctor.repeats_for(0.003) * 0.003 >= doctor.MIN_WINDOW_S
    assert doctor.repeats_for(0.0) == doctor.MAX_REPEATS


def test_cli_doctor_on_the_default_model(default_model, capsys, monkeypatch):
    import functools

    made, real = [], doctor.run

    @functools.wraps(real)  # its signature too: the command reads its defaults
    def run(*args, **kwargs):
        made.append(real(*args, **kwargs) if not made else made[0])  # the second run, the plain text, reuses it
        return made[-1]

    monkeypatch.setattr(doctor, "run", run)
    status = main(["doctor", "--device", "cpu", "--tokens", "512", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert status == (0 if doc["ok"] else 1)
    assert {"environment", "checks", "ok"} <= set(doc)
    env = doc["environment"]
    assert {"attnviz", "torch", "transformers", "triton", "devices", "device", "dtype"} <= set(env)
    assert env["device"] == "cpu" and env["dtype"] == "float32" and env["devices"][0]["name"] == "cpu"
    assert env["routes_correction"].startswith("compiled (numba ")  # a requirement: routes' compiled loop
    for check in doc["checks"]:
        assert check["status"] in ("PASS", "FAIL", "SKIP", "TIME") and "name" in check
        if not check["name"].startswith("speed:") and check["status"] != "SKIP":
            assert check["status"] == "PASS" and check["measured"] <= check["limit"], check
            assert check["compared"] and check["why"]
    speed = next(c for c in doc["checks"] if c["name"].startswith("speed: statistics of 512 tokens"))
    assert speed["status"] == "TIME" and speed["ratio"] == speed["measured"] > 0
    status = main(["doctor", "--device", "cpu", "--tokens", "64"])  # the plain report: a line per check, and why
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("attnviz ") and any(l.startswith("PASS maps of every layer") for l in lines)
    assert any("limit: float32: 1e-4" in l for l in lines)
    assert lines[-1].startswith("all checks passed" if status == 0 else "FAILED")


def test_a_slow_machine_is_reported_not_failed(monkeypatch, capsys):
    """Speed never decides the verdict: a statistics capture ten times slower than the plain forward (a CPU whose
    stock bfloat16 SDPA runs on AMX) is a TIME line saying "slower than expected", and the command exits 0."""
    calls = []

    def timed(fn, device, repeats, windows=3):
        calls.append(fn)
        return 1.0 if len(calls) < 3 else 10.0  # the plain forward twice, then the statistics capture

    monkeypatch.setattr(timing, "seconds_per_call", timed)
    checks = doctor.speed(loaded("llama"), "a b c d e f g h", "cpu")
    speed = _speed(checks)
    assert speed.ratio == 10.0 and speed.status == "TIME" and "slower than expected" in speed.detail
    report = doctor.Report({}, [doctor.Check("maps", "PASS", 0.0, 1e-4), *checks])
    assert report.ok
    assert "TIME speed: statistics of" in speed.line() and "ratio 10" in speed.line()
    assert "expected: 3x on cpu" in speed.line() and "limit:" not in speed.line()


def test_the_whole_report_passes_when_only_speed_is_slow(monkeypatch):
    monkeypatch.setattr(timing, "seconds_per_call",
                        lambda fn, device, repeats, windows=3: 1.0 if "plain" in fn.__name__ else 9.0)
    healthy = dataclasses.replace(doctor.FAMILIES[0],
                                  checks=lambda loaded, text: [doctor.Check("maps", "PASS", 0.0, 1e-4)])
    monkeypatch.setattr(doctor_checks, "FAMILIES", (healthy, *doctor.FAMILIES[1:]))
    report = doctor.run(loaded("llama"), tokens=64)
    assert report.ok and report.text().splitlines()[-1].startswith("all checks passed")
    assert "slower than expected" in report.text()


@pytest.fixture(scope="module")
def bf16_model(model_cache):
    return load("default", dtype="bfloat16", device="cpu")


def test_a_healthy_install_passes_in_bfloat16(bf16_model, capsys):
    """The drift of hidden states through 30 bfloat16 layers is no error: every check compares one layer."""
    status = main(["doctor", "--device", "cpu", "--dtype", "bfloat16", "--tokens", "64", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["environment"]["dtype"] == "bfloat16" and status == (0 if doc["ok"] else 1)
    checks = [doctor.Check(**c) for c in doc["checks"]]
    _assert_healthy(checks)
    by_name = {c.name: c for c in checks}
    assert by_name["maps of every layer vs stock eager (bfloat16, block engine)"].limit == 2 * 2.0 ** -7
    assert by_name["maps of every layer vs stock eager (float32, end to end)"].limit == 1e-4
    _speed(checks)
    # what the Why, Test it and Routes pages run, in the dtype the doctor runs
    for name in ("score attribution: the sources sum to the captured score", "patch: equal to a stock forward hook "
                 "(relative)", "routes: equal to the written-out definition on one layer"):
        assert by_name[name].status == "PASS" and by_name[name].limit > 1e-3, name


@pytest.mark.parametrize("defect", ["patch", "routes", "attribution"])
def test_a_wrong_deep_page_capability_fails_its_check(defect, default_model, monkeypatch):
    """Each new check catches a real defect: a patch that removes the next token's write, routes' heads weighted 5 %
    off, attribution's sources 5 % too large."""
    import importlib

    from attnviz.core.spec import interventions
    from attnviz.flow import contributions
    from attnviz.effects.explain import KeptForward

    if defect == "patch":
        real = interventions.Patch.positions
        monkeypatch.setattr(interventions.Patch, "positions", lambda self, key: [p + 1 for p in real(self, key)])
    elif defect == "routes":
        real = contributions.attention_raw
        monkeypatch.setattr(importlib.import_module("attnviz.flow.trace"), "attention_raw",
                            lambda y, probs, *a: real(y, probs * 1.05, *a))
    else:
        real = KeptForward._source_side
        monkeypatch.setattr(KeptForward, "_source_side", staticmethod(lambda *a, **k: real(*a, **k) * 1.05))
    text = doctor.text_of(default_model, doctor.EQUIVALENCE_TOKENS)
    checks = {c.name.split(":")[0]: c for c in doctor.capabilities(default_model, text)}
    name = {"patch": "patch", "routes": "routes", "attribution": "score attribution"}[defect]
    assert checks[name].status == "FAIL", checks[name].line()
    others = [c for n, c in checks.items() if n != name]
    assert all(c.status == "PASS" for c in others), [c.line() for c in others]


def test_the_float32_check_leaves_a_bfloat16_model_as_it_was(bf16_model):
    """The model is cast to float32 for the end-to-end check; its float32 buffers (rotary frequencies) are not
    rounded to bfloat16 on the way back."""
    model = bf16_model.model
    before = {name: (t.dtype, t.float().clone()) for name, t in [*model.named_parameters(), *model.named_buffers()]}
    doctor.float32_end_to_end(bf16_model, doctor.text_of(bf16_model, 16))
    after = dict([*model.named_parameters(), *model.named_buffers()])
    assert {name: t.dtype for name, t in after.items()} == {name: d for name, (d, _) in before.items()}
    assert any(d == torch.float32 for d, _ in before.values())  # the case that matters: mixed dtypes
    for name, (_, values) in before.items():
        assert torch.equal(after[name].float(), values), name


def _wrong_scale(monkeypatch):
    real = routes.block_probs

    def wrong(run, layer, mask, query, key, scaling, *args, **kwargs):  # the softmax scale 10 % too large
        return real(run, layer, mask, query, key, scaling * 1.1, *args, **kwargs)

    monkeypatch.setattr(routes, "block_probs", wrong)


def _mask_off_by_one_key(monkeypatch):
    real = engine.Run.allow_rows  # where every allow-set is made, whole or a block of rows at a time

    def wrong(self, *args, **kwargs):  # every query also sees the key after its last allowed one
        allow = real(self, *args, **kwargs)
        return allow | torch.roll(allow, 1, dims=-1)

    monkeypatch.setattr(engine.Run, "allow_rows", wrong)


def _statistic_from_the_wrong_row(monkeypatch):
    real = reduce.LayerSummary.tensors

    def wrong(self):  # each query's entropy read from the row before
        out = real(self)
        return {**out, "entropy": torch.roll(out["entropy"], 1, dims=-1)}

    monkeypatch.setattr(reduce.LayerSummary, "tensors", wrong)


def _probabilities_one_percent_off(monkeypatch):
    real = routes.block_probs
    monkeypatch.setattr(routes, "block_probs", lambda *args, **kwargs: real(*args, **kwargs) * 1.01)


DEFECTS = {
    "wrong scale": (_wrong_scale, {"maps of every layer vs stock eager ({dtype}, block engine)",
                                   "top layer after SDPA layers vs stock eager",
                                   "maps of every layer vs stock eager (float32, end to end)"}),
    "mask off by one key": (_mask_off_by_one_key, {"maps of every layer vs stock eager ({dtype}, block engine)",
                                                   "layer outputs vs stock eager ({dtype}, block engine, relative)",
                                                   "top layer after SDPA layers vs stock eager",
                                                   "maps of every layer vs stock eager (float32, end to end)"}),
    "statistic from the wrong row": (_statistic_from_the_wrong_row,
                                     {"statistics, block engine vs their definitions on the full maps"}),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("defect", list(DEFECTS))
def test_each_planted_defect_fails_in_both_dtypes(defect, dtype, default_model, bf16_model, monkeypatch):
    lm = default_model if dtype == "float32" else bf16_model
    assert lm.model.dtype == getattr(torch, dtype) and lm.model.device.type == "cpu"
    text = doctor.text_of(lm, 48)
    plant, expected = DEFECTS[defect]
    plant(monkeypatch)
    checks = doctor.equivalence(lm, text)
    failed = {c.name for c in checks if c.status == "FAIL"}
    assert {name.format(dtype=dtype) for name in expected} <= failed, [c.line() for c in checks]
    for check in checks:
        if check.status == "FAIL" and check.measured is not None:
            assert check.measured > check.limit or np.isnan(check.measured)
    monkeypatch.undo()
    _assert_healthy(doctor.equivalence(lm, text))  # and the same install, repaired, passes


def test_a_route_giving_wrong_numbers_fails_doctor_and_exits_1(tmp_path, monkeypatch, capsys):
    model, tokenizer = build("llama"), char_tokenizer()
    model.save_pretrained(tmp_path), tokenizer.save_pretrained(tmp_path)
    _probabilities_one_percent_off(monkeypatch)
    assert main(["doctor", "--device", "cpu", "--model", str(tmp_path), "--tokens", "64"]) == 1
    out = capsys.readouterr().out
    assert "FAIL maps of every layer vs stock eager" in out and out.splitlines()[-1].startswith("FAILED")
    monkeypatch.undo()
    main(["doctor", "--device", "cpu", "--model", str(tmp_path), "--tokens", "64", "--json"])
    _assert_healthy([doctor.Check(**c) for c in json.loads(capsys.readouterr().out)["checks"]])


@pytest.mark.parametrize("args,message", [
    (["--device", "cuda"], "this machine has no cuda device"),
    (["--tokens", "3"], "--tokens must be at least 16"),
])
def test_doctor_bad_input_is_one_line(args, message, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    assert main(["doctor", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


@pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None, reason="needs Triton")
def test_the_fused_kernel_check_runs_the_long_texts_geometry_and_catches_a_planted_defect(monkeypatch):
    """The GPU's fused-kernel checks, run here in Triton's interpreter on a float16 model (a GPU's half
    precision: a float32 kernel masks every tile): a text long enough for full tiles and a map that pools each
    tile to one cell (what a long text launches); both pass on the kernel as it is, and each fails on a kernel
    that gets its part wrong."""
    from attnviz.core.kernel import kernels

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernel runs compiled on a GPU machine: tests/test_cuda.py runs the doctor there")
    lm = loaded("llama")
    lm.model.to(torch.float16)
    launched = []
    constants = kernels.constants
    monkeypatch.setattr(kernels, "constants", lambda *a: launched.append(constants(*a)) or launched[-1])
    limit, why = doctor.tolerance(torch.float16)
    checks = doctor.fused_kernel(lm, limit, why, force=True)
    assert [c.name for c in checks] == list(doctor.FUSED_NAMES)
    for check in checks:
        assert check.status == "PASS" and 0 <= check.measured <= check.limit, check.line()
    assert launched and all(c["WHOLE"] and c["CAUSAL"] and c["PRECISION"] == "tf32" for c in launched)
    real = kernels.layer_statistics
    # wrong from the second row block on (the rows with full tiles): row sums 10 % short, the cells of those rows
    # lost (a random tiny model attends almost evenly, so its cells hold ~1/64: 10 % of that is within a float16
    # step, the limit of a half-precision check)
    for broken, rows, scale, failing in (("rowsum", slice(100, None), 0.9, 0), ("pooled", slice(1, None), 0.0, 1)):
        def planted(*args, _part=broken, _rows=rows, _scale=scale, **kwargs):
            out = real(*args, **kwargs)
            out[_part][:, _rows] *= _scale
            return out

        monkeypatch.setattr(kernels, "layer_statistics", planted)
        statuses = [c.status for c in doctor.fused_kernel(lm, limit, why, force=True)]
        assert statuses[failing] == "FAIL" and statuses[1 - failing] == "PASS", (broken, statuses)


@pytest.fixture
def chosen(monkeypatch):
    """Every route the route table chooses, with the thread it chose it in; the fused route is recorded, then run as
    the block engine, so that no kernel is launched (and the table answers the same with or without Triton)."""
    real, seen = routes.choose_route, []

    def spy(facts):
        route = real(facts)
        seen.append((threading.get_ident(), route))
        return routes.Route.BLOCKS if route is routes.Route.FUSED else route

    monkeypatch.setattr(routes, "choose_route", spy)
    monkeypatch.setattr(kernels, "available", lambda: True)
    return seen


def _routes_of(lm, chosen, **forced) -> set:
    chosen.clear()
    with routes.forcing(**forced):
        capture(lm, "a b c d e f g h i j k l", "fwd", Keep(statistics=True, pool=8))
    return {route for _, route in chosen}


def test_a_route_forced_by_argument_is_taken_whatever_the_environment_says(chosen, monkeypatch, use_settings):
    """``routes.forcing(fused=...)`` wins over the settings' ``fused`` both ways, for the calls inside only, and leaves the
    environment and the settings as they were; None changes nothing, and the innermost choice wins."""
    lm = loaded("llama")
    fused, blocks = routes.Route.FUSED, routes.Route.BLOCKS
    use_settings(fused=True)
    before = (dict(os.environ), settings.active())
    assert _routes_of(lm, chosen) == {fused}  # the user's setting
    assert _routes_of(lm, chosen, fused=False) == {blocks}
    assert _routes_of(lm, chosen, fused=None) == {fused}
    assert (dict(os.environ), settings.active()) == before
    use_settings(fused=False)
    before = (dict(os.environ), settings.active())
    assert _routes_of(lm, chosen) == {blocks}
    assert _routes_of(lm, chosen, fused=True) == {fused}
    with routes.forcing(fused=True):
        assert _routes_of(lm, chosen, fused=False) == {blocks}
        assert _routes_of(lm, chosen, fused=None) == {fused}
    assert routes.forced_fused() is None and (dict(os.environ), settings.active()) == before


def test_a_forced_route_is_the_forcing_threads_only(chosen, monkeypatch, use_settings):
    """Another thread's forwards on the same model follow the user's setting while this thread forces a route, even
    given a copy of this thread's context."""
    lm = loaded("llama")
    use_settings(fused=True)
    seen = {}

    def other():
        seen["forced"] = routes.forced_fused()
        seen["routes"] = _routes_of(lm, chosen)

    with routes.forcing(fused=False):
        assert routes.forced_fused() is False
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        copied = contextvars.copy_context()
        thread = threading.Thread(target=lambda: seen.update(copied=copied.run(routes.forced_fused)))
        thread.start()
        thread.join()
        assert _routes_of(lm, chosen) == {routes.Route.BLOCKS}  # and this thread's own choice still holds
    assert seen == {"forced": None, "routes": {routes.Route.FUSED}, "copied": None}


def test_the_doctors_checks_choose_their_route_by_argument(chosen, monkeypatch, use_settings):
    """The block engine's statistics check takes the block engine where the user's setting asks for the fused route,
    without touching the environment."""
    use_settings(fused=True)
    lm = loaded("llama")
    assert routes.Route.FUSED in _routes_of(lm, chosen)  # what the setting alone does
    before = (dict(os.environ), settings.active())
    chosen.clear()
    checks = doctor.equivalence(lm, doctor.text_of(lm, 48))
    assert (dict(os.environ), settings.active()) == before
    assert chosen and routes.Route.FUSED not in {route for _, route in chosen}
    statistics = next(c for c in checks if c.name.startswith("statistics, block engine"))
    assert statistics.status == "PASS", statistics.line()
