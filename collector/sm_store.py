"""Per-SM CTA-duration series of a fleet: identity, fair admission, cumulative streams.

A series is keyed by (instance, gpu, sm, kernel): ``instance`` is the producing resource's
``service.instance.id``, else its ``host.name``; ``gpu`` is the point's ``gpu.uuid``, else its
``gpu.id`` (every host's first GPU is ``gpu.id=0``, so the index alone would merge GPUs).
One :class:`~.sm_blocks.SmBlock` holds the SMs of one (instance, gpu, kernel).

Admission is fair per GPU: at most ``max_gpus`` GPUs; ``max_sm_series`` is shared equally
among the GPUs present, a kernel is admitted whole or not at all, and when a new GPU
arrives, GPUs over their new share give back their latest kernels. Every refused point is
counted in ``overflow["sm_cta"]`` and in ``dropped``; :meth:`refusal` names the limit
(:mod:`.sm_refusals`: a bounded table that ages out). CUMULATIVE points become deltas against the stream's previous point; a stream
whose state was let go (idle past the horizon) restarts as a baseline, never re-counted.
A lock not held while an export's points are read, and taken per block for the merges;
queries copy out.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from ..instrumentation import semconv as sc
from ..instrumentation import ExpHistogram
from .aggregation_config import AggregationConfig
from .classic_rows import ClassicRows, exemplar_at
from .contention import ContendedSm, SlotContention, assess, contended_sms
from .otlp_points import (PointRefused, clamped_time_s, cta_point_histogram, label, points_in,
                          resource_instance)
from .sm_blocks import SmBlock
from .sm_refusals import GpuKey, Refusal, RefusedGpus
from .windows import ClassicHistogram, Exemplar, subtract_cumulative

__all__ = ["BlockSnapshot", "GpuKey", "Refusal", "SmKey", "SmStore", "gpu_label", "kernel_label"]

_CUMULATIVE = 2  # AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
_YIELD_BLOCKS = 32  # a snapshot lets waiting queries in after this many blocks


def _count(counts: dict[str, int], reason: str, n: int = 1) -> None:
    counts[reason] = counts.get(reason, 0) + n


def gpu_label(instance: str, gpu: str, index: str) -> str:
    """The GPU's label on /metrics: its UUID, else ``instance:index`` (unique either way)."""
    return gpu if gpu != index else f"{instance}:{index}"


def kernel_label(kernel: str, max_chars: int = 32) -> str:
    """A kernel's label on /metrics: the name, or its head and a hash when longer than
    ``max_chars`` (C++ names run to 250 characters; 170k series repeat them)."""
    if len(kernel) <= max_chars:
        return kernel
    return f"{kernel[:max_chars - 9]}~{hashlib.blake2s(kernel.encode(), digest_size=4).hexdigest()}"


class SmKey(NamedTuple):
    instance: str
    gpu: str
    kernel: str


class BlockSnapshot(NamedTuple):
    """What the exposition reads of one block (copies). ``stamp`` is equal for two snapshots
    of a block exactly when the rest is; a snapshot of a block the reader already holds
    (``SmStore.snapshot``'s ``known``) has ``sms`` and the data fields None."""

    key: SmKey
    gpu_index: str
    stamp: tuple
    sms: list[str] | None
    p99_s: np.ndarray | None  # per SM over the gauge window (NaN: no CTAs)
    classic: ClassicHistogram | None  # all SMs together, since the start
    classic_sm: ClassicRows | None  # per SM (opt-in): row i is sms[i]
    # SMs the contention tests flagged in any slot of the gauge window (collector/contention.py)
    contended: dict[str, ContendedSm] | None = None

    @property
    def current(self) -> bool:
        """False for a stamp-only snapshot (the reader's copy is current)."""
        return self.sms is not None


_exemplar = exemplar_at  # a block's exemplar cell as an Exemplar (None when empty)


class _Gpu:
    __slots__ = ("index", "blocks", "series", "sm_count")

    def __init__(self, index: str) -> None:
        self.index = index  # gpu.id
        self.blocks: OrderedDict[str, SmBlock] = OrderedDict()  # kernel -> block, in admission order
        self.series = 0
        self.sm_count = 0  # as its producer declares it (METRIC_CTA_WIDE), 0 when not


class SmStore:
    """See the module docstring. ``overflow`` and ``dropped`` are the owner's counters."""

    def __init__(self, config: AggregationConfig, overflow: dict[str, int], dropped: dict[str, int],
                 clock: Callable[[], float], evicted: dict[str, int] | None = None) -> None:
        self.config = config
        self.now = clock
        wc = self.window = self._wc = config.window
        self._expired_epoch = wc.epoch(clock())
        self.detail_slots = min(wc.num_slots, math.ceil(config.gauge_window_s / wc.slot_s) + 1)
        self.overflow, self.dropped = overflow, dropped
        self.evicted = evicted if evicted is not None else {}  # "sm_cta": SM series let go idle
        self._lock = threading.Lock()  # the store's state: every read and write
        self._ingest_lock = threading.Lock()  # writers (consume, expire), one at a time
        self._gpus: dict[GpuKey, _Gpu] = {}
        self._series = 0
        self._refused = RefusedGpus()
        self._blocks_made = 0
        self._streams: OrderedDict[tuple, tuple[int, ExpHistogram, float]] = OrderedDict()
        self._baseline_before_ns = 0  # streams started before this may have been let go
        self.newest_point_s = 0.0
        self.points_seen = 0

    # -- ingest -----------------------------------------------------------------------
    def consume(self, request, now: float) -> int:
        """Takes the CTA points of an ``ExportMetricsServiceRequest``; returns those taken.

        Points are read and checked before the lock is taken (most of the cost), so queries
        and snapshots wait only for admission and the numpy merges of one export."""
        if self._wc.epoch(now) != self._expired_epoch:
            self._expired_epoch = self._wc.epoch(now)
            self.expire(now)
        drops: dict[str, int] = {}
        streams = []
        wide = []  # (instance, gpu, kernel, SM count, CTAs, time) of wide-launch sums
        dealt = []  # (instance, gpu id, gpu, kernel, SM, CTAs, time) of dispatch-order sums
        for rm in request.resource_metrics:
            instance = resource_instance(rm.resource)
            for scope in rm.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == sc.METRIC_CTA_WIDE:
                        wide += self._read_wide(instance, metric, now, drops)
                        continue
                    if metric.name == sc.METRIC_CTA_DEALT:
                        dealt += self._read_dealt(instance, metric, now, drops)
                        continue
                    if metric.name != sc.METRIC_CTA_DURATION:
                        _count(drops, "unknown_metric", points_in(metric))
                        continue
                    kind = metric.WhichOneof("data")
                    # explicit buckets cannot merge into exponential sketches without
                    # losing the error bound: refused and counted
                    if kind == "histogram":
                        _count(drops, "explicit_bucket_histogram", len(metric.histogram.data_points))
                        continue
                    if kind != "exponential_histogram":
                        _count(drops, "unsupported_metric_type", points_in(metric))
                        continue
                    data = metric.exponential_histogram
                    cumulative = data.aggregation_temporality == _CUMULATIVE
                    # a digest: the key must not grow with whatever a resource carries
                    resource_key = hashlib.blake2b(rm.resource.SerializeToString(deterministic=True),
                                                   digest_size=16).digest() if cumulative else None
                    points = []
                    for point in data.data_points:
                        try:
                            points.append(self._read(point, now, drops))
                        except Exception:  # keep the batch's other points
                            _count(drops, "malformed_point")
                    streams.append((instance, cumulative, resource_key, points))
        batches: dict[tuple[int, int], tuple[SmBlock, list, list, list]] = {}
        taken = 0
        # Writers one at a time (_ingest_lock: no block is let go between admission and its
        # merge); queries and snapshots (_lock) wait for admission and then for one block's
        # merge at a time, not for every merge of the export.
        with self._ingest_lock:
            with self._lock:
                for reason, n in drops.items():
                    self._drop(reason, n)
                for instance, cumulative, resource_key, points in streams:
                    for read in points:
                        if read is None:
                            continue
                        try:
                            taken += self._point(read, instance, cumulative, resource_key, now, batches)
                        except Exception:  # keep the batch's other points
                            self._drop("malformed_point")
                self.points_seen += taken
            for i, (block, rows, hists, exemplars) in enumerate(batches.values()):
                if i % _YIELD_BLOCKS == _YIELD_BLOCKS - 1:
                    time.sleep(0)  # as in snapshot: Python's lock is not fair to a waiting query
                with self._lock:
                    block.merge(self._wc.epoch(hists[0][1]), rows, [h for h, _ in hists], exemplars)
            if wide:  # after the merges: a sum belongs to the slot its export's CTAs opened
                with self._lock:
                    for instance, gpu, kernel, sm_count, ctas, t in wide:
                        g = self._gpus.get(GpuKey(instance, gpu))
                        block = g.blocks.get(kernel) if g is not None else None
                        if block is None or not block.add_wide(self._wc.epoch(t), ctas):
                            self._drop("wide_launches_unmatched")
                            continue
                        g.sm_count = max(g.sm_count, sm_count)
            if dealt:
                with self._lock:
                    for instance, gpu_id, gpu, kernel, sm, ctas, t in dealt:
                        self._add_dealt(GpuKey(instance, gpu), gpu_id, kernel, sm, ctas, t, now)
        return taken

    def _add_dealt(self, key: GpuKey, gpu_id: str, kernel: str, sm: str, ctas: int, t: float, now: float) -> None:
        """One SM's dealt CTAs into its kernel's block. An SM dealt CTAs that ran none is
        given its row here: that is the SM the starved test is for."""
        g = self._gpus.get(key)
        if g is None or kernel not in g.blocks:
            self._drop("dealt_unmatched")
            return
        block = self._admit(key, gpu_id, kernel, sm, now)
        if block is None:
            self._drop("sm_series_limit")
            _count(self.overflow, "sm_cta")
        elif not block.add_dealt(self._wc.epoch(t), block.row(sm), ctas):
            self._drop("dealt_unmatched")

    @staticmethod
    def _count_points(metric, drops: dict[str, int], needed: tuple[str, ...]):
        """(attributes, CTAs, time) of each point of a delta sum of CTA counts that names
        every ``needed`` attribute; the others, and whole cumulative sums, counted in ``drops``."""
        if metric.WhichOneof("data") != "sum" or metric.sum.aggregation_temporality == _CUMULATIVE:
            _count(drops, "unsupported_metric_type", points_in(metric))
            return
        for point in metric.sum.data_points:
            attrs = {kv.key: label(kv.value) for kv in point.attributes}
            value = point.as_int if point.WhichOneof("value") == "as_int" else point.as_double
            if any(attrs.get(k) is None for k in needed) or not 0 <= value < 2**53 or value != int(value):
                _count(drops, "malformed_point")
                continue
            yield attrs, int(value), point.time_unix_nano

    def _read_wide(self, instance: str, metric, now: float, drops: dict[str, int]) -> list[tuple]:
        """The points of a ``METRIC_CTA_WIDE`` sum (delta only: each point a slot's share)."""
        out = []
        for attrs, ctas, t_ns in self._count_points(metric, drops, (sc.ATTR_KERNEL_NAME, sc.ATTR_GPU_SM_COUNT)):
            if not attrs[sc.ATTR_GPU_SM_COUNT].isdigit():
                _count(drops, "malformed_point")
                continue
            gpu = attrs.get(sc.ATTR_GPU_UUID) or attrs.get(sc.ATTR_GPU_ID) or "0"
            out.append((instance, gpu, attrs[sc.ATTR_KERNEL_NAME], int(attrs[sc.ATTR_GPU_SM_COUNT]), ctas,
                        clamped_time_s(t_ns, now)))
        return out

    def _read_dealt(self, instance: str, metric, now: float, drops: dict[str, int]) -> list[tuple]:
        """The points of a ``METRIC_CTA_DEALT`` sum (delta only)."""
        out = []
        for attrs, ctas, t_ns in self._count_points(metric, drops, (sc.ATTR_KERNEL_NAME, sc.ATTR_SM_ID)):
            gpu_id = attrs.get(sc.ATTR_GPU_ID) or "0"
            out.append((instance, gpu_id, attrs.get(sc.ATTR_GPU_UUID) or gpu_id, attrs[sc.ATTR_KERNEL_NAME],
                        attrs[sc.ATTR_SM_ID], ctas, clamped_time_s(t_ns, now)))
        return out

    def _read(self, point, now: float, drops: dict[str, int]) -> tuple | None:
        """The point's identity, histogram, time and slowest exemplar (None: refused, counted
        in ``drops``). Touches no shared state, so it runs outside the lock."""
        gpu_id = uuid = sm = kernel = None
        for kv in point.attributes:
            key = kv.key
            if key == sc.ATTR_SM_ID:
                sm = label(kv.value)
            elif key == sc.ATTR_GPU_ID:
                gpu_id = label(kv.value)
            elif key == sc.ATTR_GPU_UUID:
                uuid = label(kv.value)
            elif key == sc.ATTR_KERNEL_NAME:
                kernel = label(kv.value)
        if sm is None or kernel is None:
            _count(drops, "missing_attributes")
            return None
        gpu_id = gpu_id or "0"
        try:
            hist = cta_point_histogram(point, self._wc.max_buckets)
        except PointRefused as refused:
            _count(drops, refused.reason)
            return None
        t = clamped_time_s(point.time_unix_nano, now)
        if t <= now - self._wc.horizon_s:
            _count(drops, "late")
            return None
        exemplar = None
        for e in point.exemplars:
            value = e.as_double if e.WhichOneof("value") == "as_double" else float(e.as_int)
            if exemplar is None or value > exemplar.value:
                exemplar = Exemplar(value, e.trace_id, e.span_id, e.time_unix_nano)
        return gpu_id, uuid or gpu_id, sm, kernel, hist, t, point.start_time_unix_nano, exemplar

    def _point(self, read: tuple, instance: str, cumulative: bool, resource_key, now: float, batches) -> int:
        """Admits one read point and adds it to its (block, slot) batch (under the lock)."""
        gpu_id, gpu, sm, kernel, hist, t, start_ns, exemplar = read
        block = self._admit(GpuKey(instance, gpu), gpu_id, kernel, sm, now)
        if block is None:
            self._drop("sm_series_limit")
            _count(self.overflow, "sm_cta")
            return 0
        if cumulative:
            hist = self._delta((resource_key, gpu, sm, kernel), start_ns, hist, now)
            if hist is None:
                return 0
            if hist.count == 0:
                return 1
        epoch = self._wc.epoch(t)
        if not block.accepts(epoch):
            self._drop("late")
            return 0
        if t > self.newest_point_s:
            self.newest_point_s = t
        batch = batches.get((id(block), epoch))
        if batch is None:
            batch = batches[(id(block), epoch)] = (block, [], [], [])
        batch[1].append(block.row(sm))
        batch[2].append((hist, t))
        batch[3].append(exemplar)
        return 1

    def _delta(self, stream: tuple, start_ns: int, hist: ExpHistogram, now: float) -> ExpHistogram | None:
        """The CUMULATIVE point as a delta (None: refused or a baseline, counted)."""
        streams = self._streams
        prev = streams.get(stream)
        if prev is None:
            horizon = self._wc.horizon_s
            while streams and len(streams) >= self.config.max_sm_series:
                oldest = next(iter(streams.values()))
                if oldest[2] > now - horizon:
                    self._drop("cumulative_streams_full")
                    return None
                streams.popitem(last=False)  # idle past the horizon: let go, and remember that
                self._baseline_before_ns = int(now * 1e9)
        streams[stream] = (start_ns, hist, now)
        streams.move_to_end(stream)
        if prev is None:
            if start_ns and start_ns < self._baseline_before_ns:
                # it may have been seen and let go: taking it whole could count twice
                self._drop("cumulative_baseline")
                return None
            return hist
        if prev[0] != start_ns:  # restarted: everything since its new start is new
            return hist
        delta = subtract_cumulative(hist, prev[1])
        return hist if delta is None else delta  # None: reset without a new start time

    # -- admission ----------------------------------------------------------------------
    def _admit(self, key: GpuKey, gpu_id: str, kernel: str, sm: str, now: float) -> SmBlock | None:
        gpu = self._gpus.get(key)
        if gpu is not None:
            block = gpu.blocks.get(kernel)
            if block is not None and sm in block.rows:
                return block
        cfg = self.config
        if gpu is None:
            if len(self._gpus) >= cfg.max_gpus:
                return self._refuse(key, "max_gpus", cfg.max_gpus, (kernel, sm), now)
            gpu = self._gpus[key] = _Gpu(gpu_id)
            self._refused.forget(key)
            self._rebalance(now)
        share = cfg.max_sm_series // len(self._gpus)
        block = gpu.blocks.get(kernel)
        if block is None:
            # a kernel whole or not at all: room for as many SMs as its GPU's biggest kernel
            need = max((len(b.sms) for b in gpu.blocks.values()), default=1)
            if gpu.series + need > share or self._series + need > cfg.max_sm_series:
                return self._refuse(key, "max_sm_series", cfg.max_sm_series, (kernel, sm), now)
            self._blocks_made += 1
            block = gpu.blocks[kernel] = SmBlock(
                self._wc.num_slots, self.detail_slots, self._wc.initial_scale, self._wc.max_buckets,
                sc.CTA_BUCKETS_S, cfg.expose_sm_histograms, serial=self._blocks_made)
        elif self._series >= cfg.max_sm_series:
            return self._refuse(key, "max_sm_series", cfg.max_sm_series, (kernel, sm), now)
        gpu.series += 1
        self._series += 1
        block.row(sm)
        return block

    def _rebalance(self, now: float) -> None:
        """GPUs over their share (a GPU just arrived) give back their latest kernels."""
        share = self.config.max_sm_series // len(self._gpus)
        if self._series <= self.config.max_sm_series - share:
            return  # the newcomer's share is free
        for key, gpu in self._gpus.items():
            while gpu.series > share and gpu.blocks:
                kernel, block = gpu.blocks.popitem(last=True)
                gpu.series -= len(block.sms)
                self._series -= len(block.sms)
                for sm in block.sms:
                    self._refuse(key, "max_sm_series", self.config.max_sm_series, (kernel, sm), now)

    def _refuse(self, key: GpuKey, limit: str, value: int, series: tuple[str, str], now: float) -> None:
        self._refused.refuse(key, limit, value, series, now)
        return None

    def expire(self, now: float) -> None:
        """Lets go of kernels with no data within the horizon (frees their GPU's share)."""
        oldest = self._wc.epoch(now - self._wc.horizon_s)
        with self._ingest_lock, self._lock:
            for key in list(self._gpus):
                gpu = self._gpus[key]
                for kernel in [k for k, b in gpu.blocks.items() if b.newest_epoch <= oldest]:
                    block = gpu.blocks.pop(kernel)
                    gpu.series -= len(block.sms)
                    self._series -= len(block.sms)
                    _count(self.evicted, "sm_cta", len(block.sms))
                if not gpu.blocks:
                    del self._gpus[key]
            self._refused.expire(now - self._wc.horizon_s)

    def _drop(self, reason: str, n: int = 1) -> None:
        _count(self.dropped, reason, n)

    # -- queries ----------------------------------------------------------------------
    def _epochs(self, now_s: float, last_s: float) -> tuple[int, int]:
        newest = self._wc.epoch(now_s)
        n = min(self._wc.num_slots, max(1, int(math.ceil(last_s / self._wc.slot_s))))
        return newest - n + 1, newest

    def _closed_epochs(self, now_s: float, last_s: float) -> tuple[int, int]:
        """The slots that closed in the last ``last_s``: the ones the contention tests read. An
        open slot's first seconds hold a few launches, and a launch places the same work (a
        long context's CTAs) on the same SMs launch after launch: read alone, they flag SMs
        as slow or starved that a whole slot, its launches mixed, does not."""
        newest = self._wc.epoch(now_s) - 1
        return max(self._wc.epoch(now_s - last_s), newest - self._wc.num_slots + 1), newest

    def gpus(self) -> list[dict]:
        """Per (instance, gpu, kernel) with data: SMs, CTAs and the GPU's refusal, if any."""
        with self._lock:
            out = []
            for (instance, gpu), g in self._gpus.items():
                refusal = self._refusal(GpuKey(instance, gpu))
                for kernel, block in g.blocks.items():
                    out.append({"instance": instance, "gpu": gpu, "gpu_index": g.index, "kernel": kernel,
                                "gpu_label": gpu_label(instance, gpu, g.index), "kernel_label": kernel_label(kernel),
                                "sms": len(block.sms), "ctas": int(block.total.sum()), "source": "sm_probe",
                                "refusal": refusal._asdict() if refusal else None})
        return sorted(out, key=lambda e: (e["instance"], e["gpu"], e["kernel"]))

    def resolve(self, gpu: str, kernel: str, instance: str | None = None) -> SmKey:
        """The series key of ``gpu`` (UUID or index) and ``kernel``; ``instance`` may be left
        out when one instance has that GPU (ValueError naming them when several do)."""
        with self._lock:
            found = sorted({k.instance for k, g in self._gpus.items()
                            if (k.gpu == gpu or g.index == gpu) and (instance is None or k.instance == instance)
                            and kernel in g.blocks} | {k.instance for k, _ in self._refused.of_gpu(gpu, instance)})
            if len(found) > 1:
                raise ValueError(f"gpu={gpu!r} kernel={kernel!r} is on {len(found)} instances "
                                 f"({', '.join(found[:5])}): give instance_id=")
            inst = found[0] if found else (instance if instance is not None else "unknown")
            key = GpuKey(inst, gpu)
            if key not in self._gpus and key not in self._refused:
                key = next((k for k, g in self._gpus.items() if k.instance == inst and g.index == gpu), key)
            return SmKey(key.instance, key.gpu, kernel)

    def refusal(self, key: GpuKey) -> Refusal | None:
        with self._lock:
            return self._refusal(key)

    def _refusal(self, key: GpuKey) -> Refusal | None:
        return self._refused.get(key)

    def refusals(self) -> dict[GpuKey, Refusal]:
        """Every refusal held (a bounded table: see :mod:`.sm_refusals`)."""
        with self._lock:
            return self._refused.all()

    def refusals_of(self, gpu: str, instance: str | None = None, limit: int = 8) -> list[tuple[GpuKey, Refusal]]:
        """At most ``limit`` refusals of ``gpu`` (UUID or index, as sent), of ``instance`` or
        of any: an index lookup, no scan or copy of the table."""
        with self._lock:
            return self._refused.of_gpu(gpu, instance, limit)

    def _block(self, key: SmKey) -> SmBlock | None:
        gpu = self._gpus.get(GpuKey(key.instance, key.gpu))
        return gpu.blocks.get(key.kernel) if gpu else None

    def histograms(self, key: SmKey, now_s: float, last_s: float) -> dict[str, ExpHistogram]:
        """Per SM: one histogram over the full-resolution slots of the last ``last_s``."""
        with self._lock:
            block = self._block(key)
            return block.histograms(*self._epochs(now_s, last_s)) if block else {}

    def histograms_between(self, start_s: float, end_s: float) -> dict[SmKey, dict[str, ExpHistogram]]:
        """Per (instance, gpu, kernel), per SM: the full-resolution slots overlapping the range."""
        first, last = self._wc.epoch(start_s), self._wc.epoch(end_s)
        out = {}
        with self._lock:
            for (instance, gpu), g in self._gpus.items():
                for kernel, block in g.blocks.items():
                    hists = block.histograms(first, last)
                    if hists:
                        out[SmKey(instance, gpu, kernel)] = hists
        return out

    def slot_cells(self, key: SmKey, now_s: float, last_s: float):
        """``(sms, scale, [(epoch, p99, count, exemplars, evidence)])`` per slot (see
        ``SmBlock.slot_cells``)."""
        with self._lock:
            block = self._block(key)
            if block is None:
                return [], self._wc.initial_scale, []
            cells = [(e, p.copy(), c.copy(), x.copy(), ev)
                     for e, p, c, x, ev in block.slot_cells(*self._epochs(now_s, last_s))]
            return list(block.sms), block.scale, cells

    def num_sms(self, key: GpuKey) -> int:
        """The GPU's SM count: as its producer declares it, else as its data shows it (one
        more than the largest numeric SM id any of its kernels ran on, at least the SMs
        seen); 0 when none is known."""
        with self._lock:
            return self._num_sms(key)

    def _num_sms(self, key: GpuKey) -> int:
        gpu = self._gpus.get(key)
        if gpu is None:
            return 0
        found = gpu.sm_count
        for block in gpu.blocks.values():
            ids = [int(sm) for sm in block.sms if sm.isdigit()]
            found = max(found, len(block.sms), (max(ids) + 1) if ids else 0)
        return found

    def contention(self, key: SmKey, now_s: float, last_s: float) -> list[tuple[int, SlotContention]]:
        """The contention tests of each slot that closed in the last ``last_s`` with CTAs of
        ``key``, oldest first (collector/contention.py; ``_closed_epochs`` says why closed)."""
        with self._lock:
            block = self._block(key)
            if block is None:
                return []
            num_sms = self._num_sms(GpuKey(key.instance, key.gpu))
            slots = block.slot_evidence(*self._closed_epochs(now_s, last_s))
            sms = list(block.sms)
        config = self.config.contention
        return [(epoch, assess(sms, evidence, num_sms, config)) for epoch, evidence in slots]

    def slot_histograms(self, key: SmKey, now_s: float, last_s: float) -> dict[str, list[tuple]]:
        """Per SM: ``(epoch, histogram, slowest exemplar)`` of each full-resolution slot."""
        first, last = self._epochs(now_s, last_s)
        out: dict[str, list] = {}
        with self._lock:
            block = self._block(key)
            for epoch in range(first, last + 1) if block else ():
                s = epoch % self._wc.num_slots
                for sm, h in block.histograms(epoch, epoch).items():
                    out.setdefault(sm, []).append((epoch, h, _exemplar(block.s_ex[s, block.rows[sm]])))
        return out

    def exemplar_for_spans(self, span_ids: set[bytes]) -> tuple[SmKey, str, Exemplar] | None:
        """The slowest per-SM exemplar still held that points at one of ``span_ids``."""
        best = None
        with self._lock:
            for (instance, gpu), g in self._gpus.items():
                for kernel, block in g.blocks.items():
                    ex = block.s_ex
                    hit = np.isin(ex["span_id"], np.array(list(span_ids), dtype="S8")) & ~np.isnan(ex["value"])
                    if not hit.any():
                        continue
                    s, r = np.unravel_index(np.argmax(np.where(hit, ex["value"], -np.inf)), hit.shape)
                    found = _exemplar(ex[s, r])
                    if best is None or found.value > best[2].value:
                        best = (SmKey(instance, gpu, kernel), block.sms[r], found)
        return best

    def snapshot(self, now_s: float, known: Mapping[SmKey, tuple] | None = None) -> list[BlockSnapshot]:
        """Every block's P99s and classic histograms, the lock taken once per block; a block
        whose stamp equals ``known[key]`` comes back as its stamp only (nothing computed)."""
        with self._lock:
            keys = [(SmKey(i, g, k), gpu.index) for (i, g), gpu in self._gpus.items() for k in gpu.blocks]
        first, last = self._epochs(now_s, self.config.gauge_window_s)
        tested = self._closed_epochs(now_s, self.config.gauge_window_s)
        known = known or {}
        out = []
        for i, (key, index) in enumerate(keys):
            if i % _YIELD_BLOCKS == _YIELD_BLOCKS - 1:
                # Python's lock is not fair: without letting go of the GIL now and then, this
                # loop takes the lock again before a waiting query (a heatmap) runs, which then
                # waits for every block; each yield costs up to a GIL switch interval
                time.sleep(0)
            with self._lock:
                block = self._block(key)
                if block is None:
                    continue
                # the slots tested move on as a slot closes, with no write to the block
                stamp = (*block.stamp(first, last), tested)
                if known.get(key) == stamp:
                    out.append(BlockSnapshot(key, index, stamp, None, None, None, None))
                    continue
                num_sms = self._num_sms(GpuKey(key.instance, key.gpu))
                evidence = [ev for _, ev in block.slot_evidence(*tested)]
                out.append(BlockSnapshot(key, index, stamp, list(block.sms), block.p99(first, last),
                                         block.classic.copy(),
                                         block.classic_sm.copy() if block.classic_sm is not None else None,
                                         (num_sms, evidence)))
        config = self.config.contention
        # the tests run outside the lock, on what was read under it (evidence is never changed
        # in place: a write replaces it)
        return [snap._replace(contended=contended_sms([assess(snap.sms, ev, snap.contended[0], config)
                                                       for ev in snap.contended[1]]))
                if snap.current else snap for snap in out]

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"sm": self._series, "gpus": len(self._gpus), "cumulative_streams": len(self._streams)}

    def nbytes(self) -> int:
        with self._lock:
            total = sum(b.nbytes() for g in self._gpus.values() for b in g.blocks.values())
            return total + sum(h.counts.nbytes for _, h, _ in self._streams.values())
