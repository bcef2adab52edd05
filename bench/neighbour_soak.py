"""Soaks the noisy neighbour alone: every SM held, in short slices, for a set time, and says
whether the GPU ran it to the end or raised (a CUDA error ends the process's context, so run
each soak in its own process).

    python -m bench.neighbour_soak --seconds 60 --slice-s 0.01 --out soak.json
    python -m bench.neighbour_soak --module old/noisy_neighbour.py   # an earlier kernel

Why: a loop of tensor-core dots that ends on a timer must end for a whole warp group at once.
Short slices on every SM make many loop ends per second, so a kernel that lets warps disagree
meets it within a minute. Cost: the whole GPU for ``--seconds``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path


def _neighbour_module(path: str | None):
    if path is None:
        from . import noisy_neighbour
        return noisy_neighbour
    spec = importlib.util.spec_from_file_location("neighbour_under_soak", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def soak(seconds: float, slice_s: float, module_path: str | None) -> dict:
    """Runs the neighbour in rounds of up to 60 s; returns slices run, time and the error."""
    import torch

    nn = _neighbour_module(module_path)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    round_s = min(60.0, seconds)
    neighbour = nn.NoisyNeighbour(nn.NeighbourConfig(tuple(range(num_sms)), slice_s=slice_s,
                                                     max_duration_s=round_s), "cuda")
    slices, held, t0, error = 0, set(), time.monotonic(), None
    try:
        while time.monotonic() - t0 < seconds:
            run = neighbour.run(min(round_s, seconds - (time.monotonic() - t0)))
            slices += run.slices
            held.update(run.sms)
        torch.cuda.synchronize()
    except Exception as exc:  # the result: a CUDA error is what the soak looks for
        error = "".join(traceback.format_exception_only(exc)).strip()
    return {"module": module_path or "bench/noisy_neighbour.py", "seconds": round(time.monotonic() - t0, 1),
            "slice_s": slice_s, "slices": slices, "loop_ends": slices * num_sms,
            "sms_held": len(held), "num_sms": num_sms, "error": error,
            "device": torch.cuda.get_device_name(0)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--slice-s", type=float, default=0.01)
    parser.add_argument("--module", default=None, help="path of another noisy_neighbour.py to soak")
    parser.add_argument("--out", default=None, help="JSON result file")
    args = parser.parse_args(argv)
    result = soak(args.seconds, args.slice_s, args.module)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    raise SystemExit(main())
