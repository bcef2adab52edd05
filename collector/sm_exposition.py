"""The per-SM families of /metrics, written as exposition text in bulk, block by block.

:class:`SmPage` writes what grows with the fleet, from :class:`~.sm_store.BlockSnapshot`s:
per (gpu, SM, kernel) the P99 gauge and, opt-in, the CTA-duration histogram; per (gpu,
kernel) the hotspot ratio, the hottest SM, the SMs the contention tests flagged (by reason)
and the histogram over all SMs; per flagged SM only, its contention score; the GPU and
kernel info gauges. Labels are escaped once per block and values formatted in one pass over its
numpy row; each block's lines are kept until its data or its gauge window changes.
Guarantee: the Prometheus text format 0.0.4, or OpenMetrics 1.0 (exemplars on histogram
buckets, no ``# EOF``: the caller ends the page), as ``prometheus_client``'s parsers read
them: ``# HELP``/``# TYPE`` once per family, its lines together, label names sorted, label
values escaped; a P99 keeps 6 significant digits; kept lines are byte for byte what
formatting the block again would give.
Cost of a scrape: one formatted string per line of the blocks written since the last
scrape, a stamp comparison per other block, one join of the page.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

from ..instrumentation import semconv as sc
from .contention import hottest_sm
from .gzip_pieces import deflate_piece
from .sm_store import BlockSnapshot, SmKey, SmStore, gpu_label, kernel_label
from .windows import Exemplar

__all__ = ["SmPage", "escape_label_value"]

_SPECIAL = ("\\", "\n", '"')


def escape_label_value(value: str) -> str:
    """``value`` as it goes between a label's quotes (both formats escape the same three)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    # repr: what prometheus_client writes below 1e6 (it switches to Go's exponent form above), and
    # Prometheus and both prometheus_client parsers read it at any size
    if value == math.inf:
        return "+Inf"
    return repr(float(value))


def _header(name: str, kind: str, help_text: str) -> bytes:
    doc = help_text.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n".encode()


def _histogram_lines(name: str, labels: str, counts: list[int], exemplars: list[Exemplar | None], total: float,
                     les: list[str], openmetrics: bool) -> Iterator[str]:
    """One classic histogram's ``_bucket`` (cumulative), ``_count`` and ``_sum`` lines: its
    ``counts`` per bucket (not cumulative), their ``exemplars`` and the sum ``total``."""
    cumulative = 0
    for le, n, ex in zip(les, counts, exemplars):
        cumulative += n
        if openmetrics and ex is not None:
            stamp = f" {ex.time_unix_nano / 1e9}" if ex.time_unix_nano else ""
            yield (f'{name}_bucket{{{labels},le="{le}"}} {float(cumulative)!r} # {{span_id="{ex.span_id.hex()}",'
                   f'{sc.EXEMPLAR_TRACE_ID_LABEL}="{ex.trace_id.hex()}"}} {_number(ex.value)}{stamp}\n')
        else:
            yield f'{name}_bucket{{{labels},le="{le}"}} {float(cumulative)!r}\n'
    yield f"{name}_count{{{labels}}} {float(cumulative)!r}\n"
    yield f"{name}_sum{{{labels}}} {_number(total)}\n"


class _Lines(NamedTuple):
    """One block's lines of each per-block family, encoded; kept while its stamp holds."""

    stamp: tuple
    p99: bytes
    hot_ratio: bytes
    hot_sm: bytes
    contended: bytes
    contention_score: bytes
    gpu_histogram: bytes
    sm_histogram: bytes | None


def _block_lines(snap: BlockSnapshot, gpu: str, kernel: str, openmetrics: bool) -> _Lines:
    """``snap``'s lines (``gpu`` and ``kernel``: its escaped labels)."""
    joined = "".join(snap.sms)
    # SM labels come from the wire: escaped one by one only when one of them needs it
    sms = [escape_label_value(s) for s in snap.sms] if any(c in joined for c in _SPECIAL) else snap.sms
    per_gpu = f'{sc.LABEL_GPU}="{gpu}",{sc.LABEL_KERNEL}="{kernel}"'
    prefix = f'{sc.COLLECTOR_SM_CTA_P99_SECONDS}{{{per_gpu},{sc.LABEL_SM}="'
    # 6 significant digits ("%g" reads back as the same float as repr of it would): the
    # sketch's own error is 0.5 %, more would be noise (and bytes); NaN: no CTAs, no line
    p99 = "".join(f'{prefix}{sm}"}} {v:.6g}\n' for sm, v in zip(sms, snap.p99_s.tolist()) if v == v)
    _, ratio, hottest = hottest_sm(snap.sms, snap.p99_s)
    hot_ratio = hot_sm = ""
    if ratio is not None:
        hot_ratio = f"{sc.COLLECTOR_SM_HOTSPOT_RATIO}{{{per_gpu}}} {_number(ratio)}\n"
        if hottest.isdigit():
            hot_sm = f"{sc.COLLECTOR_SM_HOTTEST}{{{per_gpu}}} {float(int(hottest))!r}\n"
    found = snap.contended or {}
    contended = "".join(f'{sc.COLLECTOR_SM_CONTENDED}{{{per_gpu},{sc.LABEL_REASON}="{reason}"}} '
                        f"{float(sum(reason in c.reasons for c in found.values()))!r}\n"
                        for reason in sc.CONTENTION_REASONS)
    score_prefix = f'{sc.COLLECTOR_SM_CONTENTION_SCORE}{{{per_gpu},{sc.LABEL_SM}="'
    scores = "".join(f'{score_prefix}{escape_label_value(sm)}"}} {c.score:.6g}\n'
                     for sm, c in sorted(found.items(), key=lambda kv: _sm_order(kv[0])) if c.score is not None)
    h = snap.classic
    les = [repr(float(x)) for x in h.bounds] + ["+Inf"]
    gpu_hist = "".join(_histogram_lines(sc.COLLECTOR_GPU_CTA_DURATION_SECONDS, per_gpu, h.counts, h.exemplars,
                                        h.sum, les, openmetrics))
    sm_hist = None
    if snap.classic_sm is not None:
        name, rows, n = sc.COLLECTOR_SM_CTA_DURATION_SECONDS, snap.classic_sm, len(sms)
        none = [None] * len(les)
        exemplars = rows.row_exemplars(n) if openmetrics else [None] * n  # built only where there are some
        parts = []
        for sm, counts, total, ex in zip(sms, rows.counts[:n].tolist(), rows.sums[:n].tolist(), exemplars):
            parts.extend(_histogram_lines(name, f'{per_gpu},{sc.LABEL_SM}="{sm}"', counts, ex or none, total,
                                          les, openmetrics))
        sm_hist = "".join(parts).encode()
    return _Lines(snap.stamp, p99.encode(), hot_ratio.encode(), hot_sm.encode(), contended.encode(),
                  scores.encode(), gpu_hist.encode(), sm_hist)


def _sm_order(sm: str) -> tuple:
    return (0, int(sm), sm) if sm.isdigit() else (1, 0, sm)


_P99, _GPU_HISTOGRAM, _SM_HISTOGRAM = _Lines._fields.index("p99"), _Lines._fields.index("gpu_histogram"), \
    _Lines._fields.index("sm_histogram")
_BIG = frozenset({_P99, _GPU_HISTOGRAM, _SM_HISTOGRAM})  # the fields kept deflated too


class SmPage:
    """The per-SM families of ``store`` on /metrics (see the module docstring).

    Each block's lines are kept, per format, until its stamp changes (a write, or the gauge
    window taking other slots), so a scrape formats only the blocks written since the one
    before and joins bytes for the rest. Scrapes may run at once: each builds its own
    dict of lines and the last one keeps its dict (no lock; at worst a block is formatted twice).
    """

    def __init__(self, store: SmStore) -> None:
        self._store = store
        self._lines: dict[bool, dict[SmKey, _Lines]] = {False: {}, True: {}}
        # per format, per block: (stamp, deflate pieces of its p99, GPU and SM histogram lines)
        self._deflated: dict[bool, dict[SmKey, tuple]] = {False: {}, True: {}}

    def render(self, now_s: float, openmetrics: bool) -> bytes:
        """The families at ``now_s``: empty ones keep their ``# HELP``/``# TYPE`` lines, and
        the opt-in per-SM histogram appears only when a block has it."""
        return b"".join(text for text, _ in self.pieces(now_s, openmetrics, deflate=False))

    def pieces(self, now_s: float, openmetrics: bool, deflate: bool) -> list[tuple[bytes, bytes | None]]:
        """What ``render`` joins, as ``(text, deflated)`` pieces for :func:`.gzip_pieces.gzip_join`:
        with ``deflate``, each block's larger pieces come with their deflate form, kept
        between scrapes as its lines are (else ``deflated`` is None throughout)."""
        esc = escape_label_value
        known = self._lines[openmetrics]
        lines: dict[SmKey, _Lines] = {}
        names: dict[str, str] = {}  # kernel -> escaped short label
        gpus: dict[str, tuple[str, str]] = {}  # escaped gpu label -> (instance, gpu.id), escaped
        kernels: list[tuple[str, str]] = []
        for snap in self._store.snapshot(now_s, {k: v.stamp for k, v in known.items()}):
            instance, gpu, kernel = snap.key
            label = esc(gpu_label(instance, gpu, snap.gpu_index))
            gpus.setdefault(label, (esc(instance), esc(snap.gpu_index)))
            short = names.get(kernel)
            if short is None:
                short = names[kernel] = esc(kernel_label(kernel))
                kernels.append((short, esc(kernel)))
            lines[snap.key] = _block_lines(snap, label, short, openmetrics) if snap.current else known[snap.key]
        self._lines[openmetrics] = lines
        blocks = lines.values()
        zipped = self._deflate(lines, openmetrics) if deflate else None

        def big(field: int) -> list[tuple[bytes, bytes | None]]:
            if zipped is None:
                return [(b[field], None) for b in blocks]
            return [(b[field], z[field]) for b, z in zip(blocks, zipped) if b[field]]

        def small(texts) -> list[tuple[bytes, None]]:
            return [(text, None) for text in texts]

        # the Prometheus checker (and bench/collector_scale.py) read labels sorted by name
        out = [(_header(sc.COLLECTOR_SM_CTA_P99_SECONDS, "gauge", "P99 CTA duration per SM over the last gauge window."),
                None),
               *big(_P99),
               (_header(sc.COLLECTOR_SM_HOTSPOT_RATIO, "gauge", "Slowest SM's P99 CTA duration over the median SM's P99."),
                None),
               *small(b.hot_ratio for b in blocks),
               (_header(sc.COLLECTOR_SM_HOTTEST, "gauge", "The SM with the largest P99 CTA duration (its number)."), None),
               *small(b.hot_sm for b in blocks),
               (_header(sc.COLLECTOR_SM_CONTENDED, "gauge",
                        "SMs flagged slow or starved against the kernel's other SMs in a slot of the gauge window."),
                None),
               *small(b.contended for b in blocks),
               (_header(sc.COLLECTOR_SM_CONTENTION_SCORE, "gauge",
                        "Per flagged SM: max(its P90 / the other SMs' P90, expected CTAs / its CTAs)."), None),
               *small(b.contention_score for b in blocks),
               (_header(sc.COLLECTOR_GPU_CTA_DURATION_SECONDS, "histogram",
                        "Duration of each attention CTA, all SMs of a GPU together."), None),
               *big(_GPU_HISTOGRAM),
               (_header(sc.COLLECTOR_GPU_INFO, "gauge", "1 per GPU with per-SM data: its instance and gpu.id."), None),
               *small(f'{sc.COLLECTOR_GPU_INFO}{{{sc.LABEL_GPU}="{gpu}",{sc.LABEL_GPU_INDEX}="{index}",'
                      f'{sc.LABEL_INSTANCE_ID}="{instance}"}} 1.0\n'.encode() for gpu, (instance, index) in gpus.items()),
               (_header(sc.COLLECTOR_SM_KERNEL_INFO, "gauge", "1 per kernel with per-SM data: its whole name."), None),
               *small(f'{sc.COLLECTOR_SM_KERNEL_INFO}{{{sc.LABEL_KERNEL}="{short}",{sc.LABEL_KERNEL_NAME}="{whole}"}} 1.0\n'
                      .encode() for short, whole in kernels)]
        if any(b.sm_histogram is not None for b in blocks):
            out.append((_header(sc.COLLECTOR_SM_CTA_DURATION_SECONDS, "histogram",
                                "Duration of each attention CTA by the SM that ran it (opt-in)."), None))
            out.extend(piece for piece in big(_SM_HISTOGRAM) if piece[0] is not None)
        return out

    def _deflate(self, lines: dict[SmKey, _Lines], openmetrics: bool) -> list[tuple]:
        """Per block of ``lines`` (in order): its ``_Lines`` fields' deflate pieces (the big
        ones), kept while its stamp holds."""
        known = self._deflated[openmetrics]
        kept: dict[SmKey, tuple] = {}
        out = []
        for key, b in lines.items():
            z = known.get(key)
            if z is None or z[0] != b.stamp:
                z = tuple(deflate_piece(text) if i in _BIG and text else None for i, text in enumerate(b))
                z = (b.stamp,) + z[1:]
            kept[key] = z
            out.append(z)
        self._deflated[openmetrics] = kept
        return out
