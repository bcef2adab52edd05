"""What an incident capture shows about its planted neighbour, read offline (no GPU, no torch).

For each planted interval: the per-SM CTA-duration exports that lie inside it, straddle it or
lie outside it, and in each class the CTAs and per-SM P99 of every probed kernel on the
planted SMs against the other SMs; the engine steps that overlapped it (longest step, time
without a step starting); the attention kernel spans' ``sms_used``; the export cadence.
Then the demo's own finding: the capture replayed into an in-process aggregator, the
time x SM heatmaps built and the planted SMs scored against the flagged ones
(deploy/incident.py). Guarantee: every figure is computed from the capture's records with
the collector's own histogram and replay code; P99s are within the histograms' relative
error. Cost: two passes over the capture (about 10 s for a 2 MB, 3-minute capture).

    python -m bench.incident_analysis CAPTURE [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from sightline.collector.otlp_points import cta_point_histogram
from sightline.deploy.incident import Incident, find, probe_heatmaps
from sightline.instrumentation import semconv as sc
from sightline.instrumentation.capture import read_capture, read_capture_meta
from sightline.instrumentation.exphist import ExpHistogram

__all__ = ["ExportWindow", "analyse", "evaluate", "export_windows",
           "interval_report", "step_report"]

_MAX_BUCKETS = 4096


@dataclass
class ExportWindow:
    """One per-SM metrics export: the span its delta points cover (capture time, ns) and,
    per kernel, per SM, the CTA-duration histogram."""

    start_ns: int
    end_ns: int
    written_ns: int
    per_kernel: dict[str, dict[int, ExpHistogram]] = field(default_factory=dict)


def export_windows(capture: Path) -> list[ExportWindow]:
    """The capture's CTA-duration exports in file order (delta points: each covers
    ``[start, end]``; a cumulative capture would need differencing, refused here)."""
    windows = []
    for signal, written_ns, request in read_capture(capture, ("metrics",)):
        window = None
        for rm in request.resource_metrics:
            for scope in rm.scope_metrics:
                for metric in scope.metrics:
                    if metric.name != sc.METRIC_CTA_DURATION or metric.WhichOneof("data") != "exponential_histogram":
                        continue
                    if metric.exponential_histogram.aggregation_temporality != 1:
                        raise ValueError(f"{capture}: cumulative CTA histograms; this analysis reads delta ones")
                    for point in metric.exponential_histogram.data_points:
                        attrs = {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in point.attributes}
                        if window is None:
                            window = ExportWindow(point.start_time_unix_nano, point.time_unix_nano, written_ns)
                        window.start_ns = min(window.start_ns, point.start_time_unix_nano)
                        window.end_ns = max(window.end_ns, point.time_unix_nano)
                        hist = cta_point_histogram(point, _MAX_BUCKETS)
                        per_sm = window.per_kernel.setdefault(str(attrs[sc.ATTR_KERNEL_NAME]), {})
                        sm = int(attrs[sc.ATTR_SM_ID])
                        if sm in per_sm:
                            per_sm[sm].merge(hist)
                        else:
                            per_sm[sm] = hist
        if window is not None:
            windows.append(window)
    return windows


def _p99_summary(per_sm: dict[int, ExpHistogram], sms: set[int]) -> dict:
    """CTAs and the median (over SMs) of per-SM P99 for the SMs in ``sms`` that ran any."""
    hists = [h for sm, h in per_sm.items() if sm in sms and h.count]
    p99 = [h.quantile(0.99) for h in hists]
    return {"sms_with_ctas": len(hists), "ctas": sum(h.count for h in hists),
            "median_sm_p99_us": statistics.median(p99) * 1e6 if p99 else None,
            "max_sm_p99_us": max(p99) * 1e6 if p99 else None}


def _merge(windows: list[ExportWindow]) -> dict[str, dict[int, ExpHistogram]]:
    out: dict[str, dict[int, ExpHistogram]] = {}
    for w in windows:
        for kernel, per_sm in w.per_kernel.items():
            into = out.setdefault(kernel, {})
            for sm, h in per_sm.items():
                if sm in into:
                    into[sm].merge(h)
                else:
                    into[sm] = h.copy()
    return out


def _overlap(w: ExportWindow, start_ns: int, end_ns: int) -> float:
    return max(0, min(w.end_ns, end_ns) - max(w.start_ns, start_ns)) / max(1, w.end_ns - w.start_ns)


def interval_report(windows: list[ExportWindow], intervals: list[tuple[int, int]], index: int,
                    planted: set[int], num_sms: int, t0_ns: int) -> dict:
    """Per class of export window (inside: at least 90 % of its span in interval ``index``;
    straddling: more than 10 % but less; outside: at most 10 % in every interval), per kernel:
    CTAs and per-SM P99 on the planted SMs against the others."""
    classes: dict[str, list[ExportWindow]] = {"inside": [], "straddling": [], "outside": []}
    start_ns, end_ns = intervals[index]
    for w in windows:
        overlap = _overlap(w, start_ns, end_ns)
        if overlap >= 0.9:
            classes["inside"].append(w)
        elif overlap > 0.1:
            classes["straddling"].append(w)
        elif all(_overlap(w, a, b) <= 0.1 for a, b in intervals):
            classes["outside"].append(w)
    others = set(range(num_sms)) - planted
    out = {}
    for name, members in classes.items():
        merged = _merge(members)
        kernels = {}
        for kernel, per_sm in sorted(merged.items()):
            p, o = _p99_summary(per_sm, planted), _p99_summary(per_sm, others)
            total = p["ctas"] + o["ctas"]
            kernels[kernel] = {
                "planted": p, "others": o,
                # the planted SMs' share of the CTAs, and the share they would have if CTAs spread evenly
                "planted_cta_share": p["ctas"] / total if total else None,
                "even_share": len(planted) / num_sms,
                "p99_ratio": (p["median_sm_p99_us"] / o["median_sm_p99_us"]
                              if p["median_sm_p99_us"] and o["median_sm_p99_us"] else None)}
        out[name] = {"windows_s": [[round((w.start_ns - t0_ns) / 1e9, 3), round((w.end_ns - t0_ns) / 1e9, 3)]
                                   for w in members], "kernels": kernels}
    return out


def _attr(span, key: str, default=None):
    for kv in span.attributes:
        if kv.key == key:
            return getattr(kv.value, kv.value.WhichOneof("value"))
    return default


def step_report(capture: Path, intervals: list[tuple[int, int]], t0_ns: int, long_step_s: float = 0.5) -> dict:
    """Engine steps and attention kernel spans, inside each interval and outside all of them."""
    steps, launches = [], []
    for _, _, request in read_capture(capture, ("traces",)):
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    if span.name == sc.SPAN_ENGINE_STEP:
                        steps.append((span.start_time_unix_nano, span.end_time_unix_nano, span.span_id))
                    elif span.name.startswith(sc.SPAN_KERNEL_PREFIX) and _attr(span, sc.KERNEL_SMS_USED) is not None:
                        launches.append((span.start_time_unix_nano, span.name[len(sc.SPAN_KERNEL_PREFIX):],
                                         int(_attr(span, sc.KERNEL_SMS_USED)), span.parent_span_id))
    steps.sort()

    def rel(t: int) -> float:
        return round((t - t0_ns) / 1e9, 3)

    def summary(lo: int, hi: int, inside) -> dict:
        chosen = [s for s in steps if inside(s)]
        starts = [s[0] for s in chosen]
        gaps = [b - a for a, b in zip([lo] + starts, starts + [hi])] if hi > lo else []
        longest = max(chosen, key=lambda s: s[1] - s[0], default=None)
        sms_used: dict[str, list[int]] = {}
        for t, kernel, used, _ in launches:
            if inside((t, t)):
                sms_used.setdefault(kernel, []).append(used)
        longest_step = None
        if longest is not None:
            longest_step = {"start_s": rel(longest[0]), "end_s": rel(longest[1]),
                            "duration_s": round((longest[1] - longest[0]) / 1e9, 3)}
            # a traced step's attention launches: where in the step the time went
            own = sorted(t for t, _, _, parent in launches if parent == longest[2])
            if len(own) > 1:
                a, b = max(zip(own, own[1:]), key=lambda ab: ab[1] - ab[0])
                longest_step["attention_launches"] = len(own)
                longest_step["widest_gap_between_attention_launches_s"] = [rel(a), rel(b)]
        return {"steps": len(chosen),
                "busy_s": round(sum(s[1] - s[0] for s in chosen) / 1e9, 3),
                "longest_step": longest_step,
                "longest_time_without_a_step_start_s": round(max(gaps) / 1e9, 3) if gaps else None,
                "steps_over_s": {str(long_step_s): sum(s[1] - s[0] > long_step_s * 1e9 for s in chosen)},
                "attention_launch_spans_sms_used": {
                    k: {"launches": len(v), "min": min(v), "median": statistics.median(v), "max": max(v)}
                    for k, v in sorted(sms_used.items())}}

    out = {"intervals": [summary(a, b, lambda s, a=a, b=b: s[0] < b and s[1] > a) for a, b in intervals]}
    first, last = (steps[0][0], steps[-1][1]) if steps else (0, 0)
    out["outside"] = summary(first, last, lambda s: all(s[1] <= a or s[0] >= b for a, b in intervals))
    out["outside"]["longest_time_without_a_step_start_s"] = None  # spans the intervals: not meaningful
    return out


def evaluate(capture: Path, incident: Incident) -> dict:
    """The demo's finding, computed in-process: replay (slot-aligned, as the demo's), heatmaps,
    planted vs flagged SMs."""
    import time

    from sightline.collector.aggregator import Aggregator
    from sightline.collector.explain import explain_slowest
    from sightline.collector.replay import AggregatorSink, ReplayConfig, replay

    now_ns = time.time_ns()
    aggregator = Aggregator(clock=lambda: now_ns / 1e9)
    aligned = ReplayConfig(speed=0.0, align_slot_s=aggregator.config.window.slot_s)
    result = replay(capture, AggregatorSink(aggregator), aligned, clock_ns=lambda: now_ns)
    heatmaps = probe_heatmaps(aggregator)
    findings = find(incident, heatmaps, result.time_map)
    slowest = explain_slowest(aggregator, 0.99, 3).to_dict()
    return {"findings": [f.to_dict() for f in findings],
            "hotspot_ratio": {h["kernel"]: h["hotspot"]["ratio"] for h in heatmaps},
            "columns_with_data": {h["kernel"]: sum(any(row[c] is not None for row in h["p99_s"])
                                                   for c in range(len(h["times_unix_s"]))) for h in heatmaps},
            "slowest": [{"trace_id": r["trace_id"], "e2e_s": r["e2e_s"], "slowest_sm": r.get("slowest_sm")}
                        for r in slowest.get("requests", [])],
            "exports": result.exports, "spans": result.spans, "data_points": result.data_points}


def analyse(capture: Path) -> dict:
    """Everything above, as one JSON-ready dict; times in seconds from the capture's first export."""
    incident = Incident.from_meta(read_capture_meta(capture))
    if incident is None:
        raise ValueError(f"{capture}: no incident metadata (bench/record_incident.py writes it)")
    windows = export_windows(capture)
    first = next(iter(read_capture(capture)), None)  # decodes the first record only
    t0_ns = first.time_unix_nano if first is not None else incident.intervals[0].start_unix_nano
    written = [w.written_ns for w in windows]
    gaps = [round((b - a) / 1e9, 3) for a, b in zip(written, written[1:])]
    report = {
        "capture": str(capture), "t0_unix_nano": t0_ns,
        "exports": {"count": len(windows), "written_s": [round((t - t0_ns) / 1e9, 3) for t in written],
                    "gaps_s": gaps,
                    "sms_per_export": [{k: len(v) for k, v in w.per_kernel.items()} for w in windows]},
        "intervals": []}
    spans = [(i.start_unix_nano, i.end_unix_nano) for i in incident.intervals]
    for index, interval in enumerate(incident.intervals):
        report["intervals"].append({
            "start_s": round((interval.start_unix_nano - t0_ns) / 1e9, 3),
            "end_s": round((interval.end_unix_nano - t0_ns) / 1e9, 3),
            "planted_sms": len(interval.sms),
            "by_export_window": interval_report(windows, spans, index, set(interval.sms), incident.num_sms, t0_ns)})
    report["steps"] = step_report(capture, spans, t0_ns)
    report["finding"] = evaluate(capture, incident)
    return report


def format_report(report: dict) -> str:
    """The report's main tables as text (the JSON holds everything)."""
    lines = [f"exports written at (s): {report['exports']['written_s']}", f"gaps (s): {report['exports']['gaps_s']}"]
    for n, (iv, st) in enumerate(zip(report["intervals"], report["steps"]["intervals"]), start=1):
        lines.append(f"interval {n}: {iv['start_s']} .. {iv['end_s']} s, {iv['planted_sms']} planted SMs")
        for cls, body in iv["by_export_window"].items():
            for kernel, k in body["kernels"].items():
                p, o = k["planted"], k["others"]
                lines.append(f"  {cls:10s} {kernel:24s} CTAs planted {p['ctas']:>9d} "
                             f"(share {_f(k['planted_cta_share'])}, even {k['even_share']:.3f}) "
                             f"others {o['ctas']:>9d}; median SM P99 us planted {_f(p['median_sm_p99_us'])} "
                             f"others {_f(o['median_sm_p99_us'])} ratio {_f(k['p99_ratio'])}")
        lines.append(f"  steps: {json.dumps(st)}")
    lines.append(f"steps outside: {json.dumps(report['steps']['outside'])}")
    for f in report["finding"]["findings"]:
        lines.append(f"finding {f['kernel']}: planted {len(f['planted'])}, flagged contended {len(f['flagged'])} "
                     f"(precision {_f(f['precision'])}, recall {_f(f['recall'])}) in {f['slots']} slots")
    return "\n".join(lines)


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("capture", type=Path)
    ap.add_argument("--json", type=Path, default=None, help="also write the whole report here")
    args = ap.parse_args(argv)
    report = analyse(args.capture)
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
