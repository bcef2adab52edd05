"""Run metadata every bench result carries: the git commit, the UTC time, the device's name.

Imported by the scripts in this folder, which run as ``python bench/<name>.py`` (this
folder is then ``sys.path[0]``) or are imported as ``bench.<name>``; stdlib only, so a
script that needs no torch does not load it. Each call costs at most one or two ``git``
subprocesses.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Sequence

__all__ = ["ROOT", "device_name", "git_commit", "utc_now"]

ROOT = Path(__file__).resolve().parent.parent


def git_commit(*, short: bool = False, dirty_paths: Sequence[str] = ()) -> str:
    """HEAD of the checkout this file is in, or ``$SIGHTLINE_COMMIT`` when set, else "unknown".

    The environment variable wins because the device machine gets a copy of the working
    tree without ``.git``. With ``dirty_paths``, "-dirty" is appended when any of them
    (paths relative to the repository root) has uncommitted changes.
    """
    env = os.environ.get("SIGHTLINE_COMMIT")
    if env:
        return env
    try:
        commit = subprocess.run(["git", "rev-parse", *(["--short"] if short else []), "HEAD"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.strip()
        if dirty_paths:
            dirty = subprocess.run(["git", "status", "--porcelain", "--", *dirty_paths], cwd=ROOT,
                                   capture_output=True, text=True).stdout.strip()
            commit += "-dirty" if dirty else ""
        return commit
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def utc_now() -> str:
    """The current UTC time as ``2026-11-30T01:02:03Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def device_name(device: object, *, cpu_fallback: str | None = None) -> str:
    """The CUDA device's name when ``device`` (a str or torch.device) is not the CPU and CUDA
    is present; otherwise the host processor, or ``cpu_fallback`` (default: the machine
    type) where the platform does not name it. Imports torch only when called.
    """
    import torch

    kind = str(device)
    if kind != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(kind) if kind.startswith("cuda") else 0)
    return platform.processor() or (cpu_fallback if cpu_fallback is not None else platform.machine())
