"""One GPU's per-SM CTA-duration windows for one kernel, as dense numpy blocks.

A :class:`SmBlock` holds every SM of one (instance, gpu, kernel). Its SM rows share one
bucket scale, and each time slot shares one bucket offset, so merging a batch of points,
a P99 for every SM, or re-binning is one numpy operation over the block.

Accuracy: a quantile is the value at rank ``ceil(q * count)`` within
``relative_error(scale)`` (0.54 % at scale 6); a slot whose SMs span more than
``max_buckets`` buckets halves the block's resolution, and ``scale`` says so.
Memory per SM: ``detail_slots * width * 4`` bytes of counts (``width``: buckets the
block's SMs span in a slot) plus ``num_slots * 88`` bytes of per-slot summaries (P99,
count, slowest exemplar, the contention tests' evidence), which is all that older slots keep.
Not thread-safe: the owner (:class:`~.sm_store.SmStore`) holds its lock around each call.
"""

from __future__ import annotations

import numpy as np

from ..instrumentation import ExpHistogram, fit_shift, quantiles, rebin
from .contention import REFERENCE_QUANTILE, SlotEvidence, slot_evidence
from .classic_rows import EXEMPLAR_DTYPE, ClassicRows
from .windows import ClassicHistogram, Exemplar

__all__ = ["SmBlock"]

_ROW_STEP = 16  # SM rows added at least at a time
# an SM's usual shares of CTAs (SmBlock._usual_shares): from this many other slots with at
# least this many wide CTAs per SM
USUAL_SLOTS = 4
USUAL_SHARE_MIN_CTAS = 4
QUIET_EXCEED = 0.3   # the slow test's effect floor (ContentionConfig.slow_share's default)
QUIET_SLOW_SHARE = 0.05   # a quiet slot: at most this share of SMs that far above the P90
_EX_DTYPE = EXEMPLAR_DTYPE


class _Detail:
    """One slot's full-resolution buckets of every SM row."""

    __slots__ = ("epoch", "offset", "counts", "zeros", "sums", "minimum", "maximum", "evidence")

    def __init__(self, epoch: int, rows: int) -> None:
        self.epoch = epoch
        self.offset = 0
        self.counts = np.zeros((rows, 0), dtype=np.uint32)
        self.zeros = np.zeros(rows, dtype=np.int64)
        self.sums = np.zeros(rows)
        self.minimum = np.full(rows, np.inf)
        self.maximum = np.full(rows, -np.inf)
        self.evidence: SlotEvidence | None = None  # kept until the slot is written again


class SmBlock:
    """The SMs of one (instance, gpu, kernel); see the module docstring."""

    def __init__(self, num_slots: int, detail_slots: int, scale: int, max_buckets: int,
                 bounds: tuple[float, ...], per_sm_classic: bool, serial: int = 0) -> None:
        self.serial = serial  # its owner's count of blocks made: tells a block from its successor
        self.sms: list[str] = []
        self.rows: dict[str, int] = {}
        self.scale = scale
        self.max_buckets = max_buckets
        self.num_slots, self.detail_slots = num_slots, detail_slots
        self.newest_epoch = -1
        self.version = 0  # changes with every write, so readers can keep what they derived
        self._detail: list[_Detail | None] = [None] * detail_slots
        self._cap = 0
        self.s_epoch = np.full(num_slots, -1, dtype=np.int64)
        self.s_p99 = np.zeros((num_slots, 0))
        self.s_count = np.zeros((num_slots, 0), dtype=np.int64)
        self.s_ex = np.zeros((num_slots, 0), dtype=_EX_DTYPE)
        # what collector/contention.py tests, kept when a slot's buckets are let go
        self.s_exceed = np.zeros((num_slots, 0), dtype=np.int64)
        self.s_q = np.zeros((num_slots, 0))  # own reference quantile
        self.s_others_q = np.zeros((num_slots, 0))
        self.s_wide = np.full(num_slots, -1, dtype=np.int64)  # CTAs of wide launches (-1: not told)
        # per SM: CTAs the GPU's dispatch order dealt it (semconv.METRIC_CTA_DEALT), if told
        self.s_dealt = np.zeros((num_slots, 0), dtype=np.int64)
        self.s_dealt_told = np.zeros(num_slots, dtype=bool)
        self.total = np.zeros(0, dtype=np.int64)  # CTAs per SM since the block began
        self.classic = ClassicHistogram(bounds)  # all SMs together
        self.classic_sm: ClassicRows | None = ClassicRows(bounds) if per_sm_classic else None  # a row per SM

    # -- rows -----------------------------------------------------------------------
    def row(self, sm: str) -> int:
        """The row of ``sm``, added when new (the caller checked admission)."""
        r = self.rows.get(sm)
        if r is None:
            self.version += 1
            r = self.rows[sm] = len(self.sms)
            self.sms.append(sm)
            if r >= self._cap:
                # half as many again (at least _ROW_STEP): each row's arrays are copied O(1)
                # times amortised however many SM ids arrive; at most a third of them unused
                self._grow(self._cap + max(_ROW_STEP, self._cap // 2))
        return r

    def _grow(self, cap: int) -> None:
        extra = cap - self._cap

        def wider(a: np.ndarray, fill, axis: int) -> np.ndarray:
            pad = [(0, 0)] * a.ndim
            pad[axis] = (0, extra)
            return np.pad(a, pad, constant_values=fill)

        for d in self._detail:
            if d is not None:
                d.counts = wider(d.counts, 0, 0)
                d.zeros, d.sums = wider(d.zeros, 0, 0), wider(d.sums, 0.0, 0)
                d.minimum, d.maximum = wider(d.minimum, np.inf, 0), wider(d.maximum, -np.inf, 0)
        if self.classic_sm is not None:
            self.classic_sm.resize(cap)
        self.s_p99 = wider(self.s_p99, np.nan, 1)
        self.s_count = wider(self.s_count, 0, 1)
        self.s_dealt = wider(self.s_dealt, 0, 1)
        self.s_ex = np.concatenate([self.s_ex, np.zeros((self.num_slots, extra), dtype=_EX_DTYPE)], axis=1)
        self.s_ex["value"][:, self._cap:] = np.nan
        self.s_exceed = wider(self.s_exceed, 0, 1)
        self.s_q, self.s_others_q = wider(self.s_q, np.nan, 1), wider(self.s_others_q, np.nan, 1)
        self.total = wider(self.total, 0, 0)
        self._cap = cap

    # -- writing --------------------------------------------------------------------
    def accepts(self, epoch: int) -> bool:
        """False when ``epoch`` is older than the full-resolution slots (a late point)."""
        return epoch > self.newest_epoch - self.detail_slots

    def merge(self, epoch: int, rows: list[int], hists: list[ExpHistogram],
              exemplars: list[Exemplar | None]) -> None:
        """Adds ``hists[i]`` to SM row ``rows[i]`` in slot ``epoch`` (``accepts(epoch)`` held)."""
        self.version += 1
        finest = min(h.scale for h in hists)
        if finest < self.scale:
            self._downscale(self.scale - finest)
        detail = self._slot(epoch)
        detail.evidence = None
        added = self._add_buckets(detail, rows, hists)
        rows_a = np.asarray(rows, dtype=np.int64)
        count = np.array([h.count for h in hists], dtype=np.int64)
        zeros = np.array([h.zero_count for h in hists], dtype=np.int64)
        sums = np.array([h.sum for h in hists])
        np.add.at(detail.zeros, rows_a, zeros)
        np.add.at(detail.sums, rows_a, sums)
        np.minimum.at(detail.minimum, rows_a, [h.min for h in hists])
        np.maximum.at(detail.maximum, rows_a, [h.max for h in hists])
        s = epoch % self.num_slots
        np.add.at(self.s_count[s], rows_a, count)
        np.add.at(self.total, rows_a, count)
        slowest = None
        for r, h, ex in zip(rows, hists, exemplars):
            if ex is not None:
                if not ex.value <= self.s_ex["value"][s, r]:  # NaN (none yet) or slower
                    self.s_ex[s, r] = (ex.value, ex.trace_id, ex.span_id, ex.time_unix_nano)
                if slowest is None or ex.value > slowest.value:
                    slowest = ex
            if self.classic_sm is not None:
                self.classic_sm.add_exp(r, h, ex)
        # the batch over all SMs, for the per-GPU classic histogram
        offset, counts = added if added is not None else (0, np.zeros(0, dtype=np.int64))
        self.classic.add_exp(ExpHistogram(scale=self.scale, offset=offset, counts=counts,
                                          zero_count=int(zeros.sum()), count=int(count.sum()),
                                          sum=float(sums.sum())), slowest)

    def add_wide(self, epoch: int, ctas: int) -> bool:
        """Adds CTAs of wide launches (semconv.METRIC_CTA_WIDE) to slot ``epoch``; False
        when the block holds no such slot (its CTAs never arrived, or it was let go)."""
        s = epoch % self.num_slots
        if self.s_epoch[s] != epoch:
            return False
        self.version += 1
        self.s_wide[s] = max(0, self.s_wide[s]) + ctas
        return True

    def add_dealt(self, epoch: int, row: int, ctas: int) -> bool:
        """Adds CTAs the dispatch order dealt SM ``row`` (semconv.METRIC_CTA_DEALT) to slot
        ``epoch``; False when the block holds no such slot."""
        s = epoch % self.num_slots
        if self.s_epoch[s] != epoch:
            return False
        self.version += 1
        self.s_dealt[s, row] += ctas
        self.s_dealt_told[s] = True
        return True

    def _add_buckets(self, detail: _Detail, rows: list[int],
                     hists: list[ExpHistogram]) -> tuple[int, np.ndarray] | None:
        """Adds the points' buckets to ``detail``; returns the batch summed over SMs as
        ``(offset, counts)`` at the block's scale (None: no buckets). Cost: O(buckets in the
        batch + rows it touches x width), whatever the block's size."""
        with_buckets = [(r, h) for r, h in zip(rows, hists) if h.counts.size]
        if not with_buckets:
            return None
        sizes = np.array([h.counts.size for _, h in with_buckets])
        starts = np.cumsum(sizes) - sizes
        # every bucket's index at its point's scale, then (a right shift) at the block's
        index = (np.repeat([h.offset for _, h in with_buckets], sizes) + np.arange(int(sizes.sum()))
                 - np.repeat(starts, sizes))
        point_scales = np.repeat([h.scale for _, h in with_buckets], sizes)
        values = np.concatenate([h.counts for _, h in with_buckets]).astype(np.float64)
        point_rows = np.repeat([r for r, _ in with_buckets], sizes)
        at_scale = index >> (point_scales - self.scale)
        lo, hi = int(at_scale.min()), int(at_scale.max()) + 1
        if detail.counts.shape[1]:
            lo, hi = min(lo, detail.offset), max(hi, detail.offset + detail.counts.shape[1])
        shift = fit_shift(lo, hi - 1, self.max_buckets)
        if shift:
            self._downscale(shift)
            at_scale, lo, hi = at_scale >> shift, lo >> shift, ((hi - 1) >> shift) + 1
        width = hi - lo
        if (lo, width) != (detail.offset, detail.counts.shape[1]):
            grown = np.zeros((self._cap, width), dtype=np.uint32)
            if detail.counts.shape[1]:
                start = detail.offset - lo
                grown[:, start:start + detail.counts.shape[1]] = detail.counts
            detail.counts, detail.offset = grown, lo
        touched, local = np.unique(point_rows, return_inverse=True)
        added = np.bincount(local * width + (at_scale - lo), weights=values,
                            minlength=touched.size * width).reshape(touched.size, width)
        detail.counts[touched] += added.astype(np.uint32)
        return lo, added.sum(axis=0).astype(np.int64)

    def _slot(self, epoch: int) -> _Detail:
        """The detail slot of ``epoch``, taking the ring position of an older one."""
        i = epoch % self.detail_slots
        d = self._detail[i]
        if d is None or d.epoch != epoch:
            if d is not None and d.epoch >= 0:
                self._summarise(d)
            d = self._detail[i] = _Detail(epoch, self._cap)
            s = epoch % self.num_slots
            if self.s_epoch[s] != epoch:
                self.s_epoch[s] = epoch
                self.s_p99[s] = np.nan
                self.s_count[s] = 0
                self.s_ex[s] = np.zeros(self._cap, dtype=_EX_DTYPE)
                self.s_ex["value"][s] = np.nan
                self.s_exceed[s], self.s_q[s], self.s_others_q[s] = 0, np.nan, np.nan
                self.s_wide[s] = -1
                self.s_dealt[s], self.s_dealt_told[s] = 0, False
        if epoch > self.newest_epoch:
            self.newest_epoch = epoch
        return d

    def _summarise(self, d: _Detail) -> None:
        """Keeps only a leaving detail slot's per-SM P99 and contention evidence (its count
        and exemplar are kept)."""
        s = d.epoch % self.num_slots
        if self.s_epoch[s] == d.epoch:
            self.s_p99[s] = self._p99(d)
            e = self._evidence(d)
            self.s_exceed[s], self.s_q[s], self.s_others_q[s] = e.exceed, e.own_q, e.others_q

    def _evidence(self, d: _Detail) -> SlotEvidence:
        """The slot's contention evidence, kept until it is written again (a scrape then
        computes it only for the slots written since the last one)."""
        if d.evidence is None or len(d.evidence.ctas) != d.counts.shape[0]:
            own_q = quantiles(self.scale, d.offset, d.counts, d.zeros, d.minimum, d.maximum, REFERENCE_QUANTILE)
            d.evidence = slot_evidence(self.scale, d.offset, d.counts, d.zeros, d.minimum, d.maximum, own_q)
        return d.evidence

    def _p99(self, d: _Detail) -> np.ndarray:
        return quantiles(self.scale, d.offset, d.counts, d.zeros, d.minimum, d.maximum, 0.99)

    def _downscale(self, shift: int) -> None:
        for d in self._detail:
            if d is not None:
                d.counts, d.offset = rebin(d.counts, d.offset, shift)
                d.evidence = None
        self.scale -= shift

    # -- reading --------------------------------------------------------------------
    def _details(self, first_epoch: int, last_epoch: int) -> list[_Detail]:
        return sorted((d for d in self._detail if d is not None and first_epoch <= d.epoch <= last_epoch),
                      key=lambda d: d.epoch)

    def stamp(self, first_epoch: int, last_epoch: int) -> tuple:
        """Equal for two calls exactly when ``p99``, ``classic`` and ``classic_sm`` over the
        range would answer the same: the writes so far and the slots the range takes."""
        return self.serial, self.version, tuple(sorted(d.epoch for d in self._detail
                                          if d is not None and first_epoch <= d.epoch <= last_epoch))

    def merged(self, first_epoch: int, last_epoch: int) -> _Detail | None:
        """The full-resolution slots in ``[first_epoch, last_epoch]``, added (None if none)."""
        found = self._details(first_epoch, last_epoch)
        if not found:
            return None
        with_buckets = [d for d in found if d.counts.shape[1]]
        out = _Detail(last_epoch, self._cap)
        if with_buckets:
            lo = min(d.offset for d in with_buckets)
            hi = max(d.offset + d.counts.shape[1] for d in with_buckets)
            out.offset = lo
            out.counts = np.zeros((self._cap, hi - lo), dtype=np.int64)
            for d in with_buckets:
                out.counts[:, d.offset - lo:d.offset - lo + d.counts.shape[1]] += d.counts
        for d in found:
            out.zeros += d.zeros
            out.sums += d.sums
            np.minimum(out.minimum, d.minimum, out=out.minimum)
            np.maximum(out.maximum, d.maximum, out=out.maximum)
        return out

    def p99(self, first_epoch: int, last_epoch: int) -> np.ndarray:
        """Per SM row: P99 over the full-resolution slots in the range (NaN: no CTAs)."""
        merged = self.merged(first_epoch, last_epoch)
        if merged is None:
            return np.full(len(self.sms), np.nan)
        return self._p99(merged)[:len(self.sms)]

    def histograms(self, first_epoch: int, last_epoch: int) -> dict[str, ExpHistogram]:
        """Per SM with CTAs in the range: its merged full-resolution histogram."""
        merged = self.merged(first_epoch, last_epoch)
        if merged is None:
            return {}
        out = {}
        for r, sm in enumerate(self.sms):
            counts = merged.counts[r].astype(np.int64)
            total = int(counts.sum()) + int(merged.zeros[r])
            if total:
                out[sm] = ExpHistogram(scale=self.scale, max_buckets=max(self.max_buckets, counts.size),
                                       offset=merged.offset, counts=counts, zero_count=int(merged.zeros[r]),
                                       count=total, sum=float(merged.sums[r]), min=float(merged.minimum[r]),
                                       max=float(merged.maximum[r]))
        return out

    def _slots(self, first_epoch: int, last_epoch: int) -> list[tuple[int, int, _Detail | None]]:
        """``(epoch, ring position, detail slot or None)`` of each slot in the range, oldest first."""
        details = {d.epoch: d for d in self._details(first_epoch, last_epoch)}
        return [(int(self.s_epoch[s]), int(s), details.get(int(self.s_epoch[s])))
                for s in np.argsort(self.s_epoch) if first_epoch <= self.s_epoch[s] <= last_epoch]

    def _slot_evidence(self, s: int, d: _Detail | None, quiet: tuple[np.ndarray, np.ndarray]) -> SlotEvidence:
        n = len(self.sms)
        wide = int(self.s_wide[s]) if self.s_wide[s] >= 0 else None
        usual = self._usual_shares(s, *quiet)
        dealt = self.s_dealt[s, :n].copy() if self.s_dealt_told[s] else None
        if d is not None:
            e = self._evidence(d)
            return SlotEvidence(self.s_count[s, :n].copy(), e.exceed[:n], e.own_q[:n], e.others_q[:n], wide, usual,
                                dealt)
        return SlotEvidence(self.s_count[s, :n].copy(), self.s_exceed[s, :n].copy(), self.s_q[s, :n].copy(),
                            self.s_others_q[s, :n].copy(), wide, usual, dealt)

    def _quiet_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """(which ring slots are quiet, each slot's per-SM share of CTAs above the others' P90).
        Quiet: at least ``USUAL_SHARE_MIN_CTAS`` wide CTAs per SM, and at most
        ``QUIET_SLOW_SHARE`` of the SMs with ``QUIET_EXCEED`` of their CTAs above the others'
        P90 (no neighbour on a group of SMs). Read once per query, for all its slots."""
        n = len(self.sms)
        counts = self.s_count[:, :n]
        totals = counts.sum(axis=1)
        wide = np.where(self.s_wide >= 0, self.s_wide, totals)
        quiet = (self.s_epoch >= 0) & (wide >= USUAL_SHARE_MIN_CTAS * max(n, 1)) & (totals > 0)
        exceed_share = np.full(counts.shape, np.nan)
        details = {d.epoch: d for d in self._detail if d is not None}
        for j in np.flatnonzero(quiet).tolist():
            d = details.get(int(self.s_epoch[j]))
            exceed = self._evidence(d).exceed[:n] if d is not None else self.s_exceed[j, :n]
            busy = counts[j] >= USUAL_SHARE_MIN_CTAS   # a few CTAs say little of their SM
            exceed_share[j, busy] = exceed[busy] / counts[j][busy]
            if (exceed_share[j, busy] >= QUIET_EXCEED).sum() > QUIET_SLOW_SHARE * n:
                quiet[j] = False
        return quiet, exceed_share

    def _usual_shares(self, s: int, quiet: np.ndarray, exceed_share: np.ndarray) -> np.ndarray:
        """[3, SMs]: each SM's share of the kernel's CTAs over the ring's quiet slots other
        than ``s`` (:meth:`_quiet_slots`), its median and its lowest, and the median share of
        its CTAs above the others' P90 there (collector/contention.py reads them); NaN while
        fewer than ``USUAL_SLOTS`` qualify (not known yet: the even split stands)."""
        n = len(self.sms)
        use = quiet.copy()
        use[s] = False
        if int(use.sum()) < USUAL_SLOTS or not n:
            return np.full((3, n), np.nan)
        counts = self.s_count[use, :n]
        shares = counts / counts.sum(axis=1)[:, None]
        with np.errstate(all="ignore"):
            usual_exceed = np.nanmedian(exceed_share[use], axis=0) if np.isfinite(exceed_share[use]).any() \
                else np.full(n, np.nan)
        return np.stack([np.median(shares, axis=0), shares.min(axis=0), usual_exceed])

    def slot_evidence(self, first_epoch: int, last_epoch: int) -> list[tuple[int, SlotEvidence]]:
        """``(epoch, contention evidence)`` of each slot in the range with CTAs, oldest first."""
        quiet = self._quiet_slots()
        return [(epoch, self._slot_evidence(s, d, quiet)) for epoch, s, d in self._slots(first_epoch, last_epoch)]

    def slot_cells(self, first_epoch: int, last_epoch: int) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray,
                                                                          SlotEvidence]]:
        """``(epoch, p99 per SM, count per SM, exemplar per SM, contention evidence)`` of each
        slot in the range with CTAs, oldest first (full-resolution slots answer their exact P99)."""
        n, quiet = len(self.sms), self._quiet_slots()
        return [(epoch, self._p99(d)[:n] if d is not None else self.s_p99[s, :n], self.s_count[s, :n],
                 self.s_ex[s, :n], self._slot_evidence(s, d, quiet))
                for epoch, s, d in self._slots(first_epoch, last_epoch)]

    def nbytes(self) -> int:
        total = sum(d.counts.nbytes + 24 * d.zeros.size for d in self._detail if d is not None)
        return (total + self.s_p99.nbytes + self.s_count.nbytes + self.s_ex.nbytes + self.total.nbytes
                + self.s_exceed.nbytes + self.s_q.nbytes + self.s_others_q.nbytes + self.s_wide.nbytes
                + self.s_dealt.nbytes + self.s_dealt_told.nbytes)
