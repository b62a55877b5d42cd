import os
import sys
from pathlib import Path

import pytest

# Nothing in the tests may reach a hub: the default model comes from an installed PyPI wheel.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# No test depends on the device the machine would pick: models load on the CPU unless a test names a device
# (CPU references, the app's captions and budgets, the CLI's subprocesses and the app's server all inherit
# this). Tests marked ``cuda`` name CUDA themselves; tests of the choice itself clear it (tests/test_devices.py).
os.environ["ATTNVIZ_DEVICE"] = "cpu"
sys.path.insert(0, str(Path(__file__).parent))


def _a_share_of_the_cores() -> None:
    """With pytest-xdist (``-n 2``, as test.sh runs the suite), each worker takes its share of the cores for torch's
    threads (and the subprocesses it starts, through ``OMP_NUM_THREADS``): two workers of two threads each on a
    2-core machine would fight over them. One process (no ``-n``) keeps torch's own choice."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        share = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)


_a_share_of_the_cores()


def _pretend_cuda() -> None:
    """``ATTNVIZ_TEST_PRETEND_CUDA=1``: torch says CUDA is available although it is not, so that a CPU machine
    shows which tests would depend on it (docs/gpu.md#running-on-a-gpu). Run it with ``-m "not cuda"``:
    the tests marked ``cuda`` need a real GPU."""
    if os.environ.get("ATTNVIZ_TEST_PRETEND_CUDA") == "1":
        import torch

        torch.cuda.is_available = lambda: True


_pretend_cuda()


def _interpret_triton_without_a_gpu() -> None:
    """Triton kernels run in Triton's interpreter on a machine without a GPU (tests/test_fused.py). The
    flag must be set before anything imports ``triton.language`` (some imports do, early), so it is
    set here, first; on a GPU machine the kernels run compiled and tests/test_cuda.py covers them."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_a_gpu()


def _settings_of_the_suite() -> None:
    """The suite is a front end: it reads its settings (the CPU above) from the environment once and hands them to
    the library, as the CLI and the app do (attnviz.settings); each test leaves them as it found them
    (:func:`_settings_restored`)."""
    from attnviz import settings

    settings.use(settings.Settings.from_environment())


_settings_of_the_suite()


@pytest.fixture(autouse=True)
def _settings_restored():
    """A test that changes the library's settings (``settings.use``, or the CLI run in-process) changes them for
    itself only."""
    from attnviz import settings

    before = settings.active()
    yield
    settings.use(before)


@pytest.fixture(scope="session", autouse=True)
def _one_browser_for_static_images():
    """Every static image the suite makes (attnviz.figures.export, the reproductions' PDF, the HTML report's SVGs)
    goes through one kaleido browser, started at the first image and closed at the end of the session, where
    kaleido would launch a Chromium for each image (seconds each). The figure and its options reach the browser
    unchanged (kaleido's own sync server); a lock keeps two threads' images apart (the server answers in order)."""
    import threading

    try:
        import kaleido
    except ImportError:
        yield
        return
    plain, lock = kaleido.calc_fig_sync, threading.Lock()

    def calc_fig_sync(*args, **kwargs):
        if set(kwargs.get("kopts") or ()) - {"headers"}:  # a browser of other options: its own, as before
            return plain(*args, **kwargs)
        with lock:
            kwargs.pop("kopts", None)  # plotly's request headers only: nothing is fetched offline
            kaleido.start_sync_server(silence_warnings=True)
            return plain(*args, **kwargs)

    kaleido.calc_fig_sync = calc_fig_sync
    yield
    kaleido.calc_fig_sync = plain
    kaleido.stop_sync_server(silence_warnings=True)


@pytest.fixture
def use_settings():
    """``use_settings(fused=True, ...)``: the library runs under the active settings with those changes for the
    rest of the test (what a front end's ``ATTNVIZ_*`` variables would hand it)."""
    from attnviz import settings

    def use(**changes):
        return settings.use(settings.active().replace(**changes))
    return use

ENGLISH = ("The old lighthouse keeper climbed the narrow stairs every evening to light the lamp. "
           "Ships passing the rocky coast relied on its steady beam, and in fifty years he had never "
           "missed a single night, not even during the great storm of the winter.")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """One fresh cache per test session, so the GGUF → safetensors conversion itself is tested; with pytest-xdist
    one for the whole run, shared by its workers (the first to load a model converts it under the cache's file lock,
    the others wait for it and read it: a model converted once a run, not once a worker)."""
    path = os.environ.get("ATTNVIZ_TEST_CACHE")
    if not path:
        root = tmp_path_factory.getbasetemp()
        root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # the run's folder, above each worker's
        cache = root / "attnviz-cache"
        cache.mkdir(exist_ok=True)
        path = str(cache)
    os.environ["ATTNVIZ_CACHE"] = path
    from attnviz import settings

    settings.use(settings.active().replace(cache=path))
    return Path(path)


@pytest.fixture(scope="session")
def default_model(model_cache):
    from attnviz import load

    return load("default", device="cpu")


@pytest.fixture(scope="session")
def gemma3_model(model_cache):
    """Gemma 3 270M, the second real model: assembled and converted once per session (the dev set-up installs
    its packages)."""
    from attnviz import load

    return load("gemma3-270m", device="cpu")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a GPU: skipped, with the reason, on a machine without one."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray of 2 CPUs for a test module's sweeps (tests/test_sweep.py, tests/test_sweep_train.py), the model
    cache's folder passed to its workers."""
    import tempfile

    import ray
    from filelock import FileLock

    # One local Ray at a time on this machine: with pytest-xdist another worker's module waits here (its tests
    # count a cluster's workers and kill one).
    with FileLock(Path(tempfile.gettempdir()) / "attnviz-tests-ray.lock"):
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": {k: os.environ[k] for k in ("ATTNVIZ_CACHE",) if k in os.environ}})
        yield ray
        ray.shutdown()
