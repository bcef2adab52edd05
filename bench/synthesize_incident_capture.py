"""Makes a SYNTHETIC incident capture from a measured one: what the demo runs until a
recorded H200 incident capture (bench/record_incident.py) is committed.

The measured ``--source`` capture is tiled: a copy starts every ``--period-s`` seconds until
``--duration-s``, each with its own trace and span ids. Then an incident is planted, and
nothing of it is measured: in each ``--interval`` a seeded set of ``--planted-sms`` SMs has
its per-SM CTA durations multiplied by ``--slowdown``, and copies starting there run
``--stretch`` times slower, their attention kernel spans naming a planted SM as slowest.
Guarantee: the metadata line (deploy/incident.py, ``synthetic: true``) says all of this, and
the demo prints it as synthetic, never as measured; links, parents and exemplars stay
consistent across the new ids. Cost: one pass over the source per copy; non-attention
kernel spans are kept in one copy of ``--keep-kernels-every`` only.

    python -m bench.synthesize_incident_capture     # writes deploy/captures/synthetic-...
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
import sys
from pathlib import Path

from sightline.collector.replay import metric_points, rebase_request
from sightline.deploy.incident import interval_s, Incident, PlantedInterval
from sightline.instrumentation import semconv as sc
from sightline.instrumentation.capture import CaptureWriter, read_capture

_ROOT = Path(__file__).resolve().parent.parent
SOURCE = _ROOT / "deploy" / "captures" / "h200-20261130-http.jsonl.gz"
TARGET = _ROOT / "deploy" / "captures" / "synthetic-h200-noisy-neighbour.jsonl.gz"
ATTENTION_KERNELS = ("sightline_fa2_prefill", "sightline_paged_decode")


def _new_id(old: bytes, copy: int) -> bytes:
    # A keyed hash of the source id: the same id maps alike wherever it appears in one copy,
    # so links, parents and exemplars stay consistent.
    if not old or copy == 0 or not any(old):
        return old
    return hashlib.blake2b(old, digest_size=len(old), key=copy.to_bytes(4, "big")).digest()


def _attr(attributes, key: str):
    for kv in attributes:
        if kv.key == key:
            return kv
    return None


class _Copy:
    """Maps one copy's times and ids, and plants the incident's effects in it."""

    def __init__(self, index: int, src_t0: int, start_ns: int, stretch: float,
                 interval_at, keep_other_kernels: bool, slowdown: float) -> None:
        self.index, self.src_t0, self.start_ns, self.stretch = index, src_t0, start_ns, stretch
        self.interval_at = interval_at  # capture ns -> PlantedInterval | None
        self.keep_other_kernels = keep_other_kernels
        self.slowdown = slowdown

    def time(self, t_ns: int) -> int:
        # Every timestamp of a stretched copy is stretched from its start: its requests, steps
        # and kernels last longer.
        return self.start_ns + int(round((t_ns - self.src_t0) * self.stretch))

    def id(self, old: bytes) -> bytes:
        return _new_id(old, self.index)

    def traces(self, request) -> bool:
        """Rewrites a trace export in place; False when nothing of it is kept."""
        kept_any = False
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                keep = []
                for span in ss.spans:
                    # Non-attention kernel spans are most of the bytes: kept in some copies only.
                    if span.name.startswith(sc.SPAN_KERNEL_PREFIX) and not self.keep_other_kernels and \
                            not any(k in span.name for k in ATTENTION_KERNELS):
                        continue
                    span.trace_id, span.span_id = self.id(span.trace_id), self.id(span.span_id)
                    span.parent_span_id = self.id(span.parent_span_id)
                    for link in span.links:
                        link.trace_id, link.span_id = self.id(link.trace_id), self.id(link.span_id)
                    span.start_time_unix_nano = self.time(span.start_time_unix_nano)
                    span.end_time_unix_nano = self.time(span.end_time_unix_nano)
                    for event in span.events:
                        event.time_unix_nano = self.time(event.time_unix_nano)
                    interval = self.interval_at(span.start_time_unix_nano)
                    slowest = _attr(span.attributes, sc.KERNEL_SLOWEST_SM)
                    if interval is not None and self.stretch > 1 and slowest is not None:
                        slowest.value.int_value = interval.sms[span.span_id[0] % len(interval.sms)]
                        spread = _attr(span.attributes, sc.KERNEL_CTA_SPREAD)
                        if spread is not None:
                            spread.value.double_value *= self.slowdown
                    keep.append(span)
                del ss.spans[:]
                ss.spans.extend(keep)
                kept_any = kept_any or bool(keep)
        return kept_any

    def metrics(self, request) -> None:
        rebase_request("metrics", request, self.time)
        for metric, point in metric_points(request):
            for ex in getattr(point, "exemplars", ()):
                ex.trace_id, ex.span_id = self.id(ex.trace_id), self.id(ex.span_id)
            if metric.name != sc.METRIC_CTA_DURATION or metric.WhichOneof("data") != "exponential_histogram":
                continue
            interval = self.interval_at(point.time_unix_nano)
            sm = _attr(point.attributes, sc.ATTR_SM_ID)
            if interval is None or sm is None or sm.value.int_value not in interval.sms:
                continue
            # Durations times the slowdown: the exponential buckets shifted by log2 of it (whole
            # buckets, so the factor is the nearest one the scale can express); sum, min, max and
            # exemplars scaled alike.
            shift = round(math.log2(self.slowdown) * 2.0 ** point.scale)  # whole buckets
            factor = 2.0 ** (shift / 2.0 ** point.scale)
            point.positive.offset += shift
            point.sum *= factor
            point.min *= factor
            point.max *= factor
            for ex in point.exemplars:
                ex.as_double *= factor


def synthesize(source: Path, target: Path, duration_s: float, period_s: float,
               intervals_s: list[tuple[float, float]], planted_sms: int, num_sms: int,
               slowdown: float, stretch: float, keep_kernels_every: int, seed: int) -> Incident:
    records = list(read_capture(source))
    src_t0 = min(min((s.start_time_unix_nano for rs in r.request.resource_spans
                      for ss in rs.scope_spans for s in ss.spans), default=r.time_unix_nano)
                 if r.signal == "traces" else r.time_unix_nano for r in records)
    rng = random.Random(seed)
    intervals = tuple(PlantedInterval(src_t0 + int(a * 1e9), src_t0 + int(b * 1e9),
                                      tuple(sorted(rng.sample(range(num_sms), planted_sms))))
                      for a, b in intervals_s)

    def interval_at(t_ns: int):
        return next((i for i in intervals if i.start_unix_nano <= t_ns < i.end_unix_nano), None)

    src_len_s = (max(r.time_unix_nano for r in records) - src_t0) / 1e9
    out = []
    copies = 0
    while copies * period_s + src_len_s <= duration_s:
        start = src_t0 + int(copies * period_s * 1e9)
        copy = _Copy(copies, src_t0, start, stretch if interval_at(start) else 1.0, interval_at,
                     copies % keep_kernels_every == 0, slowdown)
        for record in read_capture(source):  # fresh protos: each copy rewrites its own
            t = copy.time(record.time_unix_nano)
            if record.signal == "traces":
                if copy.traces(record.request):
                    out.append((t, record.signal, record.request))
            else:
                copy.metrics(record.request)
                out.append((t, record.signal, record.request))
        copies += 1
    out.sort(key=lambda item: item[0])
    incident = Incident(
        synthetic=True,
        description=(f"SYNTHETIC, not measured: {source.name} (measured on an NVIDIA H200) tiled {copies} "
                     f"times; in each interval the CTA durations of {planted_sms} SMs multiplied by "
                     f"{slowdown:g} and the copies starting there stretched {stretch:g}x"),
        tool="bench/synthesize_incident_capture.py", device="NVIDIA H200 (source capture)",
        num_sms=num_sms, intervals=intervals,
        details={"source": source.name, "start_unix_nano": src_t0, "copies": copies, "period_s": period_s, "slowdown": slowdown,
                 "stretch": stretch, "seed": seed, "keep_kernels_every": keep_kernels_every})
    target.unlink(missing_ok=True)
    with CaptureWriter(target) as writer:
        writer.write_meta(incident.to_meta())
        for t, signal, request in out:
            writer.write(signal, request, t)
    return incident


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=SOURCE)
    ap.add_argument("--out", type=Path, default=TARGET)
    ap.add_argument("--duration-s", type=float, default=170.0, help="the capture's span, at most")
    ap.add_argument("--period-s", type=float, default=8.0, help="a copy of the source starts this often")
    ap.add_argument("--interval", type=interval_s, action="append", default=None,
                    help="START,END seconds from the start (repeatable; default 60,95 and 125,155)")
    ap.add_argument("--planted-sms", type=int, default=33)
    ap.add_argument("--num-sms", type=int, default=132)
    ap.add_argument("--slowdown", type=float, default=2.5, help="CTA durations on planted SMs x this")
    ap.add_argument("--stretch", type=float, default=1.4, help="copies starting in an interval x this")
    ap.add_argument("--keep-kernels-every", type=int, default=6)
    ap.add_argument("--seed", type=int, default=14)
    args = ap.parse_args(argv)
    intervals = args.interval or [(60.0, 95.0), (125.0, 155.0)]
    if not 1 <= args.planted_sms < args.num_sms / 2:
        ap.error(f"--planted-sms {args.planted_sms}: need 1 <= n < num_sms / 2 (the median SM must be unplanted)")
    if not (args.slowdown > 1 and args.stretch >= 1 and args.period_s > 0 and args.keep_kernels_every >= 1):
        ap.error("need --slowdown > 1, --stretch >= 1, --period-s > 0, --keep-kernels-every >= 1")
    if any(b > args.duration_s for _, b in intervals):
        ap.error(f"every interval must end by --duration-s {args.duration_s}")
    incident = synthesize(args.source, args.out, args.duration_s, args.period_s, intervals, args.planted_sms,
                          args.num_sms, args.slowdown, args.stretch, args.keep_kernels_every, args.seed)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB): {incident.description}")
    for i in incident.intervals:
        print(f"  +{(i.start_unix_nano - incident.details['start_unix_nano']) / 1e9:.0f} s, "
              f"{i.duration_s:.0f} s: SMs {list(i.sms)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
