"""Per-CTA SM probe: which streaming multiprocessor ran each CTA of a Triton kernel, and when.

Device side. A probed kernel takes a ``PROBE: tl.constexpr`` mode, a pointer to the
probe buffer and a slot base, and calls two ``@triton.jit`` helpers::

    t0 = probe_begin(PROBE)                 # first statement of the kernel
    ...
    probe_end(probe_ptr, probe_base + probe_cta_index(), t0, PROBE)   # last statement

``probe_end`` writes one record of three int64 — ``(%smid, start, end)`` with
``%globaltimer`` nanoseconds — at the CTA's own slot, so no atomics are needed. Modes:

* ``PROBE_OFF`` (0): the helpers are not called; the kernel compiles without them.
* ``PROBE_HW`` (1): real ``%smid`` / ``%globaltimer`` via inline PTX (CUDA only).
  Measured on the project's H200: SM ids 0..131, timer steps of 32 ns.
* ``PROBE_FAKE`` (2): for ``TRITON_INTERPRET=1`` only, where inline PTX cannot run.
  Writes FAKE, deterministic values — SM ``slot % 8``, start ``slot * 1000``, end
  ``start + 500 + slot`` — so the interpreter tests can check slot plumbing. These
  records describe no hardware; ``SmProbe`` marks batches from this mode ``fake=True``.

Cost on the device: two timer reads, one SM-id read and one 24-byte store per CTA.

Host side. ``SmProbe`` owns the device buffer and hands out slot ranges per launch
(``reserve``); ``end_step`` snapshots the used slots with one device-side copy on the
launching stream (ordered after the step's kernels, before the next step's) and returns
a ``PendingCtas`` whose ``.wait()`` moves the records to the host (call it off the
request path). ``CtaBatch`` is the typed record of one step's CTAs; ``launch_facts``
and ``CtaHistograms.add`` reduce it with vectorized numpy (no Python loop per CTA; one
per (SM, kernel) group when recording into histograms).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import numpy as np

from .exphist import ExpHistogram

__all__ = [
    "PROBE_FAKE", "PROBE_HW", "PROBE_OFF", "RECORD_WORDS",
    "CtaBatch", "CtaHistograms", "LaunchFacts", "PendingCtas", "SmExemplar", "SmProbe",
    "launch_facts", "probe_begin", "probe_cta_index", "probe_end",
]

PROBE_OFF = 0
PROBE_HW = 1
PROBE_FAKE = 2
RECORD_WORDS = 3  # int64 words per CTA: smid, start_ns, end_ns
_FAKE_NUM_SMS = 8

try:  # the device helpers need Triton; the host-side reduction does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is in the gpu/test extras
    triton = None

if triton is not None:
    @triton.jit
    def probe_cta_index():
        """Linear index of this CTA in its grid (x fastest)."""
        pid0 = tl.program_id(0)
        pid1 = tl.program_id(1)
        pid2 = tl.program_id(2)
        n0 = tl.num_programs(0)
        n1 = tl.num_programs(1)
        return pid0 + n0 * (pid1 + n1 * pid2)

    @triton.jit
    def _globaltimer(MODE: tl.constexpr):
        if MODE == 1:
            t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [],
                                          dtype=tl.int64, is_pure=False, pack=1)
        else:
            t = tl.program_id(0).to(tl.int64) * 0
        return t

    @triton.jit
    def probe_begin(MODE: tl.constexpr):
        """Start timestamp of this CTA (ns of %globaltimer; 0 in fake mode)."""
        return _globaltimer(MODE)

    @triton.jit
    def probe_end(probe_ptr, slot, start, MODE: tl.constexpr):
        """Writes (smid, start, end) at ``probe_ptr[slot * 3 : slot * 3 + 3]``."""
        slot64 = slot.to(tl.int64)
        if MODE == 1:
            end = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [],
                                            dtype=tl.int64, is_pure=False, pack=1)
            smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [],
                                             dtype=tl.int32, is_pure=True, pack=1)
            tl.store(probe_ptr + slot64 * 3, smid.to(tl.int64))
            tl.store(probe_ptr + slot64 * 3 + 1, start)
            tl.store(probe_ptr + slot64 * 3 + 2, end)
        else:  # PROBE_FAKE: interpreter only, values describe no hardware
            fake_start = slot64 * 1000
            tl.store(probe_ptr + slot64 * 3, slot64 % 8)
            tl.store(probe_ptr + slot64 * 3 + 1, fake_start)
            tl.store(probe_ptr + slot64 * 3 + 2, fake_start + 500 + slot64)
else:  # pragma: no cover
    probe_cta_index = probe_begin = probe_end = None


# -- records -----------------------------------------------------------------------

@dataclass(frozen=True)
class CtaBatch:
    """The CTA records of one step (or any group of launches) on one GPU.

    Arrays are per CTA, aligned; ``launch_index[i]`` indexes ``launch_names`` etc.
    ``fake`` marks interpreter records (no hardware behind them)."""

    gpu_id: int
    launch_names: tuple[str, ...]       # per launch: kernel name
    launch_ctas: np.ndarray             # per launch: number of CTAs, int64
    launch_index: np.ndarray            # per CTA: launch it belongs to, int64
    sm_id: np.ndarray                   # per CTA, int64
    start_ns: np.ndarray                # per CTA, int64 (%globaltimer)
    end_ns: np.ndarray                  # per CTA, int64
    fake: bool = False
    trace_id: int = 0                   # the step span the launches belong to (0 = none)
    span_id: int = 0
    idle_ctas: int = 0                  # CTAs that exited without work (not in the arrays)

    @property
    def num_ctas(self) -> int:
        return int(self.sm_id.size)

    @property
    def duration_s(self) -> np.ndarray:
        return (self.end_ns - self.start_ns).astype(np.float64) * 1e-9

    @staticmethod
    def from_records(records: np.ndarray, launches: list[tuple[str, int]], gpu_id: int = 0,
                     fake: bool = False, trace_id: int = 0, span_id: int = 0) -> CtaBatch:
        """``records`` [n, 3] int64 in launch order; ``launches`` [(name, num_ctas)].

        Records with SM id -1 are CTAs that exited without work (e.g. query tiles past
        a short sequence's end); they are dropped and counted in ``idle_ctas``."""
        records = np.asarray(records, dtype=np.int64).reshape(-1, RECORD_WORDS)
        grid_ctas = np.asarray([n for _, n in launches], dtype=np.int64)
        if int(grid_ctas.sum()) != records.shape[0]:
            raise ValueError(f"{records.shape[0]} records for launches totalling "
                             f"{int(grid_ctas.sum())} CTAs")
        launch_index = np.repeat(np.arange(grid_ctas.size, dtype=np.int64), grid_ctas)
        keep = records[:, 0] >= 0
        launch_index = launch_index[keep]
        kept = records[keep]
        return CtaBatch(gpu_id=gpu_id, launch_names=tuple(name for name, _ in launches),
                        launch_ctas=np.bincount(launch_index, minlength=grid_ctas.size),
                        launch_index=launch_index, sm_id=kept[:, 0].copy(),
                        start_ns=kept[:, 1].copy(), end_ns=kept[:, 2].copy(), fake=fake,
                        trace_id=trace_id, span_id=span_id,
                        idle_ctas=int(records.shape[0] - kept.shape[0]))


@dataclass(frozen=True)
class LaunchFacts:
    """Launch-level facts of one probed kernel launch, from its CTA records."""

    kernel_name: str
    ctas: int
    sms_used: int           # distinct SMs that ran at least one CTA
    waves: int              # most CTAs any one SM ran
    slowest_sm: int         # SM that ran the longest CTA
    max_cta_s: float
    median_cta_s: float     # lower median (rank ceil(n/2))
    cta_spread: float       # max / median CTA duration (0 when the median is 0)
    start_ns: int           # earliest CTA start
    end_ns: int             # latest CTA end


def launch_facts(batch: CtaBatch) -> list[LaunchFacts]:
    """Per-launch facts, vectorized over CTAs (one Python step per launch to box results)."""
    n_launch = len(batch.launch_names)
    if n_launch == 0:
        return []
    li = batch.launch_index
    dur = batch.end_ns - batch.start_ns
    # distinct (launch, sm) pairs -> SMs used per launch and CTAs per SM
    pair = li * 4096 + batch.sm_id
    pairs, per_pair = np.unique(pair, return_counts=True)
    pair_launch = pairs // 4096
    sms_used = np.bincount(pair_launch, minlength=n_launch)
    waves = np.zeros(n_launch, dtype=np.int64)
    np.maximum.at(waves, pair_launch, per_pair)
    # sort by (launch, duration): the last of each launch is its slowest CTA
    order = np.lexsort((dur, li))
    ends = np.cumsum(batch.launch_ctas)
    starts = ends - batch.launch_ctas
    has = batch.launch_ctas > 0
    last = order[np.maximum(ends - 1, 0)]
    median = order[starts + np.maximum(batch.launch_ctas - 1, 0) // 2]
    first_start = np.full(n_launch, np.iinfo(np.int64).max)
    np.minimum.at(first_start, li, batch.start_ns)
    last_end = np.full(n_launch, np.iinfo(np.int64).min)
    np.maximum.at(last_end, li, batch.end_ns)
    out = []
    for i in range(n_launch):
        if not has[i]:
            out.append(LaunchFacts(batch.launch_names[i], 0, 0, 0, -1, 0.0, 0.0, 0.0, 0, 0))
            continue
        mx, md = float(dur[last[i]]) * 1e-9, float(dur[median[i]]) * 1e-9
        out.append(LaunchFacts(
            kernel_name=batch.launch_names[i], ctas=int(batch.launch_ctas[i]),
            sms_used=int(sms_used[i]), waves=int(waves[i]),
            slowest_sm=int(batch.sm_id[last[i]]), max_cta_s=mx, median_cta_s=md,
            cta_spread=mx / md if md > 0 else 0.0,
            start_ns=int(first_start[i]), end_ns=int(last_end[i])))
    return out


@dataclass
class SmExemplar:
    """The slowest CTA seen on one (SM, kernel) since the last export."""

    value_s: float
    time_unix_nano: int
    trace_id: int
    span_id: int


@dataclass
class CtaHistograms:
    """Per-(gpu, sm, kernel) exponential histograms of CTA durations (seconds) plus per-key
    exemplars (slowest CTA and its step span); ``take`` returns both and starts afresh
    (delta export), ``snapshot`` copies without resetting.

    Cost: ``add`` is O(n log n) in the batch's CTAs (numpy sort), plus one vectorized
    ``ExpHistogram.record`` per (SM, kernel) group present in the batch. Thread-safe."""

    scale: int = 8
    histograms: dict[tuple[int, int, str], ExpHistogram] = field(default_factory=dict)
    exemplars: dict[tuple[int, int, str], SmExemplar] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, batch: CtaBatch, time_unix_nano: int = 0) -> int:
        """Records every CTA of ``batch``; returns the number of CTAs recorded."""
        if batch.num_ctas == 0:
            return 0
        names = np.asarray(batch.launch_names, dtype=object)
        uniq_names, name_of_launch = np.unique(names, return_inverse=True)
        kernel_idx = name_of_launch.reshape(-1)[batch.launch_index]
        dur = batch.duration_s
        key = kernel_idx.astype(np.int64) * 4096 + batch.sm_id
        order = np.argsort(key, kind="stable")
        key_sorted, dur_sorted = key[order], dur[order]
        cuts = np.flatnonzero(np.diff(key_sorted)) + 1
        bounds = np.concatenate(([0], cuts, [key_sorted.size]))
        with self._lock:
            for a, b in zip(bounds[:-1], bounds[1:]):
                k = int(key_sorted[a])
                hkey = (batch.gpu_id, k % 4096, str(uniq_names[k // 4096]))
                hist = self.histograms.get(hkey)
                if hist is None:
                    hist = self.histograms[hkey] = ExpHistogram(scale=self.scale)
                values = dur_sorted[a:b]
                hist.record(values)
                slowest = float(values.max())
                ex = self.exemplars.get(hkey)
                if ex is None or slowest > ex.value_s:
                    self.exemplars[hkey] = SmExemplar(slowest, time_unix_nano,
                                                      batch.trace_id, batch.span_id)
        return batch.num_ctas

    def snapshot(self) -> dict[tuple[int, int, str], ExpHistogram]:
        """Copies of the cumulative histograms (safe to read while ``add`` runs)."""
        with self._lock:
            return {k: h.copy() for k, h in self.histograms.items()}

    def take(self) -> tuple[dict[tuple[int, int, str], ExpHistogram],
                            dict[tuple[int, int, str], SmExemplar]]:
        """Histograms and exemplars since the last ``take`` (delta), and resets both."""
        with self._lock:
            hists, self.histograms = self.histograms, {}
            exemplars, self.exemplars = self.exemplars, {}
        return hists, exemplars

    def take_exemplars(self) -> dict[tuple[int, int, str], SmExemplar]:
        """The exemplars since the last call; starts a new exemplar interval."""
        with self._lock:
            out, self.exemplars = self.exemplars, {}
        return out


# -- the device buffer ----------------------------------------------------------------

class PendingCtas:
    """One step's records on their way to the host; ``wait()`` returns the ``CtaBatch``."""

    def __init__(self, snapshot, launches: list[tuple[str, int]], gpu_id: int, fake: bool,
                 trace_id: int, span_id: int) -> None:
        self._snapshot = snapshot            # device tensor [n, 3] int64 (its own copy)
        self._launches = launches
        self._meta = (gpu_id, fake, trace_id, span_id)

    def wait(self) -> CtaBatch:
        """Blocks until the step's kernels finished; copies 24 bytes per CTA to the host."""
        gpu_id, fake, trace_id, span_id = self._meta
        records = self._snapshot.cpu().numpy()
        return CtaBatch.from_records(records, self._launches, gpu_id=gpu_id, fake=fake,
                                     trace_id=trace_id, span_id=span_id)


class SmProbe:
    """The probe buffer of one GPU: slot ranges for launches, snapshots per step.

    ``capacity_ctas`` bounds the CTAs probed per step (24 bytes each; the default 1 Mi
    CTAs is 24 MiB of device memory). A launch that would overflow is not probed and is
    counted in ``dropped_launches`` — the kernel then runs with the probe off.
    Not thread-safe: one engine thread launches kernels and ends steps."""

    def __init__(self, device, capacity_ctas: int = 1 << 20, gpu_id: int = 0,
                 mode: int | None = None) -> None:
        import torch
        if capacity_ctas <= 0:
            raise ValueError(f"capacity_ctas={capacity_ctas} must be > 0")
        self.device = torch.device(device)
        if mode is None:
            mode = PROBE_FAKE if os.environ.get("TRITON_INTERPRET") == "1" else PROBE_HW
        if mode not in (PROBE_HW, PROBE_FAKE):
            raise ValueError(f"mode={mode}; allowed: PROBE_HW=1, PROBE_FAKE=2")
        if mode == PROBE_HW and self.device.type != "cuda":
            raise ValueError(f"PROBE_HW needs a CUDA device, got {self.device}")
        self.mode = mode
        self.gpu_id = gpu_id
        self.capacity_ctas = capacity_ctas
        self.buffer = torch.zeros(capacity_ctas * RECORD_WORDS, dtype=torch.int64,
                                  device=self.device)
        self._launches: list[tuple[str, int]] = []
        self._used = 0
        self.dropped_launches = 0

    @property
    def fake(self) -> bool:
        return self.mode == PROBE_FAKE

    def reserve(self, kernel_name: str, num_ctas: int) -> int | None:
        """Slot base for a launch of ``num_ctas`` CTAs, or None (buffer full: don't probe)."""
        if self._used + num_ctas > self.capacity_ctas:
            self.dropped_launches += 1
            return None
        base = self._used
        self._used += num_ctas
        self._launches.append((kernel_name, num_ctas))
        return base

    @property
    def pending_ctas(self) -> int:
        return self._used

    def discard(self) -> None:
        """Forgets this step's reservations without reading them (benchmarks)."""
        self._launches, self._used = [], 0

    def end_step(self, trace_id: int = 0, span_id: int = 0) -> PendingCtas | None:
        """Snapshots this step's records (a device copy, stream-ordered) and resets the
        slots; None when nothing was probed. Costs one small copy kernel launch."""
        if self._used == 0:
            return None
        snapshot = self.buffer[: self._used * RECORD_WORDS].clone()
        pending = PendingCtas(snapshot, self._launches, self.gpu_id, self.fake,
                              trace_id, span_id)
        self._launches, self._used = [], 0
        return pending
