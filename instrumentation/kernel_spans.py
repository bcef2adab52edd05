"""Kernel spans of traced steps, built from raw CUPTI buffers and per-CTA probe records.

Runs where spans are assembled (the telemetry process). CUPTI buffers are decoded in bulk
(:mod:`.cupti_records`); kernels join their step by the external id the engine pushed
around its launches (``step_id + 1``). Once a traced step's records went quiet
(``settle_s``) or ``max_wait_s`` passed, its spans go out as children of its step span:
each attention launch (``attention_markers``) and each collective (NCCL; an all-reduce of a
tensor-parallel step with its bytes) is a ``kernel <name>`` span; every other kernel one
``kernels <name>`` span per (step, name) with launches, total and max duration
(``detail="all"``: a span each); each says when its (last) launch call returned. A rank's
part of a tensor-parallel step (``RankStep``) runs from its first all-reduce's end (which
absorbs the ranks' start skew) to its last kernel; its later all-reduces are its wait.
Guarantee: bounded state (``max_pending_kernels``, ``max_correlations``); kernels with no
known step are counted. Cost: numpy per buffer, Python per emitted span (~100 a step).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from . import semconv
from .config_checks import check_range
from .cupti_records import KERNEL_DTYPE, decode_buffer
from .gpu_records import UNTRACED_EXTERNAL_ID
from .lifecycle import RankStep
from .sm_probe import LaunchFacts

__all__ = ["KernelSpanConfig", "KernelSpanBuilder", "KernelSpanStats", "collective_of",
           "kernel_span_name"]

logger = logging.getLogger(__name__)
_SPAN_NAME_MAX = 160
_COLLECTIVE_MARKER = "nccl"
# NCCL's kernel names say the collective: ncclDevKernel_AllReduce_Sum_bf16_RING_LL(...)
_COLLECTIVES = (("allreduce", "all_reduce"), ("broadcast", "broadcast"),
                ("allgather", "all_gather"), ("reducescatter", "reduce_scatter"))


def collective_of(kernel_name: str) -> str | None:
    """The collective an NCCL kernel runs (``all_reduce``...), or None for other kernels."""
    lowered = kernel_name.lower()
    if _COLLECTIVE_MARKER not in lowered:
        return None
    squashed = lowered.replace("_", "")
    for marker, op in _COLLECTIVES:
        if marker in squashed:
            return op
    return "other"


def kernel_span_name(kernel_name: str, prefix: str = semconv.SPAN_KERNEL_PREFIX) -> str:
    """``kernel <name>``, cut to a length span stores accept (C++ names run to kilobytes)."""
    return (prefix + kernel_name)[:_SPAN_NAME_MAX]


@dataclass(frozen=True)
class KernelSpanConfig:
    detail: Literal["attention", "all"] = "attention"
    attention_markers: tuple[str, ...] = ("fa2", "flash", "attention", "paged_decode")
    settle_s: float = 0.2          # quiet time after a traced step's last joined kernel
    max_wait_s: float = 10.0       # give up waiting for a traced step's records
    max_pending_kernels: int = 1 << 20
    max_correlations: int = 1 << 20

    def __post_init__(self) -> None:
        if self.detail not in ("attention", "all"):
            raise ValueError(f"detail={self.detail!r} is not one of attention|all")
        check_range("max_wait_s", self.max_wait_s, 0.0, 600.0)
        check_range("settle_s", self.settle_s, 0.0, self.max_wait_s, hint="(at most max_wait_s)")


@dataclass
class KernelSpanStats:
    buffers: int = 0
    kernels_seen: int = 0
    kernels_unmatched: int = 0       # no step claimed them (launched outside a traced step)
    kernels_untraced: int = 0        # recorded while CUPTI closed a traced step: not kept
    kernels_dropped: int = 0         # pending beyond max_pending_kernels
    kernel_spans: int = 0
    steps_traced: int = 0
    undecoded_bytes: int = 0
    foreign_correlations: int = 0
    api_calls: int = 0


@dataclass
class _Traced:
    step_id: int
    kernels: list = field(default_factory=list)   # KERNEL_DTYPE arrays
    first_seen: float = 0.0
    last_match: float = 0.0
    collective_bytes: int | None = None   # per all-reduce: a tensor-parallel step


class KernelSpanBuilder:
    """See the module docstring. ``step_span(step_id)`` returns the step's StepTrace (or
    None: unknown or not sampled); ``request_names(pointers)`` asks the engine for the
    names of kernels seen for the first time (answered by :meth:`add_names`)."""

    def __init__(self, telemetry, step_span: Callable[[int], object | None],
                 request_names: Callable[[list[int]], None], gpu_id: int = 0,
                 config: KernelSpanConfig | None = None, rank: int = 0,
                 on_rank: Callable[[RankStep], None] | None = None) -> None:
        self.telemetry = telemetry
        self.config = config or KernelSpanConfig()
        self.step_span = step_span
        self.request_names = request_names
        self.gpu_id = gpu_id
        self.gpu_uuid: str | None = None
        self.rank = rank                  # the tensor-parallel rank whose process recorded these
        self.on_rank = on_rank            # where a traced tensor-parallel step's part goes
        self.stats = KernelSpanStats()
        self.names: dict[int, str] = {}
        self._asked: set[int] = set()
        self._corr = np.zeros(0, np.uint32)       # correlation ids, sorted
        self._ext = np.zeros(0, np.uint64)        # their external ids
        self._api_corr = np.zeros(0, np.uint32)   # launch calls' correlation ids, sorted
        self._api_end = np.zeros(0, np.uint64)    # when each returned
        self._unjoined: list[np.ndarray] = []     # kernels whose correlation is not in yet
        self._unjoined_age = 0
        self._traced: OrderedDict[int, _Traced] = OrderedDict()
        self._facts: dict[int, list[LaunchFacts]] = {}

    # -- inputs ---------------------------------------------------------------------
    def expect_step(self, step_id: int, collective_bytes: int | None = None) -> None:
        """A traced step ended: wait for its kernels. ``collective_bytes``: per all-reduce,
        when the step ran on tensor-parallel ranks."""
        traced = self._traced.get(step_id)
        if traced is None:
            now = time.monotonic()
            traced = self._traced[step_id] = _Traced(step_id, first_seen=now, last_match=now)
        if collective_bytes is not None:
            traced.collective_bytes = int(collective_bytes)

    def expected_steps(self) -> list[tuple[int, int | None]]:
        """The traced steps waited for: (step id, bytes per all-reduce)."""
        return [(t.step_id, t.collective_bytes) for t in self._traced.values()]

    def add_buffer(self, buffer: bytes) -> None:
        decoded = decode_buffer(buffer)
        st = self.stats
        st.buffers += 1
        st.kernels_seen += len(decoded.kernels)
        st.undecoded_bytes += decoded.undecoded_bytes
        st.foreign_correlations += decoded.foreign_correlations
        st.api_calls += decoded.api_calls
        if len(decoded.correlation_ids):
            self._corr, self._ext = _merge_newest(self._corr, self._ext, decoded.correlation_ids,
                                                  decoded.external_ids, self.config.max_correlations)
        if len(decoded.api_correlation_ids):
            # a runtime launch and the driver call under it share an id: the driver record,
            # decoded after the runtime ones, is kept (it returns microseconds earlier)
            self._api_corr, self._api_end = _merge_newest(self._api_corr, self._api_end,
                                                          decoded.api_correlation_ids, decoded.api_end_ns,
                                                          self.config.max_correlations)
        if len(decoded.kernels):
            self._unjoined.append(decoded.kernels)
            new = np.setdiff1d(np.unique(decoded.kernels["name_ptr"]),
                               np.fromiter(self.names.keys() | self._asked, np.uint64))
            if len(new):
                self._asked.update(int(p) for p in new)
                self.request_names([int(p) for p in new])
        self._join()

    def add_names(self, names: dict[int, str]) -> None:
        self.names.update(names)

    def add_launch_facts(self, step_id: int, facts: list[LaunchFacts]) -> None:
        """A traced step's probed launches' facts, for its attention spans."""
        self._facts[step_id] = facts

    # -- joining ----------------------------------------------------------------------
    def _join(self) -> None:
        if not self._unjoined:
            return
        kernels = np.concatenate(self._unjoined)
        self._unjoined = []
        found, ext = _lookup(self._corr, self._ext, kernels["correlation_id"])
        waiting = kernels[~found]
        if len(waiting):
            self._unjoined_age += 1
            if self._unjoined_age <= 50 and len(waiting) <= self.config.max_pending_kernels:
                self._unjoined.append(waiting)        # its correlation record may come later
            else:
                self.stats.kernels_unmatched += len(waiting)
                self._unjoined_age = 0
        else:
            self._unjoined_age = 0
        kernels, ext = kernels[found], ext[found]
        untraced = ext == UNTRACED_EXTERNAL_ID
        if untraced.any():
            self.stats.kernels_untraced += int(untraced.sum())
            kernels, ext = kernels[~untraced], ext[~untraced]
        if not len(kernels):
            return
        now = time.monotonic()
        order = np.argsort(ext, kind="stable")
        kernels, ext = kernels[order], ext[order]
        bounds = np.flatnonzero(np.diff(ext)) + 1
        for group, step_ext in zip(np.split(kernels, bounds), ext[np.r_[0, bounds]]):
            step_id = int(step_ext) - 1
            traced = self._traced.get(step_id)
            if traced is None:                         # its Step event may not be in yet
                traced = _Traced(step_id, first_seen=now)
                self._traced[step_id] = traced
            traced.kernels.append(group)
            traced.last_match = now

    # -- output -----------------------------------------------------------------------
    def poll(self, force: bool = False) -> int:
        """Emits the spans of every settled step; returns how many steps it emitted."""
        self._join()
        now = time.monotonic()
        quiet, limit = self.config.settle_s, self.config.max_wait_s
        done = []
        for step_id, traced in self._traced.items():
            waited = now - traced.first_seen
            settled = traced.kernels and now - traced.last_match >= quiet
            if not (force or settled or waited >= limit):
                continue
            kernels = np.concatenate(traced.kernels) if traced.kernels else np.zeros(0, KERNEL_DTYPE)
            unnamed = [int(p) for p in np.unique(kernels["name_ptr"]) if int(p) not in self.names]
            if unnamed and not force and waited < limit:
                continue                               # names are on their way
            done.append(step_id)
            if len(kernels):
                self._emit(step_id, kernels, traced.collective_bytes)
        for step_id in done:
            del self._traced[step_id]
            self._facts.pop(step_id, None)
        return len(done)

    def _emit(self, step_id: int, kernels: np.ndarray, collective_bytes: int | None = None) -> None:
        step = self.step_span(step_id)
        if step is None:
            self.stats.kernels_unmatched += len(kernels)
            return
        self.stats.steps_traced += 1
        spans = self.telemetry.finished_spans
        parent = step.span_context
        kernels = kernels[np.argsort(kernels["correlation_id"], kind="stable")]
        # when each launch call returned (0: no API record of it)
        _, launch_ends = _lookup(self._api_corr, self._api_end, kernels["correlation_id"])
        names = [self.names.get(int(p), "<unknown>") for p in kernels["name_ptr"]]
        facts_by_name: dict[str, deque[LaunchFacts]] = {}
        for f in self._facts.get(step_id, ()):
            facts_by_name.setdefault(f.kernel_name, deque()).append(f)
        markers = self.config.attention_markers
        every = self.config.detail == "all"
        summaries: dict[str, list[int]] = {}
        collectives: list[tuple[int, str]] = []   # (row, op), launch order
        for i, name in enumerate(names):
            lowered = name.lower()
            op = collective_of(name) if _COLLECTIVE_MARKER in lowered else None
            if op is not None:
                collectives.append((i, op))
                extra = {semconv.COLLECTIVE_OP: op}
                if op == "all_reduce" and collective_bytes is not None:
                    extra[semconv.COLLECTIVE_BYTES] = collective_bytes
                self._span(spans, parent, kernels[i], name, None, extra, int(launch_ends[i]))
            elif every or any(m in lowered for m in markers):
                facts = facts_by_name.get(name)
                self._span(spans, parent, kernels[i], name,
                           facts.popleft() if facts else None, launch_end=int(launch_ends[i]))
            else:
                summaries.setdefault(name, []).append(i)
        if collective_bytes is not None and self.on_rank is not None:
            self._rank_part(step_id, kernels, collectives, collective_bytes)
        for name, rows in summaries.items():
            group = kernels[rows]
            durations = (group["end_ns"] - group["start_ns"]).astype(np.int64)
            attrs = {semconv.CUDA_KERNEL_NAME: name, **self._identity(),
                     semconv.KERNEL_LAUNCHES: len(rows),
                     semconv.KERNEL_TOTAL_DURATION_S: float(durations.sum()) * 1e-9,
                     semconv.KERNEL_MAX_DURATION_S: float(durations.max()) * 1e-9}
            launch_end = int(launch_ends[rows].max())
            if launch_end:
                attrs[semconv.KERNEL_LAUNCH_END_NS] = launch_end
            spans.emit(kernel_span_name(name, semconv.SPAN_KERNEL_SUMMARY_PREFIX),
                       spans.child_context(parent), parent,
                       int(group["start_ns"].min()), int(group["end_ns"].max()), attrs)
            self.stats.kernel_spans += 1

    def _identity(self) -> dict:
        """Where the kernels ran: the GPU's index, its UUID when known, the rank."""
        if self.gpu_uuid:
            return {semconv.HW_GPU_ID: self.gpu_id, semconv.ATTR_GPU_UUID: self.gpu_uuid,
                    semconv.TP_RANK: self.rank}
        return {semconv.HW_GPU_ID: self.gpu_id, semconv.TP_RANK: self.rank}

    def _rank_part(self, step_id: int, kernels: np.ndarray,
                   collectives: list[tuple[int, str]], collective_bytes: int) -> None:
        """This rank's part of a traced tensor-parallel step, from its kernels: the window
        from its first all-reduce's end to its last kernel's end (the sampled ids' broadcast
        after the forward pass left out), and its time in the later all-reduces."""
        # in start order: a graph replay's kernels share one correlation id
        reduces = sorted((i for i, op in collectives if op == "all_reduce"),
                         key=lambda i: int(kernels["start_ns"][i]))
        if not reduces:
            return
        skip = {i for i, op in collectives if op != "all_reduce"}
        rest = [i for i in range(len(kernels)) if i not in skip]
        start = int(kernels["end_ns"][reduces[0]])
        end = int(kernels["end_ns"][rest].max())
        waits = (kernels["end_ns"][reduces[1:]] - kernels["start_ns"][reduces[1:]]).astype(np.int64)
        wait = int(waits.sum())
        window = max(end - start, 0)
        self.on_rank(RankStep(step_id, self.rank, start, end, max(window - wait, 0), wait,
                              len(reduces), collective_bytes))

    def _span(self, spans, parent, k, name: str, facts: LaunchFacts | None,
              extra: dict | None = None, launch_end: int = 0) -> None:
        attrs = {
            semconv.CUDA_KERNEL_NAME: name,
            semconv.CUDA_GRID: f"{k['grid_x']},{k['grid_y']},{k['grid_z']}",
            semconv.CUDA_BLOCK: f"{k['block_x']},{k['block_y']},{k['block_z']}",
            semconv.CUDA_REGISTERS: int(k["registers_per_thread"]),
            semconv.CUDA_SHARED_MEMORY_BYTES: int(k["static_shared_memory"])
            + int(k["dynamic_shared_memory"]),
            semconv.CUDA_STREAM: int(k["stream_id"]),
            semconv.CUDA_CORRELATION_ID: int(k["correlation_id"]),
            **self._identity(),
        }
        if extra:
            attrs.update(extra)
        if launch_end:
            attrs[semconv.KERNEL_LAUNCH_END_NS] = launch_end
        if facts is not None:
            attrs.update({semconv.KERNEL_CTAS: facts.ctas, semconv.KERNEL_SMS_USED: facts.sms_used,
                          semconv.KERNEL_WAVES: facts.waves,
                          semconv.KERNEL_SLOWEST_SM: facts.slowest_sm,
                          semconv.KERNEL_CTA_SPREAD: round(facts.cta_spread, 4)})
        spans.emit(kernel_span_name(name), spans.child_context(parent), parent,
                   int(k["start_ns"]), int(k["end_ns"]), attrs)
        self.stats.kernel_spans += 1


def _merge_newest(ids: np.ndarray, values: np.ndarray, new_ids: np.ndarray, new_values: np.ndarray,
                  limit: int) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` (sorted) and their ``values`` with the new ones merged in: one value per id,
    the newest (a correlation id seen again, as when CUPTI attached anew counts from 1
    again, means the newest record; of equal ids the stable sort puts it last); past
    ``limit`` ids, the newest half is kept."""
    ids, values = np.concatenate([ids, new_ids]), np.concatenate([values, new_values])
    order = np.argsort(ids, kind="stable")
    ids, values = ids[order], values[order]
    last = np.append(ids[1:] != ids[:-1], True)
    ids, values = ids[last], values[last]
    if len(ids) > limit:
        ids, values = ids[-(limit // 2):], values[-(limit // 2):]
    return ids, values


def _lookup(ids: np.ndarray, values: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``wanted``: whether the sorted ``ids`` hold it, and its value (0 if not)."""
    if not len(ids):
        return np.zeros(len(wanted), bool), np.zeros(len(wanted), values.dtype)
    pos = np.clip(np.searchsorted(ids, wanted), 0, len(ids) - 1)
    found = ids[pos] == wanted
    return found, np.where(found, values[pos], 0).astype(values.dtype)
