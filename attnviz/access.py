"""What a shared server lets its visitors read, write and load (docs/sharing.md).

A server shared with a lab must not hand its file system to everyone who reaches the port. In shared
mode every path typed in a browser goes through one :class:`Access`:

- **reads** (model directories, text files, results folders) must resolve, after ``~``, ``..`` and every
  symlink, inside one of the roots (``ATTNVIZ_ROOTS``, colon-separated; default: attnviz's cache
  directory);
- **writes** (a sweep's results) must resolve inside the write root (``ATTNVIZ_WRITE_ROOT``; default the
  cache directory); nothing is created outside it, not even a parent folder;
- **models** load by name only when they are in ``ATTNVIZ_MODELS`` (comma-separated; default the shipped
  offline models, ``default,gemma3-270m``), or when they are a directory under a root;
- **remote code** runs only where the server's own configuration allows it
  (``ATTNVIZ_TRUST_REMOTE_CODE=1``): a visitor cannot turn it on.

Outside shared mode (a server on the loopback, one researcher) every check passes, as before. Each
refusal is one :class:`~attnviz.errors.InputError` line that says what is allowed, and is raised
before anything is read, listed or created. This module knows nothing of Streamlit: the app decides
when the mode is on (``ui/shared.py``) and shows the refusals.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from attnviz import settings
from attnviz.errors import InputError
from attnviz.settings import Settings

LOOPBACK = ("localhost", "127.0.0.1", "::1")


def is_shared(address: str | None, given: Settings | None = None) -> bool:
    """Shared mode: the settings' ``shared`` (``ATTNVIZ_SHARED=1``; None: the active settings), or a server address
    beyond the loopback (an empty address listens on every interface)."""
    flag = (given or settings.active()).shared
    if flag is not None:
        return flag
    return (address or "").strip() not in LOOPBACK


def _resolved(path: str | Path) -> Path:
    return Path(os.path.expanduser(str(path))).resolve(strict=False)


def _inside(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


@dataclass(frozen=True)
class Access:
    shared: bool
    roots: tuple[Path, ...] = ()
    write_root: Path | None = None
    models: tuple[str, ...] = ("default",)
    trust_remote_code: bool = False  # the server's own setting; in shared mode the visitor has none

    @classmethod
    def of(cls, shared: bool, given: Settings | None = None) -> "Access":
        """The rules of the settings ``given`` (None: the active ones: ``ATTNVIZ_ROOTS``, ``ATTNVIZ_WRITE_ROOT``,
        ``ATTNVIZ_MODELS``, ``ATTNVIZ_TRUST_REMOTE_CODE`` for the app)."""
        from attnviz.core.loading.models import SHIPPED, cache_dir

        given = given or settings.active()
        cache = cache_dir()
        roots = tuple(_resolved(p) for p in given.roots) or (_resolved(cache),)
        write_root = _resolved(given.write_root or cache)
        # the shipped offline models by default: they download nothing and run no code of their own
        models = given.models or tuple(SHIPPED)
        return cls(shared, roots, write_root, models, given.trust_remote_code)

    @classmethod
    def from_env(cls, shared: bool, environ=None) -> "Access":
        """:meth:`of` the settings read from ``environ`` (None: this process's environment)."""
        return cls.of(shared, Settings.from_environment(environ))

    def _where(self) -> str:
        return ", ".join(str(r) for r in self.roots)

    def readable(self, path: str | Path, what: str = "path") -> Path:
        """``path`` resolved, if a visitor may read it; else one line saying where they may."""
        if not str(path).strip():
            raise InputError(f"the {what} is empty")
        resolved = _resolved(path)
        if self.shared and not any(_inside(resolved, root) for root in self.roots):
            raise InputError(f"this shared server reads only under {self._where()}: the {what} '{path}' is outside "
                             "(after symlinks and '..'); nothing was read")
        return resolved

    def writable(self, path: str | Path, what: str = "folder") -> Path:
        """``path`` resolved, if a visitor may write there; else one line saying where they may."""
        if not str(path).strip():
            raise InputError(f"the {what} is empty")
        resolved = _resolved(path)
        if self.shared and not _inside(resolved, self.write_root):
            raise InputError(f"this shared server writes only under {self.write_root}: the {what} '{path}' is outside "
                             "(after symlinks and '..'); nothing was created")
        return resolved

    def model(self, name: str) -> str:
        """The model name to load, if a visitor may load it: an allowed name, or a directory under a root."""
        name = (name or "").strip() or "default"
        if not self.shared or name in self.models:
            return name
        local = _resolved(name)
        if name.startswith(("/", ".", "~")) or any(_inside(local, root) for root in self.roots):
            self.readable(name, "model directory")  # refused before anything is looked at
            if not local.is_dir():
                raise InputError(f"the model directory '{name}' does not exist")
            return str(local)
        raise InputError(f"this shared server loads only {', '.join(self.models)} and model directories under "
                         f"{self._where()}; '{name}' is neither")

    def remote_code(self, asked: bool) -> bool:
        """Whether a model's own code may run: the visitor's switch alone, or, shared, the server's setting."""
        return self.trust_remote_code if self.shared else bool(asked)
