"""Screenshots of pages (the heatmap page) in headless Chromium (Debian's ``chromium``).

One ``chromium --headless --screenshot`` process per page, with a fresh profile that is
deleted afterwards, no network beyond the page's own URL (background networking, component
updates, sync and QUIC off) and a virtual-time budget so the page's scripts finish drawing
before the capture. Cost: one browser start, ~1-3 s.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["CHROMIUM_FLAGS", "chromium_binary", "screenshot"]

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(url: str, path: Path, width: int = 1280, height: int = 1000,
               timeout_s: float = 60.0) -> Path:
    """Writes a PNG of ``url`` to ``path``; raises RuntimeError (with Chromium's output)
    when no PNG came out."""
    if not (100 <= width <= 8000 and 100 <= height <= 8000):
        raise ValueError(f"window {width}x{height} must be within 100..8000 px each way")
    binary = chromium_binary()
    if binary is None:
        raise RuntimeError("chromium is not installed (Debian package; scripts/setup.sh installs it)")
    path = Path(path)
    path.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="sightline-chromium-") as profile:
        result = subprocess.run(
            [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--hide-scrollbars",
             f"--window-size={width},{height}", "--virtual-time-budget=5000", f"--screenshot={path}", url],
            capture_output=True, text=True, timeout=timeout_s)
    if not path.is_file() or path.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
        raise RuntimeError(f"chromium wrote no screenshot of {url} (exit {result.returncode}): "
                           f"{(result.stderr or result.stdout)[-800:]}")
    return path
