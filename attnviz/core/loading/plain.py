"""A lab checkpoint under plain transformers (docs/lab.md#plain-transformers): no silent softmax outside attnviz.

A checkpoint of a kind no stock family computes (softpick, sigmoid, relu, ``sink(logit=c)``: Llama with the kind in
``config.attnviz_kind``) names an attention implementation of attnviz's in its ``config.json`` (``attn_implementation``:
``attnviz_softpick``, ``attnviz_sink``, ...; :func:`implementation`, written by :func:`mark`). transformers honours a
saved ``attn_implementation`` and refuses, when the model is built, a name nobody registered: a process that has not
imported attnviz gets ``ValueError: Specified `attn_implementation="attnviz_softpick"` is not supported`` from
``AutoModelForCausalLM.from_pretrained`` instead of a softmax. ``import attnviz`` calls :func:`watch`, which registers
every ``attnviz_<kind>`` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` (:func:`register`) as
soon as transformers' modeling code is imported (at once where it already is), so that the same plain load computes the
trained kind: the engine's attention outside a run, the kind written out (:func:`attnviz.core.spec.kinds.eager`).

Nothing here imports torch or transformers at module level: ``import attnviz`` stays fast.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import sys
from pathlib import Path

PREFIX = "attnviz_"
WATCHED = "transformers.modeling_utils"  # where transformers' AttentionInterface lives


def implementation(kind) -> str | None:
    """The attention implementation a checkpoint trained with ``kind`` names in its config: ``attnviz_<name>`` for
    a kind the engine writes out itself outside a run because no stock family computes it (a row that is not a
    softmax's, ``weighs``; a fixed sink logit), None for a kind transformers computes (the softmax, gpt-oss's learned
    sink, Qwen3-Next's gate), whose checkpoints load plainly as any of their family."""
    from attnviz.core.spec import kinds

    parsed = kinds.parse(kind)
    if kinds.weigher(parsed) is None and not (isinstance(parsed, kinds.Sink) and parsed.logit is not None):
        return None
    return PREFIX + parsed.name


def mark(folder, config) -> str | None:
    """Write into ``folder``'s saved ``config.json`` the attention implementation of ``config``'s own kind
    (:func:`implementation`; ``save_pretrained`` never writes one); returns it, or None where none is needed."""
    from attnviz.core.spec import kinds

    name = implementation(kinds.own(config))
    if name is not None:
        path = Path(folder) / "config.json"
        saved = json.loads(path.read_text())
        saved["attn_implementation"] = name
        path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    return name


def _attention(name: str):
    """The function registered as ``name``: the engine's attention, on a model whose own kind is that name's."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        from attnviz.core.engine.attention import attention as engine_attention
        from attnviz.core.spec import kinds
        from attnviz.errors import ModelLoadError

        own = kinds.own(getattr(module, "config", None))
        if PREFIX + own.name != name:
            raise ModelLoadError(f"the config names the attention implementation {name}, but its own kind is "
                                 f"{own.spec} (config.attnviz_kind): the checkpoint's config was edited by hand")
        return engine_attention(module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = attention.__qualname__ = name
    return attention


def _mask(*args, **kwargs):
    from attnviz.core.engine.attention import mask_builder

    return mask_builder(*args, **kwargs)


def register() -> None:
    """Register ``attnviz_<kind>`` for every kind with transformers' attention and mask interfaces."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    from attnviz.core.spec import kinds

    for kind in kinds.names():
        AttentionInterface.register(PREFIX + kind, _attention(PREFIX + kind))
        AttentionMaskInterface.register(PREFIX + kind, _mask)


class _Then(importlib.abc.Loader):
    """The loader of transformers' modeling code, then :func:`register`; its loader put back once it has run."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        register()

    def __getattr__(self, name):
        return getattr(self.loader, name)


class Watcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when transformers' modeling code is imported, its loader is followed by
    :func:`register`, and the watcher steps out of ``sys.meta_path``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != WATCHED:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Then(spec.loader)
        return spec


def watch() -> None:
    """Register the names now where transformers' modeling code is imported, else when it is (once)."""
    if WATCHED in sys.modules:
        register()
    elif not any(isinstance(f, Watcher) for f in sys.meta_path):
        sys.meta_path.insert(0, Watcher())
