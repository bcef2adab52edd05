"""Where compiled kernels outlive the process: Triton's cache, inductor's, the FA2 tuning.

One directory holds ``triton/`` (``TRITON_CACHE_DIR``), ``inductor/``
(``TORCHINDUCTOR_CACHE_DIR``, used only if something calls ``torch.compile``) and
``fa2_prefill_tuning.json`` (the prefill kernel's tuned configs). Which directory:
argument (``--compile-cache-dir``) > ``SIGHTLINE_COMPILE_CACHE_DIR`` > the user's cache
directory (``$XDG_CACHE_HOME`` or ``~/.cache``) ``/sightline/compile``. A ``TRITON_CACHE_DIR``
or ``TORCHINDUCTOR_CACHE_DIR`` set by the user wins over the default only.

Guarantee: ``apply`` sets the variables in ``os.environ`` before any kernel compiles
(Triton reads ``TRITON_CACHE_DIR`` at each compile, so a process that imported Triton
earlier still writes here). Cost: a ``mkdir`` and a directory listing at start-up.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["CompileCache", "ENV_COMPILE_CACHE_DIR", "default_compile_cache_dir",
           "resolve_compile_cache"]

log = logging.getLogger(__name__)

ENV_COMPILE_CACHE_DIR = "SIGHTLINE_COMPILE_CACHE_DIR"
TUNING_FILE = "fa2_prefill_tuning.json"


def default_compile_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/sightline/compile``, else ``~/.cache/sightline/compile``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sightline" / "compile"


@dataclass(frozen=True)
class CompileCache:
    """The directories in use and where the choice came from."""

    root: Path
    triton_dir: Path
    inductor_dir: Path
    source: Literal["argument", "environment", "default"]

    @property
    def tuning_file(self) -> Path:
        return self.root / TUNING_FILE

    def triton_entries(self) -> int:
        """Kernel binaries in Triton's cache (one directory each); 0 when it is absent."""
        try:
            return sum(1 for entry in os.scandir(self.triton_dir) if entry.is_dir())
        except OSError:
            return 0

    def apply(self) -> bool:
        """Creates the directories and points Triton and inductor at them (``os.environ``).
        A directory that cannot be created is an error when it was the argument; otherwise
        it is logged and the compilers keep their own defaults (False)."""
        try:
            for directory in (self.root, self.triton_dir, self.inductor_dir):
                directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if self.source == "argument":
                raise ValueError(f"compile cache directory {str(self.root)!r} cannot be "
                                 f"created: {exc}") from None
            log.warning("compile cache %s unusable (%s); kernels are compiled into the "
                        "compilers' own default caches", self.root, exc)
            return False
        os.environ["TRITON_CACHE_DIR"] = str(self.triton_dir)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.inductor_dir)
        return True


def resolve_compile_cache(path: str | os.PathLike | None = None) -> CompileCache:
    """The cache for ``path`` (the argument), else the environment's, else the default."""
    if path is not None and str(path) != "":
        root, source = Path(path).expanduser(), "argument"
    elif os.environ.get(ENV_COMPILE_CACHE_DIR):
        root, source = Path(os.environ[ENV_COMPILE_CACHE_DIR]).expanduser(), "environment"
    else:
        root, source = default_compile_cache_dir(), "default"
    triton_dir, inductor_dir = root / "triton", root / "inductor"
    if source == "default":   # a variable the user set themselves beats the default layout
        triton_dir = Path(os.environ.get("TRITON_CACHE_DIR") or triton_dir)
        inductor_dir = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or inductor_dir)
    return CompileCache(root.resolve(), triton_dir.resolve(), inductor_dir.resolve(), source)
