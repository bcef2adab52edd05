"""Per-SM heatmaps of CTA durations, as typed records, JSON and PNG.

Two views per (instance, GPU, kernel), read through :class:`~.query.SmQuery`:

* ``time_sm``: rows are SMs, columns are window slots (``slot_s`` each); a cell is the
  P99 CTA duration of that SM in that slot (``None`` when it ran nothing), within the
  exponential histogram's relative error (0.54 % at scale 6), and the contention tests'
  answer (:mod:`.contention`); an SM flagged starved has a row even if it ran no CTA.
* ``sm_latency``: rows are SMs, columns are latency buckets; a cell is the exact number
  of CTAs whose duration fell in the bucket. The columns are the SMs' own exponential
  buckets coarsened by whole powers of two until at most ``max_bins`` remain, so every
  count is exact (no interpolation) and bucket ``j`` covers ``(edges[j], edges[j + 1]]``.

Both carry the hotspot summary and the GPU's admission refusal (limits left series out).
Cost: one vectorised P99 and one contention pass per slot over the block's SMs.
"""

from __future__ import annotations

import io
import math
import time
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Literal

import numpy as np

from ..instrumentation import ExpHistogram, check_range, fit_shift, relative_error
from .contention import HotspotSummary, contended_sms, hotspots
from .query import SmQuery
from .sm_store import GpuKey, SmKey

__all__ = ["HeatmapKind", "HotspotSummary", "SmLatencyHeatmap", "TimeSmHeatmap", "finite", "render_png",
           "sm_latency", "time_sm"]

HeatmapKind = Literal["time_sm", "sm_latency"]


@dataclass
class TimeSmHeatmap:
    instance: str
    gpu: str
    kernel: str
    slot_s: float
    times_unix_s: list[float]  # start of each column's slot
    sms: list[str]
    p99_s: list[list[float | None]]  # [sm][time]
    counts: list[list[int]]  # [sm][time]
    exemplars: list[list[dict | None]]  # slowest CTA's step span, where known
    hotspot: HotspotSummary
    relative_error: float
    # per column: slowest SM's P99 / median SM's P99 in that slot (None: no CTAs)
    hotspot_ratio_by_time: list[float | None] = field(default_factory=list)
    refusal: dict | None = None  # the limit that left some of this GPU's series out
    # per cell: the contention score (None: no test) and what flagged it: "slow", "starved",
    # "slow+starved" or None (collector/contention.py)
    contention_score: list[list[float | None]] = field(default_factory=list)  # [sm][time]
    contention: list[list[str | None]] = field(default_factory=list)  # [sm][time]
    # SMs flagged in any slot: sm -> {score, reasons, slots_flagged, slots}
    contended: dict[str, dict] = field(default_factory=dict)
    num_sms: int = 0  # the GPU's SM count as its data shows it (the share test's S)
    kind: str = "time_sm"

    def to_dict(self) -> dict:
        return _as_dict(self)


@dataclass
class SmLatencyHeatmap:
    instance: str
    gpu: str
    kernel: str
    window_s: float
    sms: list[str]
    edges_s: list[float]  # len(columns) + 1; column j is (edges[j], edges[j+1]]
    counts: list[list[int]]  # [sm][bucket]
    zero_counts: list[int]  # per SM, durations of exactly zero (clock granularity)
    hotspot: HotspotSummary
    relative_error: float
    refusal: dict | None = None
    kind: str = "sm_latency"

    def to_dict(self) -> dict:
        return _as_dict(self)


def _as_dict(record) -> dict:
    # finite() builds new lists and dicts all the way down: asdict's deep copy of the grids
    # would be a second one (most of a query's CPU), so only nested records go through it
    return finite({f.name: asdict(v) if is_dataclass(v) else v
                   for f in fields(record) for v in (getattr(record, f.name),)})


def finite(value):
    """``value`` with every NaN or infinity replaced by None (strict JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        out = []
        for v in value:  # a grid's cells inline, without a call each
            kind = type(v)
            if v is None or kind is int or kind is str:
                out.append(v)
            elif kind is float:
                out.append(v if v - v == 0.0 else None)  # NaN and infinities give NaN
            else:
                out.append(finite(v))
        return out
    return value


def _sm_sort_key(sm: str) -> tuple:
    return (0, int(sm), sm) if sm.lstrip("-").isdigit() else (1, 0, sm)


def _window_hotspots(per_sm: dict[str, ExpHistogram]) -> HotspotSummary:
    return hotspots({sm: h.quantile(0.99) for sm, h in per_sm.items() if h.count})


def _refusal(sm: SmQuery, key: SmKey) -> dict | None:
    refusal = sm.refusal(GpuKey(key.instance, key.gpu))
    return refusal._asdict() if refusal is not None else None


def time_sm(sm: SmQuery, key: SmKey, now_s: float | None = None,
            window_s: float | None = None) -> TimeSmHeatmap:
    """The time x SM P99 heatmap of one kernel on one GPU (see the module docstring)."""
    wc = sm.window
    now_s = sm.now() if now_s is None else now_s
    window_s = wc.horizon_s if window_s is None else min(window_s, wc.horizon_s)
    names, scale, cells = sm.slot_cells(key, now_s, window_s)
    tests = dict(sm.contention(key, now_s, window_s))
    num_sms = sm.num_sms(GpuKey(key.instance, key.gpu))
    newest = wc.epoch(now_s)
    n = max(1, int(math.ceil(window_s / wc.slot_s)))
    epochs = list(range(newest - n + 1, newest + 1))
    column = {e: i for i, e in enumerate(epochs)}
    flagged = contended_sms([t for e, t in tests.items() if e in column])
    # SMs with CTAs in the window, and those flagged starved there (which may have run none)
    shown = {names[r] for r in range(len(names)) if any(cell[2][r] for cell in cells)} | set(flagged)
    order = sorted(shown, key=_sm_sort_key)
    row_of = {sm: i for i, sm in enumerate(order)}
    block_row = {sm: r for r, sm in enumerate(names)}
    p99: list[list[float | None]] = [[None] * n for _ in order]
    counts = [[0] * n for _ in order]
    exemplars: list[list[dict | None]] = [[None] * n for _ in order]
    scores: list[list[float | None]] = [[None] * n for _ in order]
    marks: list[list[str | None]] = [[None] * n for _ in order]
    by_time: list[float | None] = [None] * n
    for epoch, slot_p99, slot_count, slot_ex, _ in cells:
        c = column.get(epoch)
        if c is None:
            continue
        for i, sm_name in enumerate(order):
            r = block_row.get(sm_name)
            if r is not None and slot_count[r]:
                p99[i][c] = float(slot_p99[r])
                counts[i][c] = int(slot_count[r])
                ex = slot_ex[r]
                if ex["value"] == ex["value"]:
                    exemplars[i][c] = {"trace_id": bytes(ex["trace_id"]).ljust(16, b"\0").hex(),
                                       "span_id": bytes(ex["span_id"]).ljust(8, b"\0").hex(),
                                       "value_s": float(ex["value"])}
        by_time[c] = hotspots({order[i]: p99[i][c] for i in range(len(order)) if p99[i][c] is not None}).ratio
        test = tests.get(epoch)
        for j, sm_name in enumerate(test.sms if test is not None else ()):
            i = row_of.get(sm_name)
            if i is None:
                continue
            score = float(test.score[j])
            scores[i][c] = score if math.isfinite(score) else None
            marks[i][c] = "+".join(test.reasons(j)) or None
    return TimeSmHeatmap(instance=key.instance, gpu=key.gpu, kernel=key.kernel, slot_s=wc.slot_s,
                         times_unix_s=[e * wc.slot_s for e in epochs], sms=order, p99_s=p99,
                         counts=counts, exemplars=exemplars,
                         hotspot=_window_hotspots(sm.histograms(key, now_s, window_s)),
                         relative_error=relative_error(scale) if order else 0.0,
                         hotspot_ratio_by_time=by_time, refusal=_refusal(sm, key),
                         contention_score=scores, contention=marks,
                         contended={k: asdict(v) for k, v in flagged.items()}, num_sms=num_sms)


def sm_latency(sm: SmQuery, key: SmKey, now_s: float | None = None,
               window_s: float | None = None, max_bins: int = 48) -> SmLatencyHeatmap:
    """The SM x latency-bucket count heatmap (exact counts; see the module docstring)."""
    check_range("max_bins", max_bins, 2, 1024, integer=True)
    wc = sm.window
    now_s = sm.now() if now_s is None else now_s
    window_s = wc.horizon_s if window_s is None else min(window_s, wc.horizon_s)
    per_sm = sm.histograms(key, now_s, window_s)
    sms = sorted((s for s, h in per_sm.items() if h.count), key=_sm_sort_key)
    hists = [per_sm[s] for s in sms]
    with_buckets = [h for h in hists if np.any(h.counts)]
    if not with_buckets:
        return SmLatencyHeatmap(key.instance, key.gpu, key.kernel, window_s, sms, [], [[] for _ in sms],
                                [h.zero_count for h in hists], _window_hotspots(per_sm), 0.0, _refusal(sm, key))
    scale = min(h.scale for h in with_buckets)
    lo = min(((h.offset + int(np.flatnonzero(h.counts)[0])) >> (h.scale - scale)) for h in with_buckets)
    hi = max(((h.offset + int(np.flatnonzero(h.counts)[-1])) >> (h.scale - scale)) for h in with_buckets)
    shift = fit_shift(lo, hi, max_bins)
    out_scale, first, last = scale - shift, lo >> shift, hi >> shift
    counts = []
    width = last - first + 1
    for h in hists:
        nz = np.flatnonzero(h.counts)
        if not nz.size:
            counts.append([0] * width)
            continue
        idx = (h.offset + nz) >> (h.scale - out_scale)
        if h.count < 2 ** 53:  # float sums of integer counts stay exact
            # bincount, not np.add.at: ufunc.at lets go of the GIL, and a query then waits for
            # the ingest threads to give it back, once per SM
            row = np.bincount(idx - first, weights=h.counts[nz], minlength=width)
        else:
            row = np.zeros(width, dtype=np.int64)
            np.add.at(row, idx - first, h.counts[nz])
        counts.append([int(v) for v in row.tolist()])
    step = 2.0 ** -out_scale
    edges = [float(2.0 ** (j * step)) for j in range(first, last + 2)]
    return SmLatencyHeatmap(key.instance, key.gpu, key.kernel, window_s, sms, edges, counts,
                            [h.zero_count for h in hists], _window_hotspots(per_sm),
                            relative_error(scale), _refusal(sm, key))


# -- PNG ------------------------------------------------------------------------------------
# Viridis anchor colours (perceptually uniform, colour-blind safe), interpolated linearly.
_VIRIDIS = np.array([(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)],
                    dtype=np.float64)
_EMPTY = (235, 235, 235)
_SLOW, _STARVED = (214, 39, 40), (31, 119, 180)  # outlines of contended cells, as the page draws them


def colour(t: float) -> tuple[int, int, int]:
    """Viridis colour of ``t`` in [0, 1]."""
    t = min(1.0, max(0.0, t)) * (len(_VIRIDIS) - 1)
    i = min(int(t), len(_VIRIDIS) - 2)
    c = _VIRIDIS[i] + (_VIRIDIS[i + 1] - _VIRIDIS[i]) * (t - i)
    return int(round(c[0])), int(round(c[1])), int(round(c[2]))


def _font(size: int):
    """Pillow's built-in font at ``size`` px.

    Why not the plain default: on Pillow >= 10.1 with FreeType it is a 10 px outline font
    whose space advances 2 px, which hinting swallows ("P99 CTAduration, GPU0"); from 12 px
    the space is 3 px and word gaps show. Pillow 10.0 takes no size (its bitmap font
    spaces words well enough)."""
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow 10.0
        return ImageFont.load_default()


def render_png(heatmap: TimeSmHeatmap | SmLatencyHeatmap) -> bytes:
    """A PNG of either heatmap: rows SMs, colour viridis (log scale for counts)."""
    from PIL import Image, ImageDraw

    if isinstance(heatmap, TimeSmHeatmap):
        grid = heatmap.p99_s
        title = f"P99 CTA duration, GPU {heatmap.gpu}, {heatmap.kernel[:60]}"
        transform = lambda v: v  # noqa: E731
    else:
        grid = [[(v if v else None) for v in row] for row in heatmap.counts]
        title = f"CTA count by duration, GPU {heatmap.gpu}, {heatmap.kernel[:60]}"
        transform = math.log10
    rows = len(grid)
    cols = max((len(r) for r in grid), default=0)
    values = [transform(v) for row in grid for v in row if v is not None]
    vmin, vmax = (min(values), max(values)) if values else (0.0, 1.0)
    span = (vmax - vmin) or 1.0
    cell_w = max(3, min(40, 900 // max(cols, 1)))
    cell_h = max(2, min(12, 660 // max(rows, 1)))
    left, top, right, bottom = 56, 28, 90, 24
    width = left + cell_w * max(cols, 1) + right
    height = top + cell_h * max(rows, 1) + bottom
    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    words = _font(12)  # text with spaces in it; row and scale labels keep the 10 px default
    draw.text((4, 6), title, fill=(0, 0, 0), font=words)
    marks = heatmap.contention if isinstance(heatmap, TimeSmHeatmap) else []
    for r, row in enumerate(grid):
        y = top + r * cell_h
        for c, v in enumerate(row):
            x = left + c * cell_w
            fill = _EMPTY if v is None else colour((transform(v) - vmin) / span)
            # a contended cell: outlined red (slow) or blue (starved, also when it ran nothing)
            mark = marks[r][c] if r < len(marks) and c < len(marks[r]) else None
            outline = None if not mark else _SLOW if "slow" in mark else _STARVED
            draw.rectangle([x, y, x + cell_w - 1, y + cell_h - 1], fill=fill, outline=outline)
        if rows <= 40 or r % max(1, rows // 20) == 0:
            draw.text((4, y), f"SM {heatmap.sms[r]}", fill=(0, 0, 0))
    bar_x = left + cell_w * max(cols, 1) + 12
    bar_h = cell_h * max(rows, 1)
    for i in range(bar_h):
        draw.line([bar_x, top + i, bar_x + 14, top + i], fill=colour(1.0 - i / max(bar_h - 1, 1)))
    if isinstance(heatmap, TimeSmHeatmap) and heatmap.times_unix_s:
        first = time.strftime("%H:%M:%S", time.gmtime(heatmap.times_unix_s[0]))
        last = time.strftime("%H:%M:%S", time.gmtime(heatmap.times_unix_s[-1]))
        axis = f"time (UTC, {heatmap.slot_s:g} s slots) {first} .. {last}"
    elif isinstance(heatmap, SmLatencyHeatmap) and heatmap.edges_s:
        axis = f"CTA duration {heatmap.edges_s[0] * 1e6:.3g} us .. {heatmap.edges_s[-1] * 1e6:.3g} us (log)"
    else:
        axis = ""
    draw.text((left, top + cell_h * max(rows, 1) + 4), axis, fill=(0, 0, 0), font=words)
    unit = "s" if isinstance(heatmap, TimeSmHeatmap) else "log10 n"
    draw.text((bar_x + 18, top), f"{vmax:.3g}", fill=(0, 0, 0))
    draw.text((bar_x + 18, top + bar_h - 10), f"{vmin:.3g}", fill=(0, 0, 0))
    draw.text((bar_x + 18, top + bar_h // 2), unit, fill=(0, 0, 0), font=words)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
