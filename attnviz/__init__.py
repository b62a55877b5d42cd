"""attnviz: see what a real language model attends to, under any attention mask, layer by layer.

Flow: text → tokens → :func:`capture` (model, architecture) → :class:`Capture` → :mod:`metrics`
→ figures → pages. The library never imports Streamlit.
"""

__version__ = "0.1.0"

from .arch import Architecture, parse  # noqa: E402
from .capture import Capture, capture  # noqa: E402
from .errors import ArchitectureError, AttnvizError, InputError, MaskError, ModelLoadError  # noqa: E402
from .models import LoadedModel, load  # noqa: E402

__all__ = ["Architecture", "parse", "Capture", "capture", "load", "LoadedModel", "AttnvizError",
           "ArchitectureError", "InputError", "MaskError", "ModelLoadError", "__version__"]
