"""Per-(SM, kernel) CTA-duration histograms accumulated ON THE GPU, read at export time.

Why on the device: an attention-heavy step of an 8B model probes tens of thousands of CTAs,
and bucketing them on the host would compete with the engine thread for the GIL. Here a
batch of steps (``add_steps``) costs about thirty small torch ops on the GPU whatever its
size (issued from the telemetry worker thread on its own stream, ordered after the steps by
an event); the host touches the dense table once per export interval.

Layout: a dense int64 table ``[kernels * num_sms + 1, NB]`` of OpenTelemetry exponential
buckets at one ``scale`` (default 6: quantiles within 0.54 %) over ``[2**min_exp, 2**max_exp)``
seconds (outside: clamped, counted in ``clamped``); the last row takes idle CTAs, never
exported. Per row: zero count, sum, min, max, slowest CTA. Memory: ``(K * num_sms + 1) * NB *
8`` bytes (18 MiB for 8 kernels on 132 SMs). ``take()`` equals ``ExpHistogram(scale)`` of the
same durations when nothing clamped; ``take_launch_mix()`` counts the CTAs of launches that
spread their work, ``take_dealt()`` the same CTAs on the SMs the GPU's dispatch deals them.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from .config_checks import check_range
from .exphist import ExpHistogram
from .host_copy import to_device, to_host
from .semconv import WIDE_LAUNCH_WAVES
from .sm_probe import RECORD_WORDS, SmExemplar

__all__ = ["DeviceCtaHistograms"]

_STEP_BITS = 20                              # steps per add_steps call < 2**20
_STEP_MASK = (1 << _STEP_BITS) - 1
_MAX_DUR_NS = (1 << (62 - _STEP_BITS)) - 1   # ~73 min: durations clamp here (never reached)


_NO_MIN = (1 << 63) - 1    # min_ns of a row with no CTA yet

def torch_bucket_indices(values: torch.Tensor, scale: int) -> torch.Tensor:
    """``exphist.bucket_indices`` in torch (float64, positive values, scale > 0)."""
    mantissa, exponent = torch.frexp(values)
    exact_pow2 = mantissa == 0.5
    idx = torch.ceil(torch.log2(values) * (2.0 ** scale)).to(torch.int64) - 1
    pow2_idx = ((exponent.to(torch.int64) - 1) << scale) - 1
    return torch.where(exact_pow2, pow2_idx, idx)


class DeviceCtaHistograms:
    """See the module docstring. ``add`` (enqueue only) and ``take`` from one thread."""

    def __init__(self, device, gpu_id: int, num_sms: int, scale: int = 6, min_exp: int = -30,
                 max_exp: int = 4, max_kernels: int = 8) -> None:
        check_range("scale", scale, 1, 10, integer=True)
        check_range("min_exp", min_exp, -math.inf, max_exp, integer=True, hi_open=True,
                    hint="(below max_exp)")
        check_range("num_sms", num_sms, 1, 4096, integer=True)
        self.device = torch.device(device)
        self.gpu_id, self.num_sms, self.scale = gpu_id, num_sms, scale
        self.max_kernels = max_kernels
        self.lo = min_exp << scale                    # bucket index of column 0
        self.nb = (max_exp - min_exp) << scale
        self.rows = max_kernels * num_sms + 1         # last row: idle / unknown kernels
        z = dict(device=self.device)
        self.table = torch.zeros(self.rows * self.nb, dtype=torch.int64, **z)
        self.zeros = torch.zeros(self.rows, dtype=torch.int64, **z)
        self.count = torch.zeros(self.rows, dtype=torch.int64, **z)
        self.sum = torch.zeros(self.rows, dtype=torch.float64, **z)
        # min/max in integer ns: 64-bit integer atomics are native on the GPU, float64
        # min/max are compare-and-swap loops that contend on a few hundred rows
        self.min_ns = torch.full((self.rows,), _NO_MIN, dtype=torch.int64, **z)
        self.max_ns = torch.full((self.rows,), -1, dtype=torch.int64, **z)
        self.best = torch.full((self.rows,), float("-inf"), dtype=torch.float64, **z)
        self.best_seq = torch.zeros(self.rows, dtype=torch.int64, **z)
        self.clamped = torch.zeros((), dtype=torch.int64, **z)
        self._names: dict[str, int] = {}
        self._name_list: list[str] = []
        self._steps: dict[int, tuple[int, int, int]] = {}   # seq -> (trace, span, time)
        self._seq = 0
        self._lock = threading.Lock()
        # per kernel index (the last: unknown kernels), the CTAs that ran: of wide launches
        # (>= WIDE_LAUNCH_WAVES x num_sms CTAs, or a rotating kernel's), and of all launches
        self.wide_ran = torch.zeros(max_kernels + 1, dtype=torch.int64, **z)
        self.all_ran = torch.zeros(max_kernels + 1, dtype=torch.int64, **z)
        # per row: CTAs the GPU's dispatch deals that SM (instrumentation/dispatch_order.py)
        self.dealt = torch.zeros(self.rows, dtype=torch.int64, **z)
        self._deal: torch.Tensor | None = None   # DispatchDeal.flat on the device
        # kernels that rotate their work over their CTAs (SmProbe.rotating): their launches of
        # at most one wave count as wide too
        self.rotating: set[str] = set()
        self.kernels_dropped = 0                      # launches of kernels past max_kernels
        self.clamped_total = 0                        # durations outside the bucket range

    def set_dispatch_deal(self, deal) -> None:
        """Where the idle GPU puts each CTA of a launch (``dispatch_order.DispatchDeal``);
        from now on ``take_dealt`` counts, per (SM, kernel), the CTAs the deal gives it.
        ``None``: no deal is counted."""
        if deal is not None and deal.num_sms != self.num_sms:
            raise ValueError(f"a dispatch deal for {deal.num_sms} SMs on a GPU of {self.num_sms}")
        self._deal = None if deal is None else torch.as_tensor(np.array(deal.flat, dtype=np.int64),
                                                               device=self.device)

    def _kernel_index(self, name: str) -> int:
        k = self._names.get(name)
        if k is None:
            if len(self._name_list) >= self.max_kernels:
                self.kernels_dropped += 1
                return -1
            k = self._names[name] = len(self._name_list)
            self._name_list.append(name)
        return k

    def add(self, records: torch.Tensor, launches: list[tuple[str, int]], trace_id: int,
            span_id: int, time_unix_nano: int) -> None:
        """Enqueues the reduction of one step's records ([n * 3] int64 on the device, in
        launch order) on the current stream. No host sync."""
        self.add_steps([(records, launches, trace_id, span_id, time_unix_nano)])

    def add_steps(self, steps: list[tuple[torch.Tensor, list[tuple[str, int]], int, int, int]]
                  ) -> None:
        """``add`` for several steps at once: the same ~30 torch ops whatever the number of
        steps, so the worker's Python cost per step shrinks with the batch."""
        parts, kidx, counts, step_local, wide = [], [], [], [], []
        with self._lock:
            base = self._seq + 1
            for i, (records, launches, trace_id, span_id, t_ns) in enumerate(steps):
                n = sum(c for _, c in launches)
                if n == 0:
                    continue
                self._seq += 1
                self._steps[self._seq] = (trace_id, span_id, t_ns)
                parts.append(records[: n * RECORD_WORDS])
                for name, c in launches:
                    k = self._kernel_index(name)
                    kidx.append(k)
                    counts.append(c)
                    step_local.append(self._seq - base)
                    wide.append(int(c >= WIDE_LAUNCH_WAVES * self.num_sms
                                    or (name in self.rotating and c <= self.num_sms)))
        if not parts:
            return
        n = sum(counts)
        rec = (parts[0] if len(parts) == 1 else torch.cat(parts)).view(n, RECORD_WORDS)
        # per launch on the host (a few hundred numbers), expanded per CTA on the device:
        # expanding millions of CTAs on the host would cost the worker's CPU and the GIL
        starts = np.cumsum([0] + counts[:-1]).tolist()   # each launch's first record
        per_launch = to_device([kidx, step_local, starts, counts, wide], torch.int64, self.device)
        per_cta = torch.repeat_interleave(per_launch, per_launch[3], dim=1, output_size=n)
        kernel, local = per_cta[0], per_cta[1]
        sm = rec[:, 0]
        ok = (sm >= 0) & (sm < self.num_sms) & (kernel >= 0)
        idle_row = self.rows - 1
        idle = torch.full_like(sm, idle_row)
        row = torch.where(ok, kernel * self.num_sms + sm, idle)
        # the launch mix counts the CTAs that ran, as the histograms do (not idle ones)
        unknown = torch.full_like(kernel, self.max_kernels)
        ones = torch.ones_like(sm)
        self.all_ran.index_add_(0, torch.where(ok, kernel, unknown), ones)
        self.wide_ran.index_add_(0, torch.where(ok & (per_cta[4] > 0), kernel, unknown), ones)
        if self._deal is not None:
            # where the deal puts each CTA that ran: whole rounds as a launch of S CTAs, the
            # rest as a launch of that many (DispatchDeal.sms_of)
            s, index, grid = self.num_sms, torch.arange(n, device=rec.device) - per_cta[2], per_cta[3]
            rest = grid % s
            full = grid - rest
            at = torch.where(index < full, s * (s - 1) // 2 + index % s,
                             rest * (rest - 1) // 2 + index - full)
            dealt_sm = self._deal[at]
            self.dealt.index_add_(0, torch.where(ok, kernel * self.num_sms + dealt_sm, idle), ones)
        dur_ns = (rec[:, 2] - rec[:, 1]).clamp(0, _MAX_DUR_NS)
        dur = dur_ns.to(torch.float64) * 1e-9
        positive = dur > 0
        safe = torch.where(positive, dur, torch.ones_like(dur))
        col = torch_bucket_indices(safe, self.scale) - self.lo
        out_of_range = positive & ((col < 0) | (col >= self.nb))
        col = col.clamp(0, self.nb - 1)
        # zero durations go to the idle row's column 0 (never exported) and to ``zeros``
        flat = torch.where(positive, row * self.nb + col, torch.full_like(row, idle_row * self.nb))
        self.table.index_add_(0, flat, torch.ones_like(flat))
        self.zeros.index_add_(0, row, (~positive).to(torch.int64))
        self.count.index_add_(0, row, ones)
        self.sum.index_add_(0, row, dur)
        self.min_ns.scatter_reduce_(0, row, dur_ns, reduce="amin")
        self.max_ns.scatter_reduce_(0, row, dur_ns, reduce="amax")
        # the slowest CTA per row and its step, in one reduction: duration in the high bits,
        # the step's index in this batch in the low bits (inverted: on a tie the earlier
        # step wins, as it does across calls)
        enc = (dur_ns << _STEP_BITS) | (_STEP_MASK - local)
        top = torch.full_like(self.best_seq, -1).scatter_reduce_(0, row, enc, reduce="amax")
        top_s = (top >> _STEP_BITS).to(torch.float64) * 1e-9
        better = (top >= 0) & (top_s > self.best)
        self.best = torch.where(better, top_s, self.best)
        self.best_seq = torch.where(better, base + _STEP_MASK - (top & _STEP_MASK), self.best_seq)
        self.clamped += out_of_range.sum()

    def take_launch_mix(self) -> dict[tuple[int, str], tuple[int, int]]:
        """Per (gpu, kernel) since the last call, of the CTAs that ran (``take``'s counts):
        (those of wide launches, all), wide meaning at least ``WIDE_LAUNCH_WAVES`` times as
        many CTAs as the GPU has SMs, or at most as many of a kernel in ``rotating`` (its
        work lands on other SMs at each launch). Waits for the current stream (``to_host``)."""
        wide, total = to_host(self.wide_ran, self.all_ran)
        self.wide_ran.zero_()
        self.all_ran.zero_()
        with self._lock:
            names = list(self._name_list)
        return {(self.gpu_id, names[k]): (int(wide[k]), int(total[k])) for k in np.flatnonzero(total[:-1])}

    def take_dealt(self) -> dict[tuple[int, int, str], int] | None:
        """Per (gpu, SM, kernel) since the last call: the CTAs that ran, counted on the SM
        the dispatch deal gives them (the same CTAs as ``take``'s counts, kernel by
        kernel); None while no deal is set. Waits for the current stream (``to_host``)."""
        if self._deal is None:
            return None
        (dealt,) = to_host(self.dealt)
        self.dealt.zero_()
        with self._lock:
            names = list(self._name_list)
        out = {}
        for r in np.flatnonzero(dealt[:-1]):
            k, sm = divmod(int(r), self.num_sms)
            out[(self.gpu_id, sm, names[k])] = int(dealt[r])
        return out

    def take(self) -> tuple[dict[tuple[int, int, str], ExpHistogram],
                            dict[tuple[int, int, str], SmExemplar]]:
        """Everything since the last take (delta), as host objects; resets the device state.
        Waits for the current stream (``to_host``; call it from the telemetry worker)."""
        # copies even of CPU tensors (reset below), all in one wait
        table, zeros, count, total, low, high, best, best_seq, clamped = to_host(
            self.table.view(self.rows, self.nb), self.zeros, self.count, self.sum, self.min_ns, self.max_ns,
            self.best, self.best_seq, self.clamped)
        low, high = low * 1e-9, high * 1e-9
        self.clamped_total += int(clamped)
        for t in (self.table, self.zeros, self.count, self.sum, self.best_seq, self.clamped):
            t.zero_()
        self.min_ns.fill_(_NO_MIN)
        self.max_ns.fill_(-1)
        self.best.fill_(float("-inf"))
        with self._lock:
            steps, self._steps = self._steps, {}
            names = list(self._name_list)
        hists, exemplars = {}, {}
        for r in np.flatnonzero(count[:-1]):
            k, sm = divmod(int(r), self.num_sms)
            key = (self.gpu_id, sm, names[k])
            nz = np.flatnonzero(table[r])
            if nz.size:
                first, last = int(nz[0]), int(nz[-1])
                counts = table[r, first:last + 1].copy()
            else:
                first, counts = 0, np.zeros(0, dtype=np.int64)
            h = ExpHistogram(scale=self.scale)
            h.add_buckets(self.scale, self.lo + first, counts, int(zeros[r]), int(count[r]),
                          float(total[r]), float(low[r]), float(high[r]))
            hists[key] = h
            trace, span, t_ns = steps.get(int(best_seq[r]), (0, 0, 0))
            if np.isfinite(best[r]):
                exemplars[key] = SmExemplar(float(best[r]), t_ns, trace, span)
        return hists, exemplars
