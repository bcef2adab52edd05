"""What the scenario suite plants beside the engine, besides SM neighbours: an HBM-bandwidth
hog on its own stream and a thread that holds the engine process's GIL.

* :class:`HbmHog`: an elementwise kernel that reads a large buffer and writes another, back to
  back on its own stream (at most ``in_flight`` queued: a call that waits for all device work
  waits for that many at most), from a thread of the engine's process. Its CTAs stream memory
  on every SM alike. A kernel, not a driver copy: under 1 GiB copies the live runs' steps
  waited up to 50 ms before their first kernel, as if the copies held up the other launches.
* :class:`GilHog`: a thread that runs a regular-expression search which backtracks on its
  input for ``hold_s`` out of every ``period_s``; C code that keeps the GIL for all of its run
  (tests/instrumentation/test_plants.py checks it): the host stalls, the GPU's work does not.
Guarantee: each ``run`` returns what it did and when (host clock, ns), measured, not assumed
(launches and bytes, or holds and the GIL time they took). Cost: the hog's own work for the
interval; a 2 ms poll of the hog's events (HBM), nothing between holds (GIL).
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass

__all__ = ["GilHog", "HbmHog", "PlantRun"]

_BACKTRACK = re.compile(r"x+y")  # on "x" * n: O(n^2) steps in C, none of them letting go of the GIL


@dataclass(frozen=True)
class PlantRun:
    """One planted interval: when it ran (host clock) and what it measured."""

    start_ns: int
    end_ns: int
    details: dict

    def to_dict(self) -> dict:
        return asdict(self)


class HbmHog:
    """See the module docstring: ``mib`` MiB read and written per launch on ``device``'s own stream."""

    def __init__(self, device, mib: int = 1024, in_flight: int = 2) -> None:
        import torch

        if not 1 <= mib <= 65536 or not 1 <= in_flight <= 16:
            raise ValueError(f"mib={mib} must be in [1, 65536] and in_flight={in_flight} in [1, 16]")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"device {self.device}: the HBM hog needs CUDA")
        self.in_flight = in_flight
        n = mib << 20
        self.src = torch.empty(n, dtype=torch.uint8, device=self.device)
        self.dst = torch.empty_like(self.src)
        # normal priority: it competes for memory, not for the scheduler's favour
        self.stream = torch.cuda.Stream(self.device)

    def run(self, duration_s: float) -> PlantRun:
        import torch

        start = time.time_ns()
        deadline = start + int(duration_s * 1e9)
        done: list = []
        launches = 0
        with torch.cuda.stream(self.stream):
            while time.time_ns() < deadline:
                if len(done) >= self.in_flight:
                    _wait(done[-self.in_flight])
                torch.bitwise_not(self.src, out=self.dst)
                done.append(torch.cuda.Event())
                done[-1].record(self.stream)
                launches += 1
            if done:
                _wait(done[-1])
        end = time.time_ns()
        moved = 2 * launches * self.src.numel()  # read + written
        return PlantRun(start, end, {"launches": launches, "bytes": moved,
                                     "tb_per_s": moved / max(1, end - start) / 1e3})


class GilHog:
    """See the module docstring. ``calibrate`` finds the input that holds the GIL ``hold_s``."""

    def __init__(self, hold_s: float = 0.03, period_s: float = 0.05) -> None:
        if not 0 < hold_s <= period_s <= 10:
            raise ValueError(f"need 0 < hold_s={hold_s} <= period_s={period_s} <= 10")
        self.hold_s, self.period_s = hold_s, period_s
        self.text = self.calibrate(hold_s)

    @staticmethod
    def _hold(text: str) -> float:
        t0 = time.perf_counter()
        _BACKTRACK.search(text)
        return time.perf_counter() - t0

    @classmethod
    def calibrate(cls, hold_s: float) -> str:
        """The shortest ``"x" * n`` (to a few percent) whose search takes ``hold_s``: n doubles
        until it is long enough, then bisects (the time grows as n squared)."""
        lo, hi = 1, 64
        while cls._hold("x" * hi) < hold_s:
            lo, hi = hi, hi * 2
        while hi - lo > max(16, lo // 50):
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if cls._hold("x" * mid) < hold_s else (lo, mid)
        return "x" * hi

    def run(self, duration_s: float) -> PlantRun:
        start = time.time_ns()
        deadline = start + int(duration_s * 1e9)
        holds, held = 0, 0.0
        while time.time_ns() < deadline:
            held += self._hold(self.text)
            holds += 1
            time.sleep(max(0.0, self.period_s - self.hold_s))
        end = time.time_ns()
        return PlantRun(start, end, {"holds": holds, "held_s": held, "hold_s": self.hold_s,
                                     "period_s": self.period_s, "held_share": held / max(1e-9, (end - start) / 1e9)})


def _wait(event) -> None:
    # polls: Event.synchronize() spins or blocks on a device-wide primitive, while a poll
    # leaves the host and the device to the engine between checks
    while not event.query():
        time.sleep(0.002)
