"""Collector start-up, cold (empty numba cache) and warm: process start to /healthz and /readyz.

    python -m bench.collector_start --rounds 3 --out bench/results/collector_start-cpu.md

Each round starts ``sightline collector run`` on free loopback ports with
``NUMBA_CACHE_DIR`` set to a fresh directory (cold), stops it, then starts it again on the
same directory (warm). Both endpoints are polled every 20 ms from the moment the process
is spawned; a round records the seconds to the first 200 of each. Prints (and with
``--out`` writes) the median and every round. Cost: a cold round is one full compile of
the collector's byte walks (tens of seconds on a busy 2-core machine).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from ._common import git_commit, utc_now, write_report

__all__ = ["time_start"]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, OSError):
        return 0


def time_start(cache_dir: Path, timeout_s: float = 180.0) -> dict[str, float]:
    """Seconds from spawn to /healthz 200 and to /readyz 200 of one collector process."""
    from sightline.deploy.processes import free_ports

    grpc, http, zipkin, query = free_ports(4)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    argv = [sys.executable, "-m", "sightline.deploy.cli", "collector", "run", "--log-level", "WARNING",
            "--otlp-grpc", f"127.0.0.1:{grpc}", "--otlp-http", f"127.0.0.1:{http}",
            "--zipkin", f"127.0.0.1:{zipkin}", "--http", f"127.0.0.1:{query}"]
    began = time.monotonic()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
    times: dict[str, float] = {}
    try:
        while len(times) < 2:
            if process.poll() is not None:
                raise RuntimeError(f"collector exited with {process.returncode}")
            if time.monotonic() - began > timeout_s:
                raise TimeoutError(f"collector not ready within {timeout_s} s: {times}")
            for name in ("healthz", "readyz"):
                if name not in times and _status(f"http://127.0.0.1:{query}/{name}") == 200:
                    times[name] = time.monotonic() - began
            time.sleep(0.02)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here (suffix .md)")
    args = parser.parse_args(argv)
    rounds: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="sightline-numba-") as cache:
            for kind in ("cold", "warm"):
                rounds[kind].append(time_start(Path(cache)))
                print(f"round {i + 1} {kind}: {rounds[kind][-1]}", file=sys.stderr)
    lines = [f"# Collector start-up at {git_commit(short=True)} ({utc_now()})", "",
             "| numba cache | /healthz 200 (s, median) | /readyz 200 (s, median) | rounds (healthz / readyz) |",
             "|---|---|---|---|"]
    for kind, runs in rounds.items():
        health = statistics.median(r["healthz"] for r in runs)
        ready = statistics.median(r["readyz"] for r in runs)
        each = ", ".join(f"{r['healthz']:.2f} / {r['readyz']:.2f}" for r in runs)
        lines.append(f"| {kind} | {health:.2f} | {ready:.2f} | {each} |")
    if args.out is not None:
        write_report(args.out, "collector_start", argv, lines)
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
