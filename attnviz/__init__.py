"""attnviz: see what a real language model attends to, under any attention mask, layer by layer.

Flow: text → tokens → :func:`capture` (model, architecture) → :class:`Capture` → :mod:`metrics`
→ figures → pages. The library never imports Streamlit.
"""

__version__ = "0.1.0"

from .arch import Architecture, parse  # noqa: E402
from .capture import Capture, capture  # noqa: E402
from .errors import ArchitectureError, AttnvizError, InputError, MaskError, ModelLoadError  # noqa: E402
from .models import LoadedModel, load  # noqa: E402



def __getattr__(name):  # the notebook viewer imports anywidget only when asked for
    if name in ("show", "show_compare"):
        from .viewer import widget

        return getattr(widget, name)
    raise AttributeError(f"module 'attnviz' has no attribute {name!r}")


__all__ = ["show", "show_compare", "Architecture", "parse", "Capture", "capture", "load", "LoadedModel", "AttnvizError",
           "ArchitectureError", "InputError", "MaskError", "ModelLoadError", "__version__"]
