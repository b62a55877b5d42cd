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

ENGLISH = ("The old lighthouse keeper climbed the narrow stairs every evening to light the lamp. "
           "Ships passing the rocky coast relied on its steady beam, and in fifty years he had never "
           "missed a single night, not even during the great storm of the winter.")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """One fresh cache per test session, so the GGUF → safetensors conversion itself is tested."""
    path = os.environ.get("ATTNVIZ_TEST_CACHE") or str(tmp_path_factory.mktemp("attnviz-cache"))
    os.environ["ATTNVIZ_CACHE"] = path
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
