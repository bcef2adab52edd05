"""The per-SM families of /metrics, written as exposition text in bulk, block by block.

:func:`render_sm_families` writes what grows with the fleet, from
:class:`~.sm_store.BlockSnapshot`s: per (gpu, SM, kernel) the P99 gauge and, opt-in, the
CTA-duration histogram; per (gpu, kernel) the hotspot ratio, the hottest SM and the histogram
over all SMs; the GPU and kernel info gauges. Labels are named and escaped once per block
and values formatted in one pass over its numpy row, where ``prometheus_client`` would build
and format a Sample object per line.
Guarantee: the Prometheus text format 0.0.4, or OpenMetrics 1.0 (exemplars on histogram
buckets, no ``# EOF``: the caller ends the page), as ``prometheus_client``'s parsers read
them: ``# HELP``/``# TYPE`` once per family, its lines together, label names sorted, label
values escaped; a P99 keeps 6 significant digits.
Cost: one formatted string per line and no object per sample.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

from ..instrumentation import semconv as sc
from .hotspot import hottest_sm
from .sm_store import BlockSnapshot, gpu_label, kernel_label
from .windows import ClassicHistogram

__all__ = ["escape_label_value", "render_sm_families"]

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


def _header(name: str, kind: str, help_text: str) -> str:
    doc = help_text.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


class _Block:
    """One block's escaped labels and what the families read of it."""

    __slots__ = ("snap", "gpu", "kernel", "sms")

    def __init__(self, snap: BlockSnapshot, gpu: str, kernel: str) -> None:
        self.snap, self.gpu, self.kernel = snap, gpu, kernel
        joined = "".join(snap.sms)
        # SM labels come from the wire: escaped one by one only when one of them needs it
        self.sms = [escape_label_value(s) for s in snap.sms] if any(c in joined for c in _SPECIAL) else snap.sms


def _histogram_lines(name: str, labels: str, h: ClassicHistogram, les: list[str], openmetrics: bool) -> Iterator[str]:
    """One classic histogram's ``_bucket`` (cumulative), ``_count`` and ``_sum`` lines."""
    cumulative = 0
    for le, n, ex in zip(les, h.counts, h.exemplars):
        cumulative += n
        if openmetrics and ex is not None:
            stamp = f" {ex.time_unix_nano / 1e9}" if ex.time_unix_nano else ""
            yield (f'{name}_bucket{{{labels},le="{le}"}} {float(cumulative)!r} # {{span_id="{ex.span_id.hex()}",'
                   f'{sc.EXEMPLAR_TRACE_ID_LABEL}="{ex.trace_id.hex()}"}} {_number(ex.value)}{stamp}\n')
        else:
            yield f'{name}_bucket{{{labels},le="{le}"}} {float(cumulative)!r}\n'
    yield f"{name}_count{{{labels}}} {float(cumulative)!r}\n"
    yield f"{name}_sum{{{labels}}} {_number(h.sum)}\n"


def render_sm_families(blocks: Iterable[BlockSnapshot], openmetrics: bool) -> bytes:
    """The per-SM families of ``blocks`` (see the module docstring); empty families keep
    their ``# HELP``/``# TYPE`` lines, and the opt-in per-SM histogram appears only when a
    block has it."""
    esc = escape_label_value
    names: dict[str, str] = {}  # kernel -> escaped short label
    gpus: dict[str, tuple[str, str]] = {}  # escaped gpu label -> (instance, gpu.id), escaped
    kernels: list[tuple[str, str]] = []
    view = []
    for snap in blocks:
        instance, gpu, kernel = snap.key
        label = esc(gpu_label(instance, gpu, snap.gpu_index))
        gpus.setdefault(label, (esc(instance), esc(snap.gpu_index)))
        short = names.get(kernel)
        if short is None:
            short = names[kernel] = esc(kernel_label(kernel))
            kernels.append((short, esc(kernel)))
        view.append(_Block(snap, label, short))
    # the Prometheus checker (and bench/collector_scale.py) read labels sorted by name
    p99_name, out = sc.COLLECTOR_SM_CTA_P99_SECONDS, []
    out.append(_header(p99_name, "gauge", "P99 CTA duration per SM over the last gauge window."))
    hot_ratio, hot_sm = [], []
    for b in view:
        prefix = f'{p99_name}{{{sc.LABEL_GPU}="{b.gpu}",{sc.LABEL_KERNEL}="{b.kernel}",{sc.LABEL_SM}="'
        # 6 significant digits ("%g" reads back as the same float as repr of it would): the
        # sketch's own error is 0.5 %, more would be noise (and bytes); NaN: no CTAs, no line
        out.extend(f'{prefix}{sm}"}} {v:.6g}\n' for sm, v in zip(b.sms, b.snap.p99_s.tolist()) if v == v)
        _, ratio, hottest = hottest_sm(b.snap.sms, b.snap.p99_s)
        per_gpu = f'{sc.LABEL_GPU}="{b.gpu}",{sc.LABEL_KERNEL}="{b.kernel}"'
        if ratio is not None:
            hot_ratio.append(f"{sc.COLLECTOR_SM_HOTSPOT_RATIO}{{{per_gpu}}} {_number(ratio)}\n")
            if hottest.isdigit():
                hot_sm.append(f"{sc.COLLECTOR_SM_HOTTEST}{{{per_gpu}}} {float(int(hottest))!r}\n")
    out.append(_header(sc.COLLECTOR_SM_HOTSPOT_RATIO, "gauge",
                       "Slowest SM's P99 CTA duration over the median SM's P99."))
    out.extend(hot_ratio)
    out.append(_header(sc.COLLECTOR_SM_HOTTEST, "gauge", "The SM with the largest P99 CTA duration (its number)."))
    out.extend(hot_sm)
    name = sc.COLLECTOR_GPU_CTA_DURATION_SECONDS
    out.append(_header(name, "histogram", "Duration of each attention CTA, all SMs of a GPU together."))
    for b in view:
        h = b.snap.classic
        les = [repr(float(x)) for x in h.bounds] + ["+Inf"]
        out.extend(_histogram_lines(name, f'{sc.LABEL_GPU}="{b.gpu}",{sc.LABEL_KERNEL}="{b.kernel}"', h, les,
                                    openmetrics))
    out.append(_header(sc.COLLECTOR_GPU_INFO, "gauge", "1 per GPU with per-SM data: its instance and gpu.id."))
    out.extend(f'{sc.COLLECTOR_GPU_INFO}{{{sc.LABEL_GPU}="{gpu}",{sc.LABEL_GPU_INDEX}="{index}",'
               f'{sc.LABEL_INSTANCE_ID}="{instance}"}} 1.0\n' for gpu, (instance, index) in gpus.items())
    out.append(_header(sc.COLLECTOR_SM_KERNEL_INFO, "gauge", "1 per kernel with per-SM data: its whole name."))
    out.extend(f'{sc.COLLECTOR_SM_KERNEL_INFO}{{{sc.LABEL_KERNEL}="{short}",{sc.LABEL_KERNEL_NAME}="{whole}"}} 1.0\n'
               for short, whole in kernels)
    with_sm_hist = [b for b in view if b.snap.classic_sm is not None]
    if with_sm_hist:
        name = sc.COLLECTOR_SM_CTA_DURATION_SECONDS
        out.append(_header(name, "histogram", "Duration of each attention CTA by the SM that ran it (opt-in)."))
        for b in with_sm_hist:
            les = None
            for sm, h in zip(b.sms, b.snap.classic_sm):
                les = les or [repr(float(x)) for x in h.bounds] + ["+Inf"]
                out.extend(_histogram_lines(
                    name, f'{sc.LABEL_GPU}="{b.gpu}",{sc.LABEL_KERNEL}="{b.kernel}",{sc.LABEL_SM}="{sm}"', h, les,
                    openmetrics))
    return "".join(out).encode()
