"""Settings at the edge (docs/cli.md#settings): the CLI, the app and the doctor read the environment into one
``attnviz.settings.Settings`` and hand it down; the library, used alone, gives the same results with every
``ATTNVIZ_*`` variable set as with none, and under the settings a front end hands it, what the variables say."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from attnviz import settings
from attnviz.errors import InputError
from attnviz.settings import DEFAULTS, Settings

ROOT = Path(__file__).resolve().parent.parent
TEXT = "The cat sat on the mat, and the dog sat on the log."
# every variable the library would read, each set to what would change its answer
SET = {"ATTNVIZ_DEVICE": "meta", "ATTNVIZ_DTYPE": "float16", "ATTNVIZ_CACHE": "/nowhere/attnviz",
       "ATTNVIZ_DEVICE_MB": "0.001", "ATTNVIZ_BLOCK_MB": "0.01", "ATTNVIZ_WHOLE_ALLOW_MB": "0", "ATTNVIZ_FUSED": "1",
       "ATTNVIZ_FUSED_LSE": "0", "ATTNVIZ_CUDNN": "0", "ATTNVIZ_VIEWER_MB": "0.5", "ATTNVIZ_KERNEL_TILE": "32x32",
       "ATTNVIZ_KERNEL_WARPS": "4", "ATTNVIZ_KERNEL_STAGES": "2", "ATTNVIZ_KERNEL_GROUPS": "2",
       "ATTNVIZ_KERNEL_REGISTERS": "96"}

# what the library answers, printed as JSON: its settings, every default they decide, and a statistics capture
PROBE = """
import json, sys
sys.path.insert(0, "tests")
from attnviz import settings
from attnviz.capture import capture
from attnviz.plan import Keep
from attnviz.core.model import devices
from attnviz.core.kernel import kernels
from attnviz.core.loading.models import _resolve_dtype, cache_dir
from attnviz.core.sizing.sizes import whole_allow_bytes
from attnviz.viewer import payload
from tiny import loaded
import torch
cap = capture(loaded("llama"), sys.argv[1], "fwd", Keep(statistics=True))
print(json.dumps({"defaults": settings.active() == settings.DEFAULTS, "device": devices.default_device(),
                  "dtype": str(_resolve_dtype(None, "cpu")), "cache": str(cache_dir()),
                  "device_budget": devices.free_bytes("cpu"), "block": devices.block_bytes("cpu"),
                  "whole_allow": whole_allow_bytes(), "viewer": payload.budget(),
                  "launch": kernels.launch(torch.device("cpu"), False), "fused": kernels.wanted(torch.device("cpu")),
                  "alpha": {str(l): cap.stats[l]["alpha"].tolist() for l in cap.layers},
                  "fallback": cap.meta.get("fused_fallback")}))
"""


def _probe(env: dict) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ATTNVIZ_")}
    done = subprocess.run([sys.executable, "-c", PROBE, TEXT], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**clean, "PYTHONPATH": str(ROOT), **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def probes():
    """What the library answers in a fresh process without any ``ATTNVIZ_*`` variable, and with every one set."""
    return _probe({}), _probe(SET)


def test_the_library_gives_the_same_results_with_the_variables_set_and_unset(probes):
    """A library user who never calls the edge gets the documented defaults whatever the environment says: the same
    device, dtype, cache, budgets, kernel launch and route, and the same statistics (a 0.001 MB device budget would
    refuse the capture, were it read)."""
    unset, given = probes
    assert given == unset
    assert unset["defaults"] and unset["fallback"] is None
    assert unset["device"] == ("cuda" if torch.cuda.is_available() else "cpu") and unset["dtype"] == "torch.float32"
    assert unset["cache"] == str(Path.home() / ".cache" / "attnviz")
    assert unset["device_budget"] is None and unset["block"] == 16 * 2**20 and unset["whole_allow"] == 256 * 2**20
    assert unset["viewer"] == 40 * 2**20 and unset["launch"][:4] == [64, 64, 8, None] and unset["launch"][5] is None


def test_the_edge_reads_every_variable_and_the_library_follows_what_it_is_handed():
    """What the CLI and the app hand the library (``Settings.from_environment`` then ``use``): each variable reaches
    the default it sets."""
    given = Settings.from_environment(SET)
    assert given == DEFAULTS.replace(device="meta", dtype="float16", cache="/nowhere/attnviz", device_mb=0.001,
                                     block_mb=0.01, whole_allow_mb=0, fused=True, fused_lse=False, cudnn=False,
                                     viewer_mb=0.5, kernel_tile=(32, 32), kernel_warps=4, kernel_stages=2,
                                     kernel_groups=2, kernel_registers=96)
    assert Settings.from_environment({}) == DEFAULTS
    from attnviz.core.kernel import kernels
    from attnviz.core.loading.models import _resolve_dtype, cache_dir
    from attnviz.core.model import devices
    from attnviz.core.sizing.sizes import whole_allow_bytes
    from attnviz.viewer import payload

    with settings.applied(given):
        assert devices.default_device() == "meta" and _resolve_dtype(None, "cpu") == torch.float16
        assert cache_dir() == Path("/nowhere/attnviz") and devices.free_bytes("cpu") == int(0.001 * 2**20)
        assert devices.block_bytes("cpu") == int(0.01 * 2**20) and whole_allow_bytes() == 0
        assert payload.budget() == int(0.5 * 2**20)
        assert kernels.launch(torch.device("cpu"), False) == (32, 32, 4, 2, 2, 96)
        assert kernels.wanted(torch.device("cpu")) == kernels.available()
    assert settings.active() != given  # and after, as before


def test_the_app_reads_its_sizes_from_the_environment_then_its_secrets():
    secrets = {"memory_mb": 600, "full_maps_mb": 8, "jobs": 2, "max_tokens": 512}
    given = Settings.from_environment({"ATTNVIZ_MEMORY_MB": "700", "ATTNVIZ_SHARED": "0"}, secrets)
    assert (given.memory_mb, given.full_maps_mb, given.checkpoint_mb) == (700, 8, 512)
    assert given.cap("jobs", 1) == 2 and given.cap("max_cells", 12) == 12 and given.shared is False


@pytest.mark.parametrize("variable,value", [("ATTNVIZ_KERNEL_STAGES", "two"), ("ATTNVIZ_DEVICE_MB", "lots"),
                                            ("ATTNVIZ_KERNEL_TILE", "64")])
def test_a_value_a_variable_does_not_take_is_refused_with_its_name(variable, value):
    with pytest.raises(InputError, match=f"{variable}='{value}'"):
        Settings.from_environment({variable: value})


def test_the_cli_honours_the_variables(model_cache, tmp_path):
    """The command line reads them: the dtype a model loads in, and a bad value refused in one line (exit 2)."""
    from attnviz.captured import Capture
    from test_cli import run

    out = tmp_path / "cap.npz"
    done = run("capture", "--model", "default", "--text", TEXT, "--layers", "0", "--out", str(out),
               env={"ATTNVIZ_DTYPE": "bfloat16"})
    assert done.returncode == 0, done.stderr
    assert Capture.load(out).meta["dtype"] == "bfloat16"
    done = run("masks", "--arch", "fwd", "--layers", "2", "--n", "3", "--json", env={"ATTNVIZ_KERNEL_STAGES": "two"})
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "attnviz: error: ATTNVIZ_KERNEL_STAGES='two': not a whole number"]


def test_a_failed_fused_launch_is_told_to_the_visitor(monkeypatch):
    """The shared server's capture path (ui/cache.get_capture → ui/shared.fell_back) warns with the reason where a
    capture fell back to the block engine, and says nothing where it did not."""
    sys.path.insert(0, str(ROOT))
    from ui import shared

    warned = []
    monkeypatch.setattr(shared.st, "warning", lambda text: warned.append(text))
    shared.fell_back(type("Made", (), {"meta": {"fused_fallback": ["cuda:0 bfloat16 (1, 9, 4096, 64): "
                                                                   "RuntimeError: PTX assembly failed"]}})())
    shared.fell_back(type("Made", (), {"meta": {}})())
    shared.fell_back(None)
    assert len(warned) == 1 and "PTX assembly failed" in warned[0] and "block engine" in warned[0]


def test_the_app_warns_the_visitor_whose_capture_fell_back(model_cache, tmp_path, monkeypatch):
    """The app, run as a visitor sees it: a statistics capture (``ATTNVIZ_FULL_MAPS_MB=0``) by the fused route
    (``ATTNVIZ_FUSED=1``, read by app.py) whose launch fails is computed by the block engine, and the page says so
    with the reason; the next capture tries the kernel again."""
    from attnviz.core.kernel import kernels
    from test_app import app_test, charts, texts

    def broken(*args, **kwargs):
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setenv("ATTNVIZ_FUSED", "1")
    monkeypatch.setenv("ATTNVIZ_FULL_MAPS_MB", "0")
    monkeypatch.setattr(kernels, "layer_statistics", broken)
    at = app_test(tmp_path)
    at.run()
    assert not at.exception and not at.error, texts(at.error)
    assert charts(at)
    warning = texts(at.warning)
    assert "fell back from the fused statistics kernel" in warning and "PTX assembly failed" in warning, warning


def test_statistics_match_between_the_probe_and_this_process(probes):
    """The probe's capture is the capture this process makes under the defaults (the probe measures the library,
    not another model)."""
    from attnviz.capture import capture
    from attnviz.plan import Keep
    from tiny import loaded

    with settings.applied(DEFAULTS):
        cap = capture(loaded("llama"), TEXT, "fwd", Keep(statistics=True))
    probed = probes[1]["alpha"]
    for layer in cap.layers:
        np.testing.assert_allclose(np.asarray(probed[str(layer)], dtype=float), cap.stats[layer]["alpha"],
                                   rtol=1e-6, equal_nan=True)


@pytest.mark.parametrize("variable,value,words", [
    ("ATTNVIZ_MEMORY_MB", "-5", r"memory_mb \(ATTNVIZ_MEMORY_MB\) is a whole number of MB, at least 0 .*, not -5"),
    ("ATTNVIZ_FULL_MAPS_MB", "-1", r"full_maps_mb \(ATTNVIZ_FULL_MAPS_MB\) is a whole number of MB, at least 0"),
    ("ATTNVIZ_CHECKPOINT_MB", "-2", r"checkpoint_mb \(ATTNVIZ_CHECKPOINT_MB\)"),
    ("ATTNVIZ_RESULTS_MB", "0", r"results_mb \(ATTNVIZ_RESULTS_MB\) is a whole number of MB, at least 1, not 0"),
    ("ATTNVIZ_WHOLE_ALLOW_MB", "-1", r"whole_allow_mb \(ATTNVIZ_WHOLE_ALLOW_MB\)"),
    ("ATTNVIZ_DEVICE_MB", "-1", r"device_mb \(ATTNVIZ_DEVICE_MB\) is a number of MB above 0 or None, not -1.0"),
    ("ATTNVIZ_DEVICE_MB", "nan", r"device_mb \(ATTNVIZ_DEVICE_MB\) is a number of MB above 0 or None, not nan"),
    ("ATTNVIZ_BLOCK_MB", "inf", r"block_mb \(ATTNVIZ_BLOCK_MB\) is a number of MB above 0"),
    ("ATTNVIZ_VIEWER_MB", "0", r"viewer_mb \(ATTNVIZ_VIEWER_MB\) is a number of MB above 0"),
    ("ATTNVIZ_MAX_TOKENS", "-3", r"max_tokens \(ATTNVIZ_MAX_TOKENS\) is a whole number of tokens, at least 1"),
    ("ATTNVIZ_KERNEL_TILE", "0x64", r"kernel_tile \(ATTNVIZ_KERNEL_TILE\) is two whole numbers above 0"),
    ("ATTNVIZ_KERNEL_WARPS", "5", r"kernel_warps \(ATTNVIZ_KERNEL_WARPS\) is 4 or 8 or None, not 5"),
    ("ATTNVIZ_KERNEL_STAGES", "0", r"kernel_stages \(ATTNVIZ_KERNEL_STAGES\) is a whole number, at least 1"),
    ("ATTNVIZ_KERNEL_GROUPS", "-2", r"kernel_groups \(ATTNVIZ_KERNEL_GROUPS\)"),
    ("ATTNVIZ_KERNEL_REGISTERS", "-8", r"kernel_registers \(ATTNVIZ_KERNEL_REGISTERS\)"),
    ("ATTNVIZ_DTYPE", "float64", r"dtype \(ATTNVIZ_DTYPE\) is one of auto, float32, .*, not 'float64'"),
    ("ATTNVIZ_FUSED", "2", r"ATTNVIZ_FUSED='2': not a switch"),
    ("ATTNVIZ_FUSED_LSE", "off", r"ATTNVIZ_FUSED_LSE='off': not a switch"),
    ("ATTNVIZ_CUDNN", "maybe", r"ATTNVIZ_CUDNN='maybe': not a switch"),
    ("ATTNVIZ_DEBUG", "x", r"ATTNVIZ_DEBUG='x': not a switch"),
    ("ATTNVIZ_SHARED", "perhaps", r"ATTNVIZ_SHARED='perhaps': not a switch"),
    ("ATTNVIZ_TRUST_REMOTE_CODE", "sure", r"ATTNVIZ_TRUST_REMOTE_CODE='sure': not a switch"),
])
def test_a_value_out_of_its_range_is_refused_when_the_settings_are_read(variable, value, words):
    """Each was taken before: a negative memory budget as the default, a NaN or negative device cap, warps the kernel
    then ignored, a switch word read as its opposite or as unset."""
    with pytest.raises(InputError, match=words) as err:
        Settings.from_environment({variable: value})
    assert "\n" not in str(err.value)


def test_a_switch_reads_its_words_both_ways():
    """``ATTNVIZ_DEBUG=0`` turned the traceback on and ``ATTNVIZ_FUSED_LSE=false`` left it on: each switch takes
    1/true/yes and 0/false/no alike."""
    for on, off in (("1", "0"), ("true", "false"), ("YES", "No")):
        assert Settings.from_environment({f"ATTNVIZ_{v}": on for v in ("DEBUG", "FUSED", "FUSED_LSE", "CUDNN",
                                                                        "SHARED", "TRUST_REMOTE_CODE")}) == \
            DEFAULTS.replace(debug=True, fused=True, fused_lse=True, cudnn=True, shared=True, trust_remote_code=True)
        assert Settings.from_environment({f"ATTNVIZ_{v}": off for v in ("DEBUG", "FUSED", "FUSED_LSE", "CUDNN",
                                                                         "SHARED", "TRUST_REMOTE_CODE")}) == \
            DEFAULTS.replace(debug=False, fused=False, fused_lse=False, cudnn=False, shared=False,
                             trust_remote_code=False)


@pytest.mark.parametrize("changes,words", [
    (dict(memory_mb=-5), r"memory_mb \(ATTNVIZ_MEMORY_MB\) is a whole number of MB, at least 0 .*, not -5"),
    (dict(memory_mb="abc"), r"memory_mb \(ATTNVIZ_MEMORY_MB\) is a whole number .*, not 'abc'"),
    (dict(memory_mb=1.5), r"memory_mb \(ATTNVIZ_MEMORY_MB\)"),
    (dict(memory_mb=True), r"memory_mb \(ATTNVIZ_MEMORY_MB\)"),
    (dict(bogus=1), r"the settings have no 'bogus' \(they are device, dtype, "),
    (dict(fused="yes"), r"fused \(ATTNVIZ_FUSED\) is True or False or None, not 'yes'"),
    (dict(debug=None), r"debug \(ATTNVIZ_DEBUG\) is True or False, not None"),
    (dict(device_mb=float("nan")), r"device_mb \(ATTNVIZ_DEVICE_MB\)"),
    (dict(roots="/data"), r"roots \(ATTNVIZ_ROOTS\) is folders' paths, not '/data'"),
    (dict(caps=(("jobs", 0),)), r"caps \(secrets.toml's \[attnviz\] table\)"),
])
def test_settings_replaced_are_checked_as_read(changes, words):
    with pytest.raises(InputError, match=words) as err:
        DEFAULTS.replace(**changes)
    assert "\n" not in str(err.value)
    assert DEFAULTS.replace(memory_mb=512, kernel_tile=[32, 32]).kernel_tile == (32, 32)  # a list kept as a tuple


def test_every_setting_has_its_check():
    from dataclasses import fields

    assert set(settings.TAKES) == {f.name for f in fields(Settings)}


def test_the_cli_refuses_a_negative_memory_budget_in_one_line():
    from test_cli import run

    done = run("masks", "--arch", "fwd", "--layers", "2", "--n", "3", "--json", env={"ATTNVIZ_MEMORY_MB": "-5"})
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "attnviz: error: the setting memory_mb (ATTNVIZ_MEMORY_MB) is a whole number of MB, at least 0 (0: a quarter "
        "of the machine's memory), not -5 (docs/cli.md#settings)"]
