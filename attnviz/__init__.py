"""attnviz: see what a real language model attends to, under any attention mask, layer by layer.

Flow: text → tokens → :func:`capture` (a :class:`Recipe`: model, architecture, intervention, …;
a :class:`Keep`: what to keep) →
:class:`Capture` → metrics → figures → pages. The library never imports Streamlit.

Every name below is imported when first used, so ``import attnviz`` and ``attnviz --help`` stay fast
(no torch compiler stack, no transformers modelling code until a model is asked for). Importing it registers, once
transformers' modeling code is imported, the attention implementations a lab checkpoint of a kind transformers does
not compute names in its config, so a plain ``from_pretrained`` computes that kind (docs/lab.md#plain-transformers).
"""

from __future__ import annotations

import importlib
import sys
import types

from attnviz.core.loading import plain as _plain

_plain.watch()

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "Architecture": "core.spec.arch", "parse": "core.spec.arch",
    "Capture": "capture", "capture": "capture", "prepare": "capture",
    "AttnvizError": "errors", "ArchitectureError": "errors", "InputError": "errors", "MaskError": "errors",
    "ModelLoadError": "errors",
    "LoadedModel": "core.loading.models", "load": "core.loading.models",
    "Recipe": "recipe", "Keep": "plan", "Budget": "plan",
    "explain": "effects.explain",
    "show": "viewer.widget", "show_compare": "viewer.widget", "save_html": "viewer.static",
    "from_attention": "viewer.tensors",
}


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'attnviz' has no attribute {name!r}")


class _Package(types.ModuleType):
    """``attnviz.capture`` is the function, as it always was, even once the module of the same name has
    been imported (the import system then binds the package attribute to the module)."""

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name and hasattr(value, name):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = ["show", "show_compare", "save_html", "from_attention", "explain", "Architecture", "parse", "Capture", "capture",
           "prepare", "load", "LoadedModel", "Recipe", "Keep", "Budget",
           "AttnvizError", "ArchitectureError", "InputError", "MaskError", "ModelLoadError", "__version__"]
