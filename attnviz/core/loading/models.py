"""Loading decoder LMs: a shipped offline model (:mod:`attnviz.core.loading.shipped`: SmolLM2-135M-Instruct by default,
Gemma 3 270M) or any Hugging Face id or local directory. Weights are only ever read from safetensors or GGUF.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from attnviz import settings
from attnviz.core.model import devices
from attnviz.core.loading.shipped import (DEFAULT, DEFAULT_GGUF, DEFAULT_NAME, DEFAULT_PACKAGE, SHIPPED,  # noqa: F401
                                  Progress, Shipped, converted, cache_dir, default_gguf,
                                  shipped_gguf, shipped_installed)
from attnviz.errors import InputError, ModelLoadError


def require(loaded, what: str) -> "LoadedModel":
    """``loaded`` when it is a loaded model, else an :class:`InputError` in one line: ``what`` (a capability's call)
    takes ``attnviz.load(...)``'s result, not a model's name."""
    if not isinstance(loaded, LoadedModel):
        hint = f": lm = attnviz.load({loaded[:60]!r}) first" if isinstance(loaded, str) else ""
        raise InputError(f"{what} takes a loaded model (attnviz.load(...)), not a {type(loaded).__name__}{hint}")
    return loaded


@dataclass
class LoadedModel:
    """The model interface the rest of attnviz (and the app) talks to."""

    model: object
    tokenizer: object
    model_id: str
    model_file: str | None
    load_seconds: float
    residual: object = None  # a residual.Variant, for directories written by `attnviz finetune --residual`

    @property
    def config(self):
        return self.model.config.get_text_config()

    @property
    def n_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def is_encoder_decoder(self) -> bool:
        """T5, BART, Marian ...: see :mod:`attnviz.seq2seq`; ``n_layers`` then counts encoder layers."""
        return bool(getattr(self.model.config, "is_encoder_decoder", False))

    @property
    def n_heads(self) -> int:
        return int(self.config.num_attention_heads)

    @property
    def n_kv_heads(self) -> int:
        return int(getattr(self.config, "num_key_value_heads", None) or self.n_heads)

    @property
    def max_tokens(self) -> int:
        for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = getattr(self.config, name, None)
            if value:
                return int(value)
        return 2048

    @property
    def kv_groups(self) -> list[int]:
        group = self.n_heads // self.n_kv_heads
        return [h // group for h in range(self.n_heads)]


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether the Hub's endpoint answers a TCP connection within ``timeout`` seconds.

    Without this, an unknown name costs transformers' retries (~24 s here, where the Hub cannot be
    reached) before it fails. Offline mode (``HF_HUB_OFFLINE=1``) means no: transformers then looks
    only in the local cache, which is quick.
    """
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True  # transformers checks the local cache only: fast, and it says so itself
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout):
            return True
    except OSError:
        return False


def hub_revision(name: str) -> tuple[str, str | None]:
    """A Hub id and its revision from ``id@revision`` (a branch, tag or commit: Pythia's ``step1000`` branches), or
    the id and None. Only for names that are no local directory: a Hub id has no ``@`` of its own."""
    repo, at, revision = name.partition("@")
    if at and (not repo or not revision):
        raise InputError(f"'{name}': a Hub revision is written id@revision, e.g. EleutherAI/pythia-70m@step1000")
    return (repo, revision) if at else (name, None)


#: the weight files attnviz loads, and the ones a revision's or a folder's hash covers
WEIGHT_FILES = (".safetensors", ".gguf")
#: the files a model folder's tokenizer is read from, one of them at least (a GGUF file carries its own)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")


class IncompleteFolder(ModelLoadError, InputError):
    """A model directory with a config.json that lacks its weights or its tokenizer: the message says which."""


def check_folder(folder: Path, name: str) -> None:
    """Refuse in one line a model directory that lacks what a load reads beside its config.json: weights
    (safetensors or GGUF) and a tokenizer (:data:`TOKENIZER_FILES`, or a GGUF file); both named where both lack."""
    files = {p.name for p in folder.iterdir() if p.is_file()}
    gguf = any(f.endswith(".gguf") for f in files)
    lacks = []
    if not any(f.endswith(WEIGHT_FILES) or f.endswith(".safetensors.index.json") for f in files):
        pickles = sorted(f for f in files if f.endswith((".bin", ".pt", ".pth", ".ckpt")))
        lacks.append("weights (a .safetensors or .gguf file; attnviz loads only safetensors or GGUF"
                     + (f", never pickles such as {pickles[0]})" if pickles else ")"))
    if not gguf and not files & set(TOKENIZER_FILES):
        lacks.append(f"tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    if lacks:
        raise IncompleteFolder(f"'{name}' has a config.json but no {' and no '.join(lacks)}: save the model's "
                               "weights and its tokenizer into it (model.save_pretrained, tokenizer.save_pretrained)")


def _listing_hash(files: list[tuple[str, str]]) -> str:
    """One hash of weight files listed as (name, SHA-256), in name order: the Hub's listing and a folder's agree."""
    import hashlib

    return hashlib.sha256(repr(sorted(files)).encode()).hexdigest()[:16]


def revision_hash(name: str) -> str:
    """A hash of the weight files the Hub serves at ``id@revision`` (their SHA-256 as the Hub lists them, nothing
    downloaded): two revisions that serve the same weights have the same hash (docs/sweeps.md#checkpoints)."""
    from huggingface_hub import HfApi

    repo, revision = hub_revision(name)
    try:
        info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    except Exception as err:  # noqa: BLE001 - no network, no such repo or revision: one line
        raise ModelLoadError(f"cannot read the weights of '{name}' from the Hub: "
                             f"{(str(err).splitlines() or [type(err).__name__])[0]}") from None
    files = [(s.rfilename, getattr(s.lfs, "sha256", None) or s.blob_id) for s in info.siblings or ()
             if s.rfilename.endswith(WEIGHT_FILES)]
    if not files:
        raise ModelLoadError(f"'{name}' serves no safetensors or GGUF weights (attnviz loads only those)")
    return _listing_hash(files)


def folder_hash(folder) -> str:
    """A hash of the weight files in a local model folder, as :func:`revision_hash` makes it from the Hub's listing
    (each file's name and SHA-256): a folder copied from a revision hashes as that revision; no model is built."""
    import hashlib

    files = []
    for path in Path(folder).iterdir():
        if path.is_file() and path.name.endswith(WEIGHT_FILES):
            digest = hashlib.sha256()
            with path.open("rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
            files.append((path.name, digest.hexdigest()))
    if not files:
        raise ModelLoadError(f"'{folder}' holds no safetensors or GGUF weights (attnviz loads only those)")
    return _listing_hash(files)


def local_directory(name: str) -> str | None:
    """The model directory ``name`` names on this machine, or None when it names none (a Hub id).

    Any existing path is local, whatever its form: absolute (``/data/models/llama``), relative
    (``./llama``, ``models/llama``), ``~`` or a bare directory name in the working directory
    (``llama``). Those are never looked up on the Hub, so they load offline. A name that starts like
    a path (``.``, ``/``, ``~``) but does not exist is refused here rather than sent to the Hub.
    """
    from attnviz.core.loading import runs  # a lab run's folder or one of its checkpoints (docs/lab.md#loading)

    path = runs.checkpoint(Path(name).expanduser(), name)
    if not (path.exists() or name.startswith((".", "/", "~"))):
        return None
    if not path.is_dir():
        raise ModelLoadError(f"'{name}' is not a directory" if path.exists() else f"'{name}' does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"'{name}' is not a model directory (no config.json in it) nor a lab run (no step-N "
                             "checkpoints in it)")
    return str(path.resolve())


def _no_tokenizer(name: str, source: str, err: Exception) -> str:
    """One line for a model whose tokenizer does not load: a local folder says what it lacks (its weights too)."""
    folder = Path(source)
    if not folder.is_dir():
        return f"cannot load the tokenizer of '{name}': {(str(err).splitlines() or [type(err).__name__])[0]}"
    weights = any(folder.glob("*.safetensors")) or any(folder.glob("*.gguf"))
    return (f"'{name}' holds a config.json but no tokenizer transformers can read"
            f"{'' if weights else ' and no weights (no .safetensors file)'}: a model folder holds its config, its "
            "safetensors weights and its tokenizer's files (tokenizer.json or tokenizer_config.json)")


def _resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        dtype = settings.active().dtype  # ATTNVIZ_DTYPE: the app's and the CLI's default, like ATTNVIZ_DEVICE
    if dtype in (None, "auto"):
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
                "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}[dtype]
    except KeyError:
        raise ModelLoadError(f"unknown dtype '{dtype}'; use float32, float16 or bfloat16") from None


def load(model: str = DEFAULT, dtype: str | torch.dtype | None = None, device: str | None = None,
         device_map: str | dict | None = None, trust_remote_code: bool = False,
         progress: Progress | None = None, offload_folder: str | Path | None = None) -> LoadedModel:
    """Load ``"default"``, a Hugging Face id or a local directory as a :class:`LoadedModel`.

    Device defaults to the settings' ``device`` when set (``ATTNVIZ_DEVICE`` for the CLI and the app:
    :mod:`attnviz.settings`), else CUDA when present (:func:`devices.default_device`), and the dtype to the
    settings' ``dtype`` when set, else bfloat16 there and float32 on the CPU (statistics are
    float32 on either, docs/methods.md#devices). ``device_map`` ("auto", "balanced", ... or a dict of module → device)
    loads through accelerate across GPUs, the CPU and disk (``"disk"`` entries are offloaded to
    ``offload_folder``, by default a folder of the cache directory); attnviz keeps each layer's state
    on that layer's own device. ``trust_remote_code`` stays off unless asked for.
    """
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSeq2SeqLM,
        AutoTokenizer,
    )
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    from attnviz.core.engine import KEY, prepare

    progress = progress or (lambda message: None)
    started = time.perf_counter()
    if device_map in ("", "none"):
        device_map = None
    if device_map is not None and device is not None:
        raise ModelLoadError("give either a device or a device map, not both")
    device = devices.available(device or devices.default_device())
    # a mapped model's dtype follows where the map puts it: float32 on the CPU and disk, even on a GPU machine
    torch_dtype = _resolve_dtype(dtype, devices.mapped_device(device_map) if device_map else device)
    if not isinstance(model, str) or not model.strip():
        raise InputError(f"a model is named by a string: 'default', a Hugging Face id or a local directory, not "
                         f"{model!r}")
    name = model.strip()
    model_file, revision = None, None
    if name in SHIPPED:
        shipped = SHIPPED[name]
        source = str(converted(shipped, progress))
        model_file = str(shipped_gguf(shipped))
        local = True
    else:
        source, local = local_directory(name), True
        if source is None:
            (source, revision), local = hub_revision(name), False

    progress(f"Loading {name}")
    if not local and not hub_reachable():
        raise ModelLoadError(
            f"cannot find model '{name}': it is not a local model directory, and the Hugging Face Hub cannot be "
            "reached from this machine — use 'default' or a local path"
        )
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, revision=revision)
    except OSError as err:
        from huggingface_hub import constants as hf_constants

        offline = bool(hf_constants.HF_HUB_OFFLINE)
        raise ModelLoadError(
            f"cannot find model '{name}': not a local model directory, and the Hugging Face Hub "
            f"{'is switched off (HF_HUB_OFFLINE=1)' if offline else 'does not have it or cannot be reached'}"
            " — use 'default' or a local path"
        ) from err
    except ValueError as err:
        raise ModelLoadError(f"cannot load '{name}': {str(err).splitlines()[0]}") from err
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    known = MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES if seq2seq else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if config.model_type not in known:
        reason = "an encoder-decoder without a generation head" if seq2seq else "not a decoder language model (causal LM)"
        raise ModelLoadError(f"'{name}' is a {config.model_type} model, {reason}")
    auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    model_class = auto._model_mapping.get(type(config), None) if not trust_remote_code else None
    full = config.model_type == "qwen3_next" and set(getattr(config, "layer_types", None) or ()) == {"full_attention"}
    if model_class is not None and not full and not (model_class._can_set_attn_implementation() if seq2seq
                                                     else getattr(model_class, "_supports_attention_backend", False)):
        raise ModelLoadError(
            f"{model_class.__name__} ({config.model_type}) computes attention in its own code, not through "
            "transformers' AttentionInterface, so attnviz cannot change or record its masks"
        )
    if local and name not in SHIPPED:
        check_folder(Path(source), name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, revision=revision)
    except (OSError, ValueError) as err:
        raise ModelLoadError(_no_tokenizer(name, source, err)) from err
    try:
        kwargs = dict(dtype=torch_dtype, trust_remote_code=trust_remote_code, use_safetensors=True,
                      attn_implementation=KEY, revision=revision)
        if device_map:
            kwargs["device_map"] = device_map
            folder = Path(offload_folder) if offload_folder else cache_dir() / "offload" / Path(source).name
            kwargs["offload_folder"] = str(folder)
        lm = auto.from_pretrained(source, **kwargs)
    except OSError as err:
        raise ModelLoadError(
            f"cannot load weights of '{name}': {str(err).splitlines()[0]} (attnviz loads only safetensors or GGUF)"
        ) from err
    except (ValueError, KeyError, RuntimeError) as err:
        if device_map is None:
            raise
        raise ModelLoadError(f"cannot load '{name}' with device map {device_map!r}: "
                             f"{(str(err).splitlines() or [type(err).__name__])[0]}") from err
    if not device_map:
        lm = lm.to(device)
    lm.eval()
    prepare(lm)
    variant = None
    if Path(source).is_dir() and not seq2seq:
        from attnviz.core.engine.residual import Variant

        variant = Variant.load(Path(source))
        if variant is not None:
            variant = variant.to(lm.device)
    return LoadedModel(lm, tokenizer, SHIPPED[name].name if name in SHIPPED else name, model_file,
                       time.perf_counter() - started, residual=variant)
