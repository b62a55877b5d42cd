"""The device and dtype in the sidebar, a capture the device cannot
hold refused before it runs (simulated on the CPU with a small device budget), and recovery from a
device out-of-memory error in the middle of a capture, the server serving on."""

import pytest
import torch

from attnviz.core.engine import routes
from attnviz import capture
from attnviz.plan import Keep
from attnviz.core.model import devices
from attnviz.core import engine
from attnviz.errors import AttnvizError

from conftest import ENGLISH
from test_app import app_test, charts, texts
from test_cli import run


def test_the_sidebar_says_where_the_model_runs(model_cache, tmp_path):
    at = app_test(tmp_path)
    at.run()
    assert not at.exception
    assert "runs on `cpu · float32` · statistics in float32" in texts(at.sidebar.caption)


def test_a_capture_the_device_cannot_hold_is_refused_then_fits_with_more(model_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNVIZ_DEVICE_MB", "12")  # a 12 MB "device": the example (~7 MB) fits, 500 tokens do not
    at = app_test(tmp_path)
    at.run()
    assert not at.exception and not at.error, texts(at.error)
    at.sidebar.text_area(key="text").input(" ".join([ENGLISH] * 10)).run()
    assert not at.exception
    message = texts(at.error)
    assert "free there" in message and "What would fit: a text of at most" in message
    monkeypatch.setenv("ATTNVIZ_DEVICE_MB", "4000")
    at.run()
    assert not at.exception and not at.error, texts(at.error)
    assert charts(at)


def test_out_of_memory_during_a_capture_is_explained_and_the_server_goes_on(model_cache, tmp_path, monkeypatch):
    real, failures, released = routes.block_probs, [], []

    def once_out_of_memory(*args, **kwargs):
        if not failures:
            failures.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(*args, **kwargs)

    fresh = "A text no earlier test captured: the device fails in the middle of it, once."
    at = app_test(tmp_path)
    at.run()  # the default text's capture, before the device fails
    monkeypatch.setattr(routes, "block_probs", once_out_of_memory)
    real_release = devices.release
    monkeypatch.setattr(devices, "release", lambda: released.append(True) or real_release())
    at.sidebar.text_area(key="text").input(fresh).run()
    assert not at.exception
    assert "ran out of memory" in texts(at.error) and "cache has been emptied" in texts(at.error)
    assert released == [True]
    (tmp_path / "other").mkdir()
    other = app_test(tmp_path / "other")  # another session on the same server: its capture runs
    other.run()
    other.sidebar.text_area(key="text").input(fresh).run()
    assert not other.exception and not other.error, texts(other.error)
    assert charts(other)
    at.run()  # and the first session recovers on its next run
    assert not at.exception and not at.error and charts(at)


def test_library_refusal_and_recovery_with_a_small_device_budget(default_model, use_settings):
    use_settings(device_mb=4)
    with pytest.raises(devices.DeviceMemoryError, match="What would fit: a text of at most ~\\d+ tokens"):
        capture(default_model, " ".join([ENGLISH] * 10), "fwd", Keep(statistics=True))
    use_settings(device_mb=4000)
    assert capture(default_model, ENGLISH, "fwd", Keep(statistics=True)).stats


def test_out_of_memory_in_the_library_becomes_one_clear_error(default_model, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(routes, "block_probs", out_of_memory)
    with pytest.raises(AttnvizError, match="ran out of memory during a capture of .* tokens"):
        capture(default_model, ENGLISH, "fwd", Keep(statistics=True))


def test_cli_refuses_what_the_device_cannot_hold(model_cache):
    out = run("sinks", "--text", " ".join([ENGLISH] * 10), env={"ATTNVIZ_DEVICE_MB": "4"})
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "What would fit" in out.stderr
