"""Errors that reach a user as one clear line (CLI stderr, `st.error` in the app)."""


class AttnvizError(Exception):
    """Base class: the message says what was wrong and what to change."""


class MaskError(AttnvizError):
    """A mask that cannot be built or would leave a query with nothing to attend to."""


class ArchitectureError(AttnvizError):
    """A malformed architecture string or one that does not fit the model."""


class ModelLoadError(AttnvizError):
    """A model that cannot be found, loaded, or captured."""


class InputError(AttnvizError):
    """Text that cannot be captured (empty, too long)."""


class Diverged(InputError):
    """A training run whose loss or weights stopped being finite: ``step`` the step it was seen at, ``kept`` the last
    checkpoint written (every one written is finite; docs/lab.md#what-a-run-folder-holds-and-how-it-is-checked)."""

    def __init__(self, message: str, step: int, kept):
        super().__init__(message)
        self.step, self.kept = step, kept
