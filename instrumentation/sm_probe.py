"""Per-CTA SM probe: which streaming multiprocessor ran each CTA of a Triton kernel, and when.

Device side: a probed kernel takes a ``PROBE: tl.constexpr`` mode, calls
``t0 = probe_begin(PROBE)`` first and ``probe_end(probe_ptr, probe_base + probe_cta_index(),
t0, PROBE)`` last; each CTA writes one ``(%smid, start, end)`` record (``%globaltimer`` ns)
at its own slot, so no atomics. Cost: two timer reads, one SM-id read and one 24-byte store
per CTA; with ``PROBE_OFF`` the kernel compiles without the helpers.

Host side: ``SmProbe`` owns the device buffer and hands out slot ranges per launch;
``end_step`` snapshots the used slots with one copy on the launching stream and returns a
``PendingCtas`` whose ``.wait()`` (off the request path) yields a ``CtaBatch``, the typed
record of one step's CTAs. ``launch_facts_of_records`` reduces a step's records to
per-launch facts where they lie (on the GPU for a traced step), no Python loop per CTA. ``CtaHistograms`` is the numpy reduction into per-(SM, kernel) histograms,
the reference the tests hold ``sm_histograms.DeviceCtaHistograms`` (the production path) to.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import numpy as np

from .config_checks import check_range
from .exphist import ExpHistogram, bucket_indices
from .host_copy import to_device, to_host
from .probe_snapshots import SnapshotRing

__all__ = [
    "PROBE_FAKE", "PROBE_HW", "PROBE_OFF", "RECORD_WORDS",
    "CtaBatch", "CtaHistograms", "LaunchFacts", "PendingCtas", "ProbedLaunches", "SmExemplar", "SmProbe",
    "launch_facts", "launch_facts_of_records", "probe_begin", "probe_cta_index", "probe_end",
]

PROBE_OFF = 0   # the helpers are not called; the kernel compiles without them
PROBE_HW = 1    # real %smid / %globaltimer via inline PTX (CUDA only)
# TRITON_INTERPRET=1 only, where inline PTX cannot run: FAKE, deterministic values (SM
# slot % 8, start slot * 1000, end start + 500 + slot) so that the interpreter tests can
# check slot plumbing. They describe no hardware; SmProbe marks these batches fake=True.
PROBE_FAKE = 2
RECORD_WORDS = 3  # int64 words per CTA: smid, start_ns, end_ns
_FAKE_NUM_SMS = 8
_SM_STRIDE = 1024   # SM ids are < 1024 on every NVIDIA GPU so far (H200: 132)

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
    """Per-launch facts of a batch on the host (:func:`launch_facts_of_records` on its arrays)."""
    import torch
    records = np.stack([batch.sm_id, batch.start_ns, batch.end_ns], axis=1)
    launches = list(zip(batch.launch_names, batch.launch_ctas.tolist()))
    return launch_facts_of_records(torch.from_numpy(np.ascontiguousarray(records)).view(-1), launches)


def launch_facts_of_records(records, launches: list[tuple[str, int]]) -> list[LaunchFacts]:
    """Per-launch facts of ``records`` (a torch tensor, [n * 3] int64 in launch order, as the
    probe writes them; SM id -1: a CTA that exited without work, left out) where they lie: on
    the GPU the reduction runs on the current stream and 8 int64 per launch come back, not 24
    bytes per CTA (a large batch's decode attention runs a CTA per split, KV head and request),
    with no copy that waits on the stream but the last (``host_copy``): no boolean mask, no
    scalar read back. Cost: one stable sort of the CTAs, a few linear passes, two small copies."""
    import torch
    n_launch, total = len(launches), sum(n for _, n in launches)
    if n_launch == 0:
        return []
    if total == 0:
        return [LaunchFacts(name, 0, 0, 0, -1, 0.0, 0.0, 0.0, 0, 0) for name, _ in launches]
    rec = records.view(-1, RECORD_WORDS)[:total]
    device = rec.device
    grid = to_device([n for _, n in launches], torch.int64, device)
    li = torch.repeat_interleave(torch.arange(n_launch, dtype=torch.int64, device=device), grid,
                                 output_size=total)
    sm, start, end = rec[:, 0], rec[:, 1], rec[:, 2]
    kept = sm >= 0
    counts = torch.zeros(n_launch, dtype=torch.int64, device=device).index_add_(0, li, kept.to(torch.int64))
    # idle CTAs count on a spare SM column, and sort first in their launch (duration -1)
    stride = _SM_STRIDE + 1
    # (index_add_, not bincount: on a GPU bincount reads its input's maximum back to the host)
    per_sm = torch.zeros(n_launch * stride, dtype=torch.int64, device=device).index_add_(
        0, li * stride + torch.where(kept, sm, _SM_STRIDE), torch.ones_like(li)).view(n_launch, stride)[:, :_SM_STRIDE]
    dur = torch.where(kept, end - start, -1)
    # launches are contiguous, so one sort by (launch, duration) orders every segment
    order = torch.sort(li * (1 << 40) + (dur + 1).clamp(0, (1 << 40) - 1), stable=True).indices
    ends = grid.cumsum(0)
    idle = grid - counts
    last = order[(ends - 1).clamp(0, total - 1)]
    median = order[(ends - grid + idle + (counts - 1) // 2).clamp(0, total - 1)]
    never = torch.iinfo(torch.int64).max
    first = torch.full((n_launch,), never, dtype=torch.int64, device=device).scatter_reduce(
        0, li, torch.where(kept, start, never), "amin")
    final = torch.full((n_launch,), -1, dtype=torch.int64, device=device).scatter_reduce(
        0, li, torch.where(kept, end, -1), "amax")
    (table,) = to_host(torch.stack([counts, (per_sm > 0).sum(1), per_sm.amax(1), sm[last], dur[last],
                                    dur[median], first, final], 1))
    table = table.tolist()
    out = []
    for (name, _), (n, sms_used, waves, slowest_sm, mx, md, first_ns, end_ns) in zip(launches, table):
        if n == 0:
            out.append(LaunchFacts(name, 0, 0, 0, -1, 0.0, 0.0, 0.0, 0, 0))
            continue
        mx_s, md_s = float(mx) * 1e-9, float(md) * 1e-9
        out.append(LaunchFacts(kernel_name=name, ctas=n, sms_used=sms_used, waves=waves, slowest_sm=slowest_sm,
                               max_cta_s=mx_s, median_cta_s=md_s, cta_spread=mx_s / md_s if md_s > 0 else 0.0,
                               start_ns=first_ns, end_ns=end_ns))
    return out


@dataclass
class SmExemplar:
    """The slowest CTA seen on one (SM, kernel) since the last export."""

    value_s: float
    time_unix_nano: int
    trace_id: int
    span_id: int


class _GpuState:
    """Dense per-(kernel, SM) exemplar arrays and not-yet-reduced CTA durations of one GPU."""

    def __init__(self) -> None:
        self.ex_value = np.zeros(0)                      # [K * _SM_STRIDE], -inf = none
        self.ex_time = np.zeros(0, dtype=np.int64)
        self.ex_trace = np.zeros(0, dtype=object)
        self.ex_span = np.zeros(0, dtype=object)
        self.pending_keys: list[np.ndarray] = []
        self.pending_durs: list[np.ndarray] = []
        self.pending_n = 0

    def grow(self, size: int) -> None:
        old = self.ex_value.size
        if size <= old:
            return
        pad = size - old
        self.ex_value = np.concatenate([self.ex_value, np.full(pad, -np.inf)])
        self.ex_time = np.concatenate([self.ex_time, np.zeros(pad, dtype=np.int64)])
        self.ex_trace = np.concatenate([self.ex_trace, np.zeros(pad, dtype=object)])
        self.ex_span = np.concatenate([self.ex_span, np.zeros(pad, dtype=object)])

    def reset_exemplars(self) -> None:
        self.ex_value[:] = -np.inf


class CtaHistograms:
    """Per-(gpu, sm, kernel) exponential histograms of CTA durations (seconds) plus per-key
    exemplars (slowest CTA and its step span); ``take`` returns both and starts afresh
    (delta export), ``snapshot`` copies without resetting.

    Cost: ``add`` is O(n) vectorized numpy per batch (exemplar maxima through dense
    per-(kernel, SM) arrays; durations are buffered). The reduction — one vectorized
    bucket mapping and one ``bincount`` over (group, bucket) for all buffered CTAs, then one
    ``ExpHistogram.add_buckets`` per (SM, kernel) group — runs once per
    ``reduce_every_ctas`` buffered CTAs or at ``snapshot``/``take``, not per step.
    Memory: 16 bytes per buffered CTA.
    Thread-safe."""

    def __init__(self, scale: int = 8, reduce_every_ctas: int = 1 << 21) -> None:
        self.scale = scale
        self.reduce_every_ctas = reduce_every_ctas
        self.histograms: dict[tuple[int, int, str], ExpHistogram] = {}
        self._names: dict[str, int] = {}
        self._name_list: list[str] = []
        self._gpus: dict[int, _GpuState] = {}
        self._lock = threading.Lock()

    def add(self, batch: CtaBatch, time_unix_nano: int = 0) -> int:
        """Records every CTA of ``batch``; returns the number of CTAs recorded."""
        if batch.num_ctas == 0:
            return 0
        with self._lock:
            idx = np.empty(len(batch.launch_names), dtype=np.int64)
            for i, name in enumerate(batch.launch_names):       # per launch, not per CTA
                k = self._names.get(name)
                if k is None:
                    k = self._names[name] = len(self._name_list)
                    self._name_list.append(name)
                idx[i] = k
            keys = idx[batch.launch_index] * _SM_STRIDE + batch.sm_id
            durs = batch.duration_s
            state = self._gpus.get(batch.gpu_id)
            if state is None:
                state = self._gpus[batch.gpu_id] = _GpuState()
            state.grow(len(self._name_list) * _SM_STRIDE)
            top = np.full(state.ex_value.size, -np.inf)
            np.maximum.at(top, keys, durs)
            better = top > state.ex_value
            if better.any():
                state.ex_value[better] = top[better]
                state.ex_time[better] = time_unix_nano
                state.ex_trace[better] = batch.trace_id
                state.ex_span[better] = batch.span_id
            state.pending_keys.append(keys)
            state.pending_durs.append(durs)
            state.pending_n += keys.size
            if state.pending_n >= self.reduce_every_ctas:
                self._reduce(batch.gpu_id, state)
        return batch.num_ctas

    def _reduce(self, gpu_id: int, state: _GpuState) -> None:
        """Buffered CTAs -> histograms: one vectorized bucket mapping and one ``bincount``
        over (group, bucket) for all CTAs, then one ``ExpHistogram.add_buckets`` per group."""
        if state.pending_n == 0:
            return
        keys = np.concatenate(state.pending_keys)
        durs = np.maximum(np.concatenate(state.pending_durs), 0.0)
        state.pending_keys, state.pending_durs, state.pending_n = [], [], 0
        present = np.bincount(keys)
        group_keys = np.flatnonzero(present)                  # sorted (kernel, SM) keys
        lookup = np.zeros(present.size, dtype=np.int64)
        lookup[group_keys] = np.arange(group_keys.size)
        group = lookup[keys]
        ng = group_keys.size
        count = present[group_keys]
        total = np.bincount(group, weights=durs, minlength=ng)
        low = np.full(ng, np.inf)
        high = np.full(ng, -np.inf)
        np.minimum.at(low, group, durs)
        np.maximum.at(high, group, durs)
        positive = durs > 0
        zeros = np.bincount(group[~positive], minlength=ng)
        scale = self.scale
        pos_group, pos = group[positive], durs[positive]
        if pos.size:
            idx = bucket_indices(pos, scale)
            lo, hi = int(idx.min()), int(idx.max())
            while ng * (hi - lo + 1) > (1 << 24):              # keep the dense table < 128 MiB
                scale -= 1
                idx = bucket_indices(pos, scale)
                lo, hi = int(idx.min()), int(idx.max())
            span = hi - lo + 1
            table = np.bincount(pos_group * span + (idx - lo), minlength=ng * span)
            table = table.reshape(ng, span)
        for g in range(ng):                                   # per (SM, kernel) group
            k = int(group_keys[g])
            hkey = (gpu_id, k % _SM_STRIDE, self._name_list[k // _SM_STRIDE])
            hist = self.histograms.get(hkey)
            if hist is None:
                hist = self.histograms[hkey] = ExpHistogram(scale=self.scale)
            if pos.size:
                row = table[g]
                nz = np.flatnonzero(row)
                first, last = (int(nz[0]), int(nz[-1])) if nz.size else (0, -1)
                counts = row[first:last + 1]
            else:
                first, counts = 0, np.zeros(0, dtype=np.int64)
            hist.add_buckets(scale, lo + first if pos.size else 0, counts, int(zeros[g]),
                             int(count[g]), float(total[g]), float(low[g]), float(high[g]))

    def _reduce_all(self) -> None:
        for gpu_id, state in self._gpus.items():
            self._reduce(gpu_id, state)

    def _exemplars(self) -> dict[tuple[int, int, str], SmExemplar]:
        out = {}
        for gpu_id, state in self._gpus.items():
            for i in np.flatnonzero(np.isfinite(state.ex_value)):
                out[(gpu_id, int(i) % _SM_STRIDE, self._name_list[int(i) // _SM_STRIDE])] = \
                    SmExemplar(float(state.ex_value[i]), int(state.ex_time[i]),
                               int(state.ex_trace[i]), int(state.ex_span[i]))
        return out

    def snapshot(self) -> dict[tuple[int, int, str], ExpHistogram]:
        """Copies of the histograms since the last ``take`` (reduces what is buffered)."""
        with self._lock:
            self._reduce_all()
            return {k: h.copy() for k, h in self.histograms.items()}

    def take(self) -> tuple[dict[tuple[int, int, str], ExpHistogram],
                            dict[tuple[int, int, str], SmExemplar]]:
        """Histograms and exemplars since the last ``take`` (delta), and resets both."""
        with self._lock:
            self._reduce_all()
            hists, self.histograms = self.histograms, {}
            exemplars = self._exemplars()
            for state in self._gpus.values():
                state.reset_exemplars()
        return hists, exemplars

    def take_exemplars(self) -> dict[tuple[int, int, str], SmExemplar]:
        """The exemplars since the last call; starts a new exemplar interval."""
        with self._lock:
            out = self._exemplars()
            for state in self._gpus.values():
                state.reset_exemplars()
        return out


# -- the device buffer ----------------------------------------------------------------

class PendingCtas:
    """One step's records on their way to the host; ``wait()`` returns the ``CtaBatch``."""

    # made on the engine thread of a probed step, right after the model's work
    __slots__ = ("ring", "start", "words", "launches", "trace_id", "span_id", "_meta", "_batch")

    def __init__(self, ring: SnapshotRing, start: int, words: int,
                 launches: list[tuple[str, int]], gpu_id: int, fake: bool,
                 trace_id: int, span_id: int) -> None:
        self.ring, self.start, self.words = ring, start, words   # its copy of the records
        self.launches = launches
        self.trace_id, self.span_id = trace_id, span_id
        self._meta = (gpu_id, fake, trace_id, span_id)
        self._batch: CtaBatch | None = None

    @property
    def snapshot(self):
        """The records, a device tensor [n * 3] int64 (a view of the ring; worker thread)."""
        return self.ring.view(self.start, self.words)

    def retire(self) -> None:
        """Every read of this snapshot (and of older ones) is done on the GPU."""
        self.ring.retire_through(self.start, self.words)

    def wait(self, retire: bool = True) -> CtaBatch:
        """Blocks until the step's kernels finished; copies 24 bytes per CTA to the host,
        then (``retire``) gives the snapshot's range back: a caller with other reads of
        it in flight on another stream passes False and retires it after them."""
        if self._batch is None:
            gpu_id, fake, trace_id, span_id = self._meta
            (records,) = to_host(self.snapshot)
            if retire:
                self.retire()
            self._batch = CtaBatch.from_records(records, self.launches, gpu_id=gpu_id,
                                                fake=fake, trace_id=trace_id, span_id=span_id)
        return self._batch


class ProbedLaunches(tuple):
    """A captured CUDA graph's probed launches, ``(kernel name, CTAs)`` pairs, with their
    CTA total in ``ctas`` (summed once at capture, not at every replay)."""

    def __new__(cls, launches=()):
        self = super().__new__(cls, launches)
        self.ctas = sum(n for _, n in self)
        return self


class SmProbe:
    """The probe buffer of one GPU: slot ranges for launches, snapshots per step.

    ``capacity_ctas`` bounds the CTAs probed per step (24 bytes each; the default 1 Mi
    CTAs is 24 MiB of device memory). A launch that would overflow is not probed and is
    counted in ``dropped_launches`` — the kernel then runs with the probe off.
    Not thread-safe: one engine thread launches kernels and ends steps."""

    def __init__(self, device, capacity_ctas: int = 1 << 20, gpu_id: int = 0,
                 mode: int | None = None) -> None:
        import torch
        check_range("capacity_ctas", capacity_ctas, 1, integer=True)
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
        self.snapshots = SnapshotRing(self.buffer, torch.zeros_like(self.buffer))
        self._launches: list[tuple[str, int]] = []
        # kernels that rotate their work over their CTAs at each launch of at most one wave,
        # so that no SM runs the same share of it launch after launch (their CTAs' durations
        # say something of the SM; sm_histograms counts those launches as wide)
        self.rotating: set[str] = set()
        self._used = 0
        self.dropped_launches = 0
        self.dropped_snapshots = 0    # steps whose records found the ring full

    @property
    def fake(self) -> bool:
        return self.mode == PROBE_FAKE

    def reserve(self, kernel_name: str, num_ctas: int, rotates: bool = False) -> int | None:
        """Slot base for a launch of ``num_ctas`` CTAs, or None (buffer full: don't probe).
        ``rotates``: the kernel moves its work over its CTAs from launch to launch."""
        if rotates:
            self.rotating.add(kernel_name)
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

    def take_reservations(self) -> ProbedLaunches:
        """This step's launches so far, forgotten without reading: a CUDA graph captured
        since the last reset keeps them for ``end_replay`` at each replay."""
        launches = ProbedLaunches(self._launches)
        self.discard()
        return launches

    def end_replay(self, launches: ProbedLaunches, trace_id: int = 0,
                   span_id: int = 0) -> PendingCtas | None:
        """``end_step`` for a step that replayed a CUDA graph: snapshots the graph's probed
        ``launches`` (its kernels write from slot 0: it was captured right after a reset).
        If anything else was probed in the step, those slots are taken: the graph's launches
        are then dropped (counted) and the step's own reservations snapshotted instead."""
        if self._used:
            self.dropped_launches += len(launches)
            return self.end_step(trace_id, span_id)
        return self._snapshot(launches, launches.ctas, trace_id, span_id)

    def end_step(self, trace_id: int = 0, span_id: int = 0) -> PendingCtas | None:
        """Snapshots this step's records into the ring (a device copy ordered on the
        launching stream, no torch call) and resets the slots; None when nothing was probed
        or the ring is full (counted). A reader on another stream first waits for the
        launching one, and retires the snapshot once its reads are done."""
        launches, used, self._launches, self._used = self._launches, self._used, [], 0
        return self._snapshot(launches, used, trace_id, span_id)

    def _snapshot(self, launches, ctas: int, trace_id: int, span_id: int) -> PendingCtas | None:
        if ctas == 0:
            return None
        words = ctas * RECORD_WORDS
        start = self.snapshots.place(words)
        if start is None:
            self.dropped_snapshots += 1
            return None
        return PendingCtas(self.snapshots, start, words, launches, self.gpu_id, self.fake,
                           trace_id, span_id)
