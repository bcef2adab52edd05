"""A noisy neighbour for the engine's GPU: Triton kernels that keep a chosen set of SMs busy
with tensor-core work for a set time, each busy CTA recording where and when it ran.

Launched from a thread of the engine's own process on a high-priority stream, as a train of
short slices (``slice_s``): in each slice, the first CTA to land on a target SM spins there
until the slice's deadline, every other CTA leaves after ``linger_us``. Why slices, why
targets and why the shared-memory preference: in comments by the code.
Guarantee: placement is measured, not assumed: each busy CTA writes ``(start, end)``
(``%globaltimer`` ns) at its slice's slot for its ``%smid``; a run reports each SM's share
of the interval it was held. Under ``TRITON_INTERPRET=1`` (``MODE_FAKE``) inline PTX cannot
run: CTAs take fake SM ids (``pid % 8``), busy ones loop a fixed number of times with fake
times, and the host waits out each slice; such runs say ``fake``.
Cost on the GPU: the target SMs partly taken for the interval, non-target SMs one CTA slot
for ``linger_us`` per slice; on the host one launch per slice and an event poll every 2 ms.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["MODE_FAKE", "MODE_HW", "NeighbourConfig", "NeighbourRun", "NoisyNeighbour", "TILE",
           "parse_sms", "reference_sink"]

MODE_HW = 1
MODE_FAKE = 2
TILE = 64
KERNEL_NAME = "sightline_noisy_neighbour"
FAKE_NUM_SMS = 8
CARVEOUTS = ("max_shared", "default")
_IN_FLIGHT = 2  # slices queued on the stream at most: what an implicit device sync may wait for


# Why slices: the first H200 run held one persistent launch for a whole 35 s interval, and
# one engine step blocked until it ended (bench/results/record_incident-analysis.md): a host
# call that waits for all device work then waits for the neighbour. With slices it waits at
# most ``_IN_FLIGHT`` slices. Why targets: each slice is placed anew by the block scheduler;
# CTAs that land off the target set (or on a target already held in this slice) leave, so
# the SMs held stay the same from slice to slice. Their lingering ``linger_us`` first gives
# a busy target SM time to free a slot before the grid has drained.
# Contending for what attention needs: each turn reloads a 64x64 fp16 tile (L1, shared
# memory) and issues two independent tensor-core dots into fp32 accumulators, back to back
# until the deadline; with 8 warps the neighbour issues tensor-core work from two warp groups
# against FA2's one, where an FA2 CTA on an SM without the neighbour shares it with one
# other FA2 CTA.
@triton.jit
def _cta_globaltimer(offs):
    """``%globaltimer`` as one value for the whole CTA: the latest of its threads' reads.
    Each thread reads the timer at its own moment; a loop of tensor-core dots that ended on
    per-thread reads could end for some warps of a warp group one turn before the others,
    and a warp-group MMA issued by part of its group is an illegal instruction on Hopper.
    The reduction (through shared memory, with a barrier) gives every thread the same value."""
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [offs], dtype=tl.int64,
                                  is_pure=False, pack=1)
    return tl.max(t, axis=0)


@triton.jit(do_not_specialize=["slice_index", "deadline_ns", "linger_ns"])
def sightline_noisy_neighbour(occ_ptr, claims_ptr, targets_ptr, tile_ptr, sink_ptr, slice_index,
                              deadline_ns, linger_ns, fake_iters,
                              NUM_SMS: tl.constexpr, TILE: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    if MODE == 1:
        start = _cta_globaltimer(tl.arange(0, TILE))
        smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                         is_pure=True, pack=1)
        smid = tl.minimum(smid, NUM_SMS - 1)
    else:  # MODE_FAKE: the interpreter; values describe no hardware
        start = slice_index.to(tl.int64) * 1_000_000 + pid.to(tl.int64) * 1000
        smid = pid % NUM_SMS
    slot = slice_index * NUM_SMS + smid
    # one atomic per CTA: the first CTA of this slice on a target SM holds it
    first = tl.atomic_add(claims_ptr + slot, 1) == 0
    busy = (tl.load(targets_ptr + smid) != 0) & first
    now = start
    if busy:
        offs = tl.arange(0, TILE)
        tile = tile_ptr + offs[:, None] * TILE + offs[None, :]
        b = tl.load(tile + TILE * TILE)
        acc0 = tl.zeros([TILE, TILE], dtype=tl.float32)
        acc1 = tl.zeros([TILE, TILE], dtype=tl.float32)
        if MODE == 1:
            while now < deadline_ns:
                for _ in tl.static_range(8):
                    a = tl.load(tile)
                    acc0 = tl.dot(a, b, acc0)
                    acc1 = tl.dot(b, a, acc1)
                now = _cta_globaltimer(offs)
        else:
            for _ in range(fake_iters):
                a = tl.load(tile)
                acc0 = tl.dot(a, b, acc0)
                acc1 = tl.dot(b, a, acc1)
            now = start + 500
        tl.store(occ_ptr + slot * 2, start)
        tl.store(occ_ptr + slot * 2 + 1, now)
        tl.store(sink_ptr + smid, tl.sum(acc0 + acc1))  # keeps the dots from being removed
    elif MODE == 1:
        while now < start + linger_ns:
            now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                            is_pure=False, pack=1)


def reference_sink(tile: torch.Tensor, iterations: int) -> torch.Tensor:
    """What a busy CTA's sink holds after ``iterations`` loop turns (the pure-torch oracle)."""
    a, b = tile[0].float(), tile[1].float()
    return ((a @ b) + (b @ a)).sum() * iterations


def parse_sms(text: str, num_sms: int | None = None) -> tuple[int, ...]:
    """``"0:132:4"`` (start:stop:step) or ``"0,4,8"`` as sorted SM ids; ValueError naming it."""
    try:
        if ":" in text:
            sms = range(*(int(x) for x in text.split(":")))
        else:
            sms = [int(x) for x in text.split(",") if x.strip()]
    except (TypeError, ValueError):
        raise ValueError(f"SM set {text!r}: expected START:STOP:STEP or a comma list, e.g. 0:132:4") from None
    out = tuple(sorted(set(sms)))
    if not out or out[0] < 0 or (num_sms is not None and out[-1] >= num_sms):
        raise ValueError(f"SM set {text!r} must be non-empty ids in [0, {num_sms or 1024})")
    return out


@dataclass(frozen=True)
class NeighbourConfig:
    """How the neighbour loads its SMs; ranges checked, errors name the bad value."""

    target_sms: tuple[int, ...]
    warps: int = 8                  # 4 or 8 (12 would leave no room for an FA2 CTA's registers)
    carveout: str = "max_shared"    # the neighbour kernel's shared-memory preference
    slice_s: float = 0.25
    linger_us: float = 50.0
    grid_per_sm: int = 4            # CTAs launched per slice, per SM of the device
    max_duration_s: float = 120.0   # sizes the per-slice record buffer, allocated once

    def __post_init__(self) -> None:
        if self.warps not in (4, 8):
            raise ValueError(f"warps={self.warps} must be 4 or 8")
        if self.carveout not in CARVEOUTS:
            raise ValueError(f"carveout={self.carveout!r} must be one of {'|'.join(CARVEOUTS)}")
        for name, low, high in (("slice_s", 0.01, 10.0), ("linger_us", 0.0, 10_000.0),
                                ("grid_per_sm", 1, 64), ("max_duration_s", 0.0, 3600.0)):
            if not low <= getattr(self, name) <= high:
                raise ValueError(f"{name}={getattr(self, name)} not in [{low}, {high}]")
        if not self.target_sms:
            raise ValueError("target_sms is empty")

    @property
    def max_slices(self) -> int:
        return max(1, math.ceil(self.max_duration_s / self.slice_s))


@dataclass(frozen=True)
class NeighbourRun:
    """One neighbour run: which SMs its busy CTAs held, for what share of the run, and when."""

    target_sms: tuple[int, ...]
    sms: tuple[int, ...]            # SMs held for at least half of the run (measured), sorted
    occupancy: dict[int, float]     # SM -> share of the run it was held (slices, when fake)
    slices: int
    start_ns: int                   # first busy CTA's start (%globaltimer; fake values when fake)
    end_ns: int                     # last busy CTA's end
    host_launch_ns: int             # time.time_ns() just before the first launch
    host_done_ns: int               # time.time_ns() once the host saw the last slice finish
    fake: bool
    warps: int
    carveout: str                   # as set, or why it could not be


class NoisyNeighbour:
    """Launches the neighbour on its own stream of ``device``; ``run`` blocks until done,
    ``start`` runs it in a thread (``join`` returns the :class:`NeighbourRun`)."""

    def __init__(self, config: NeighbourConfig, device: str | torch.device = "cuda") -> None:
        self.config = config
        self.device = torch.device(device)
        self.fake = os.environ.get("TRITON_INTERPRET") == "1"
        if self.device.type != "cuda" and not self.fake:
            raise ValueError(f"device {self.device}: the neighbour needs CUDA (or TRITON_INTERPRET=1)")
        self.num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                        if self.device.type == "cuda" else FAKE_NUM_SMS)
        if config.target_sms[-1] >= self.num_sms or config.target_sms[0] < 0:
            raise ValueError(f"target SMs {config.target_sms} outside [0, {self.num_sms})")
        gen = torch.Generator().manual_seed(0)
        self.tile = (torch.rand(2, TILE, TILE, generator=gen) / TILE).to(torch.float16).to(self.device)
        # Same process, own stream: kernels of two processes on one GPU (without MPS, a device
        # setting this tool must not change) are time-sliced, every SM alternating between them,
        # which would slow all SMs alike. Kernels of one process on two streams run side by side,
        # CTA by CTA; on a non-blocking, high-priority stream the neighbour's CTAs take SMs as
        # soon as resources free up.
        self.stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        # Allocated once: no allocation (or the device-wide wait it may bring) while the engine runs.
        slots = config.max_slices * self.num_sms
        self.occ = torch.full((slots * 2,), -1, dtype=torch.int64, device=self.device)
        self.claims = torch.zeros(slots, dtype=torch.int32, device=self.device)
        targets = torch.zeros(self.num_sms, dtype=torch.int32)
        targets[list(config.target_sms)] = 1
        self.targets = targets.to(self.device)
        self.sink = torch.zeros(self.num_sms, dtype=torch.float32, device=self.device)
        self.carveout = "not yet set"
        self._thread: threading.Thread | None = None
        self._result: NeighbourRun | BaseException | None = None

    def _launch(self, slice_index: int, deadline_ns: int, fake_iters: int) -> None:
        mode = MODE_FAKE if self.fake else MODE_HW
        kernel = sightline_noisy_neighbour[(self.config.grid_per_sm * self.num_sms,)](
            self.occ, self.claims, self.targets, self.tile, self.sink, slice_index, deadline_ns,
            int(self.config.linger_us * 1000), fake_iters, NUM_SMS=self.num_sms, TILE=TILE, MODE=mode,
            num_warps=self.config.warps, num_stages=1)
        if self.carveout == "not yet set":
            self.carveout = _set_carveout(kernel, self.config.carveout)

    def run(self, duration_s: float, fake_iters: int = 2) -> NeighbourRun:
        cfg = self.config
        if not 0 <= duration_s <= cfg.max_duration_s:
            raise ValueError(f"duration_s={duration_s} must be in [0, max_duration_s={cfg.max_duration_s}]")
        slices = max(1, math.ceil(duration_s / cfg.slice_s - 1e-9))
        slice_ns, duration_ns = int(cfg.slice_s * 1e9), int(duration_s * 1e9)
        launch_ns = time.time_ns()
        if self.stream is None:
            self.claims.zero_()
            self.occ.fill_(-1)
            for i in range(slices):
                deadline = launch_ns + min((i + 1) * slice_ns, duration_ns)
                self._launch(i, deadline, fake_iters)
                time.sleep(max(0.0, (deadline - time.time_ns()) / 1e9))  # the slice, on the host
            occ = self.occ[: slices * self.num_sms * 2].clone()
        else:
            done: list[torch.cuda.Event] = []
            with torch.cuda.stream(self.stream):
                self.claims[: slices * self.num_sms].zero_()
                self.occ[: slices * self.num_sms * 2].fill_(-1)
                for i in range(slices):
                    if len(done) >= _IN_FLIGHT:
                        _wait(done[-_IN_FLIGHT])
                    self._launch(i, launch_ns + min((i + 1) * slice_ns, duration_ns), fake_iters)
                    done.append(torch.cuda.Event())
                    done[-1].record(self.stream)
                _wait(done[-1])
                occ = self.occ[: slices * self.num_sms * 2].cpu()
        return self._summarise(occ.view(slices, self.num_sms, 2).numpy(), slices, launch_ns)

    def _summarise(self, occ, slices: int, launch_ns: int) -> NeighbourRun:
        held = occ[:, :, 0] >= 0  # [slice, sm]
        done_ns = time.time_ns()
        if not held.any():  # said by an empty ``sms``; the caller decides what that means
            return NeighbourRun(self.config.target_sms, (), {}, slices, launch_ns, launch_ns, launch_ns, done_ns,
                                self.fake, self.config.warps, self.carveout)
        start, end = int(occ[:, :, 0][held].min()), int(occ[:, :, 1][held].max())
        if self.fake:  # fake times: the share of slices each SM was held in
            share = held.sum(axis=0) / slices
        else:  # the share of the run's span each SM was held, from the CTAs' own times
            share = ((occ[:, :, 1] - occ[:, :, 0]) * held).sum(axis=0) / max(1, end - start)
        occupancy = {sm: round(float(share[sm]), 4) for sm in range(self.num_sms) if share[sm] > 0}
        return NeighbourRun(self.config.target_sms, tuple(sm for sm, s in occupancy.items() if s >= 0.5),
                            occupancy, slices, start, end, launch_ns, done_ns, self.fake,
                            self.config.warps, self.carveout)

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


def _wait(event) -> None:
    while not event.query():  # polls without holding the GIL while the engine runs
        time.sleep(0.002)


def _set_carveout(kernel, carveout: str) -> str:
    """Sets the neighbour kernel's shared-memory preference (``CARVEOUTS``) through libcuda;
    returns it, or why it could not be set. Set every time: instances with the same warps
    share one compiled kernel, so a preference set by one would otherwise stay for the next."""
    # Why: in the first H200 run no FA2 prefill or paged-decode CTA ran on an SM the neighbour
    # held, though the registers and shared memory of one FA2 CTA fit beside it. One
    # explanation to test: an SM's L1/shared split is set for the kernels resident on it; the
    # neighbour (16 KB of shared memory) got the driver's default, smaller than FA2's (Triton
    # asks for the largest for kernels over 48 KB). "max_shared" asks for FA2's split; the
    # recorder's calibration measures whether FA2 CTAs then share the SM.
    function = getattr(kernel, "function", None)
    if function is None:
        return "not set: no CUDA function handle (interpreter)"
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"not set: {exc}"
    handle = ctypes.c_void_p(function)
    # CU_FUNC_CACHE_PREFER_SHARED = 1, _NONE = 0; CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    # = 9, in percent of the maximum (100 = CU_SHAREDMEM_CARVEOUT_MAX_SHARED, -1 = _DEFAULT)
    cache, percent = (1, 100) if carveout == "max_shared" else (0, -1)
    codes = (libcuda.cuFuncSetCacheConfig(handle, ctypes.c_int(cache)),
             libcuda.cuFuncSetAttribute(handle, ctypes.c_int(9), ctypes.c_int(percent)))
    return carveout if codes == (0, 0) else f"not set: CUresult {codes}"
