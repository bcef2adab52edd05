"""Runs a script under the Triton CPU interpreter in a subprocess and returns its results.

TRITON_INTERPRET must be set before triton is imported, so kernel tests run their cases in
one child process (cwd: the repository root) that prints ``RESULTS<json>`` as its last word.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_interpreted(script: str, timeout_s: float = 240) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS")][-1]
    return json.loads(line[len("RESULTS"):])
