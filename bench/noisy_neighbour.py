"""A noisy neighbour for the engine's GPU: a persistent Triton kernel whose CTAs occupy a
few SMs for a set time, each recording the SM it ran on.

Launched from a thread of the engine's own process on a high-priority stream, its small CTAs
sit one per SM beside FlashAttention-2 and decode CTAs and contend for their SM's warp
schedulers, tensor cores and L1, so attention slows on exactly those SMs and only there
(why, in comments by the code). Guarantee: placement is measured, not assumed: each CTA
writes ``(%smid, start, end)`` (``%globaltimer`` ns) like the engine's SM probe.
Under ``TRITON_INTERPRET=1`` (``MODE_FAKE``) inline PTX cannot run: CTAs loop a fixed
number of times and write fake SM ids (``pid % 8``) and times, and the host waits out the
duration; such runs say ``fake``.
Cost on the GPU: ``ctas`` SMs partly taken for the interval; on the host one launch and
one event poll every 50 ms from a thread.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["MODE_FAKE", "MODE_HW", "NeighbourRun", "NoisyNeighbour", "TILE"]

MODE_HW = 1
MODE_FAKE = 2
TILE = 64
KERNEL_NAME = "sightline_noisy_neighbour"


# Persistent and small: ``ctas`` CTAs of 4 warps (one per SM sub-partition), ~16 KB of shared
# memory and few registers, so the block scheduler spreads them one per SM (a GPU fills SMs
# breadth first) and FA2 and decode CTAs still fit beside them on those SMs.
# Contending for what attention needs: each iteration reloads a 64x64 fp16 tile (L1 /
# load-store pipe) and issues two independent tensor-core dots into fp32 accumulators, back to
# back until ``%globaltimer`` passes the deadline. A co-resident FA2 CTA then shares its SM's
# warp schedulers, tensor cores and L1 with the neighbour and runs slower; FA2 CTAs on other
# SMs do not.
@triton.jit(do_not_specialize=["deadline_ns"])  # one compile, whatever the deadline's divisibility
def sightline_noisy_neighbour(records_ptr, tile_ptr, sink_ptr, deadline_ns, fake_iters,
                              TILE: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, TILE)
    tile = tile_ptr + offs[:, None] * TILE + offs[None, :]
    b = tl.load(tile + TILE * TILE)
    acc0 = tl.zeros([TILE, TILE], dtype=tl.float32)
    acc1 = tl.zeros([TILE, TILE], dtype=tl.float32)
    if MODE == 1:
        start = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                          is_pure=False, pack=1)
        now = start
        while now < deadline_ns:
            for _ in tl.static_range(8):
                a = tl.load(tile)
                acc0 = tl.dot(a, b, acc0)
                acc1 = tl.dot(b, a, acc1)
            now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                            is_pure=False, pack=1)
        smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                         is_pure=True, pack=1).to(tl.int64)
    else:  # MODE_FAKE: the interpreter; values describe no hardware
        start = pid.to(tl.int64) * 1000
        for _ in range(fake_iters):
            a = tl.load(tile)
            acc0 = tl.dot(a, b, acc0)
            acc1 = tl.dot(b, a, acc1)
        now = start + 500
        smid = (pid % 8).to(tl.int64)
    # Placement is the hardware's choice, so each CTA records where and when it ran.
    tl.store(records_ptr + pid * 3, smid)
    tl.store(records_ptr + pid * 3 + 1, start)
    tl.store(records_ptr + pid * 3 + 2, now)
    tl.store(sink_ptr + pid, tl.sum(acc0 + acc1))  # keeps the dots from being removed


def reference_sink(tile: torch.Tensor, iterations: int) -> torch.Tensor:
    """What one CTA's sink holds after ``iterations`` loop turns (the pure-torch oracle)."""
    a, b = tile[0].float(), tile[1].float()
    return ((a @ b) + (b @ a)).sum() * iterations


@dataclass(frozen=True)
class NeighbourRun:
    """One neighbour launch: where its CTAs ran and when (``%globaltimer`` ns, or fake)."""

    ctas: int
    sms: tuple[int, ...]          # distinct SM ids its CTAs ran on, sorted
    cta_sms: tuple[int, ...]      # per CTA
    start_ns: int                 # first CTA start
    end_ns: int                   # last CTA end
    host_launch_ns: int           # time.time_ns() just before the launch
    host_done_ns: int             # time.time_ns() once the host saw it finish
    fake: bool


class NoisyNeighbour:
    """Launches the neighbour on its own stream of ``device``; ``run`` blocks until done,
    ``start`` runs it in a thread (``join`` returns the :class:`NeighbourRun`)."""

    def __init__(self, ctas: int, device: str | torch.device = "cuda") -> None:
        if not 1 <= ctas <= 4096:
            raise ValueError(f"ctas={ctas} must be in [1, 4096]")
        self.ctas = ctas
        self.device = torch.device(device)
        self.fake = os.environ.get("TRITON_INTERPRET") == "1"
        if self.device.type != "cuda" and not self.fake:
            raise ValueError(f"device {self.device}: the neighbour needs CUDA (or TRITON_INTERPRET=1)")
        gen = torch.Generator().manual_seed(0)
        self.tile = (torch.rand(2, TILE, TILE, generator=gen) / TILE).to(torch.float16).to(self.device)
        # Same process, own stream: kernels of two processes on one GPU (without MPS, a device
        # setting this tool must not change) are time-sliced, every SM alternating between them,
        # which would slow all SMs alike. Kernels of one process on two streams run side by side,
        # CTA by CTA; on a non-blocking, high-priority stream the neighbour's CTAs take SMs as
        # soon as resources free up.
        self.stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        # Allocated once: no allocation (or its synchronization) while the engine runs.
        self.records = torch.full((ctas, 3), -1, dtype=torch.int64, device=self.device)
        self.last_sink = torch.zeros(ctas, dtype=torch.float32, device=self.device)
        self._thread: threading.Thread | None = None
        self._result: NeighbourRun | BaseException | None = None

    def run(self, duration_s: float, fake_iters: int = 2) -> NeighbourRun:
        if not 0 <= duration_s <= 3600:
            raise ValueError(f"duration_s={duration_s} must be in [0, 3600]")
        records, sink = self.records, self.last_sink
        launch_ns = time.time_ns()
        deadline = launch_ns + int(duration_s * 1e9)
        mode = MODE_FAKE if self.fake else MODE_HW
        if self.stream is None:
            sightline_noisy_neighbour[(self.ctas,)](records, self.tile, sink, deadline, fake_iters,
                                                    TILE=TILE, MODE=mode, num_warps=4)
            host = records.cpu()
            time.sleep(max(0.0, (deadline - time.time_ns()) / 1e9))  # the interval, on the host
        else:
            with torch.cuda.stream(self.stream):
                records.fill_(-1)
                sightline_noisy_neighbour[(self.ctas,)](records, self.tile, sink, deadline, fake_iters,
                                                        TILE=TILE, MODE=mode, num_warps=4, num_stages=1)
                done = torch.cuda.Event()
                done.record(self.stream)
            while not done.query():  # polls without holding the GIL while the engine runs
                time.sleep(0.05)
            with torch.cuda.stream(self.stream):
                host = records.cpu()
        done_ns = time.time_ns()
        cta_sms = tuple(int(s) for s in host[:, 0].tolist())
        return NeighbourRun(self.ctas, tuple(sorted(set(cta_sms))), cta_sms, int(host[:, 1].min()),
                            int(host[:, 2].max()), launch_ns, done_ns, self.fake)

    def start(self, duration_s: float) -> None:
        if self._thread is not None:
            raise RuntimeError("the neighbour is already running")

        def target() -> None:
            try:
                self._result = self.run(duration_s)
            except BaseException as exc:  # handed to join()
                self._result = exc

        self._thread = threading.Thread(target=target, name="noisy-neighbour", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float | None = None) -> NeighbourRun:
        if self._thread is None:
            raise RuntimeError("the neighbour was not started")
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the neighbour did not finish within {timeout_s} s")
        self._thread, result, self._result = None, self._result, None
        if isinstance(result, BaseException):
            raise result
        return result
