"""Where each telemetry level's engine spends its CPU under load: py-spy stacks (a diagnosis).

    python -m bench.profile_levels --levels steps,kernels --out <dir>

Starts one engine per level (bench/overhead_http.py's flags) and a collector, sends bursts
of streamed completions to each engine in turn from a separate process, and meanwhile
records every engine with ``py-spy record --threads --nonblocking`` (raw collapsed stacks,
one file per level). ``--top`` prints the functions with the most samples on the engine's
step thread per level, self time and total, so that two levels can be compared. With
``--gil`` only the thread holding the GIL is sampled: the share of each thread then says who
keeps the engine's step thread waiting, and what it runs meanwhile.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from .overhead_http import cpu_plan, load, serving


def gil_holders(raw: Path, n: int) -> list[str]:
    """Per thread (its frame in the stacks): its share of the GIL-holding samples and its
    ``n`` most frequent innermost frames."""
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = next((f for f in frames if f.startswith("thread")), frames[0])
        threads[thread][re.sub(r":\d+\)$", ")", frames[-1])] += int(count)
    samples = sum(sum(c.values()) for c in threads.values()) or 1
    out = []
    for thread, frames in sorted(threads.items(), key=lambda t: -sum(t[1].values())):
        out.append(f"{100 * sum(frames.values()) / samples:5.1f} % of GIL samples: {thread}")
        out += [f"      {100 * c / samples:5.2f} %  {f}" for f, c in frames.most_common(n)]
    return out


def top_functions(raw: Path, n: int) -> list[str]:
    """The ``n`` frames with the most samples (total) on threads whose stacks pass through
    the engine's step, with their self samples."""
    total, own, samples = collections.Counter(), collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "step (" not in stack and "step(" not in stack:
            continue
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]   # per function
        samples += int(count)
        for frame in set(frames):
            total[frame] += int(count)
        own[frames[-1]] += int(count)
    return [f"{100 * c / max(samples, 1):5.1f} % total {100 * own[f] / max(samples, 1):5.1f} % self  {f}"
            for f, c in total.most_common(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--levels", default="steps,kernels")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--engine-args", nargs="*", default=[])
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--gil", action="store_true", help="sample only the thread holding the GIL")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    levels = args.levels.split(",")
    # pinned as bench.overhead_http pins them: each engine (and its telemetry process) on CPUs
    # of its own, so that the stacks are those of the measured runs
    plan = cpu_plan(levels, sorted(os.sched_getaffinity(0)))
    cpus = plan["load"] if plan else None
    with serving(args, levels, plan) as engines:
        urls = [url for _, url in engines.values()]
        pids = [engine.pid for engine, _ in engines.values()]
        load(args, urls, pids, 1, seed=999, cpus=cpus)        # warm-up
        args.out.mkdir(parents=True, exist_ok=True)
        spies = {level: subprocess.Popen(["py-spy", "record", "-p", str(engine.pid), "-d",
                                          str(int(args.duration_s)), "-r", "200", "--threads",
                                          "--nonblocking", *(["--gil"] if args.gil else []),
                                          "-f", "raw", "-o",
                                          str(args.out / f"pyspy-{level}.txt")],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for level, (engine, _) in engines.items()}
        deadline = time.monotonic() + args.duration_s
        while time.monotonic() < deadline:
            load(args, urls, pids, 2, seed=int(time.time()), cpus=cpus)
        for level, spy in spies.items():
            _, err = spy.communicate(timeout=60)
            if spy.returncode:
                print(f"{level}: py-spy failed: {err.decode()[-500:]}")
    for level in levels:
        raw = args.out / f"pyspy-{level}.txt"
        if raw.exists():
            if args.gil:
                print(f"== {level}: threads holding the GIL")
                print("\n".join(gil_holders(raw, 8)))
            else:
                print(f"== {level}: engine step thread, top {args.top}")
                print("\n".join(top_functions(raw, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
