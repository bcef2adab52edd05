"""The shipped captures replayed on the CPU give the findings their live runs are held to.

Each capture in deploy/captures is replayed once into an in-process collector (its clock
pinned, slot-aligned as the demo replays it). The recorded H200 incident: in every planted
interval the SMs the contention tests flag are the planted ones (precision and recall at
least 0.9, for every attention kernel), the SM-contention alert's series is there, and the
10 slowest requests of each interval are explained as ``sm_contention`` in at least 9 of
10. The HBM hog: ``device_contention`` for at least 9 of its 10 slowest, no SM flagged, no
request of its interval blamed on an SM or the host; the GIL hog: ``host_stall`` for at
least 9 of 10, no SM flagged; the control, recorded with the GPU's dispatch deal: no SM
flagged, no request blamed on the GPU or the host; the priority burst: ``queueing`` for at
least 9 of 10, no SM flagged, no request of its interval blamed on an SM, the GPU or the
host. The capture without an incident: no request is blamed on the GPU. Slow: the replay's
OTLP/JSON parsing takes about a minute.
"""

from __future__ import annotations

import time

import pytest

from sightline.collector.aggregation_config import AggregationConfig
from sightline.collector.aggregator import Aggregator
from sightline.collector.explain import explain_slowest
from sightline.collector.replay import AggregatorSink, ReplayConfig, replay
from sightline.deploy.demo import CAPTURES_DIR
from sightline.deploy.incident import Incident, find, probe_heatmaps
from sightline.instrumentation import read_capture, read_capture_meta
from sightline.instrumentation import semconv as sc

pytestmark = pytest.mark.slow
NOW_NS = 1_800_000_000 * 10**9
INCIDENT = CAPTURES_DIR / "h200-noisy-neighbour.jsonl.gz"
PLAIN = CAPTURES_DIR / "h200-20261202-http.jsonl.gz"
HBM_HOG = CAPTURES_DIR / "h200-hbm-hog.jsonl.gz"
CONTROL = CAPTURES_DIR / "h100-control.jsonl.gz"
HOST_STALL = CAPTURES_DIR / "h200-host-stall.jsonl.gz"
BURST = CAPTURES_DIR / "h100-priority-burst.jsonl.gz"


def replayed(capture):
    aggregator = Aggregator(clock=lambda: NOW_NS / 1e9)
    result = replay(capture, AggregatorSink(aggregator), ReplayConfig(speed=0.0, align_slot_s=10.0),
                    clock_ns=lambda: NOW_NS)
    heatmaps = probe_heatmaps(aggregator)
    return aggregator, result.time_map, heatmaps


@pytest.fixture(scope="module")
def incident_replay():
    if not INCIDENT.is_file():
        pytest.skip(f"no {INCIDENT.name}")
    start = time.monotonic()
    out = replayed(INCIDENT)
    return (*out, time.monotonic() - start)


def test_the_planted_sms_are_found_in_every_interval(incident_replay):
    aggregator, time_map, heatmaps, _ = incident_replay
    incident = Incident.from_meta(read_capture_meta(INCIDENT))
    findings = find(incident, heatmaps, time_map)
    kernels = {h["kernel"] for h in heatmaps}
    assert kernels == {"sightline_fa2_prefill", "sightline_paged_decode"}
    assert len(findings) == len(incident.intervals) * len(kernels)
    for f in findings:
        assert f.slots >= 3 and len(f.planted) == 33
        assert f.precision >= 0.9 and f.recall >= 0.9, (f.kernel, f.precision, f.recall, f.flagged)
        # the planted SMs ran short of their share: starved in every finding
        assert all("starved" in f.reasons[sm] for sm in set(f.planted) & set(f.flagged))
    page = aggregator.sm_page.render(NOW_NS / 1e9, openmetrics=False).decode()
    assert f'{sc.COLLECTOR_SM_CONTENTION_SCORE}{{' in page  # what SightlineSMContention counts


def test_the_slowest_requests_of_each_interval_are_explained_as_sm_contention(incident_replay):
    aggregator, time_map, _, _ = incident_replay
    incident = Incident.from_meta(read_capture_meta(INCIDENT))
    for interval in incident.intervals:
        within = (time_map(interval.start_unix_nano) / 1e9, time_map(interval.end_unix_nano) / 1e9)
        explained = explain_slowest(aggregator, quantile=0.0, limit=10, within_s=within)
        causes = [r.cause.name for r in explained.requests]
        assert len(causes) == 10 and causes.count(sc.CAUSE_SM_CONTENTION) >= 9, causes
        first = explained.requests[0].cause
        assert first.evidence["contended_sms"] and first.evidence["engine_slowdown"] >= 1.2
        assert "the kernel's other SMs in the same slots" in first.compared_with


def test_a_capture_without_an_incident_blames_no_request_on_the_gpu():
    if not PLAIN.is_file():
        pytest.skip(f"no {PLAIN.name}")
    assert Incident.from_meta(read_capture_meta(PLAIN)) is None
    aggregator, _, _ = replayed(PLAIN)
    explained = explain_slowest(aggregator, quantile=0.0, limit=1000)
    assert explained.requests_considered == 32
    causes = {r.cause.name for r in explained.requests}
    assert causes <= {sc.CAUSE_QUEUEING, sc.CAUSE_UNKNOWN, sc.CAUSE_PREFILL_INTERFERENCE}, causes


def _planted(capture):
    """The capture's one planted interval, the findings there, that interval's 10 slowest
    requests explained, and the replay's aggregator and the interval on its clock."""
    if not capture.is_file():
        pytest.skip(f"no {capture.name}")
    aggregator, time_map, heatmaps = replayed(capture)
    incident = Incident.from_meta(read_capture_meta(capture))
    (interval,) = incident.intervals
    findings = find(incident, heatmaps, time_map)
    within = (time_map(interval.start_unix_nano) / 1e9, time_map(interval.end_unix_nano) / 1e9)
    return interval, findings, explain_slowest(aggregator, quantile=0.0, limit=10, within_s=within), aggregator, within


def _blamed(aggregator, within: tuple[float, float], causes: tuple[str, ...]) -> tuple[int, list[str]]:
    """How many of the interval's requests were explained (each it considered), and the
    summaries of those given one of ``causes``."""
    every = explain_slowest(aggregator, quantile=0.0, limit=1000, within_s=within)
    assert every.requests_considered == len(every.requests)
    return len(every.requests), [r.cause.summary for r in every.requests if r.cause.name in causes]


def test_an_hbm_hog_is_named_device_contention_and_flags_no_sm():
    """The recorded HBM hog (another process streaming device memory, ``engine serve``,
    bench/scenarios.py): the planted interval's 10 slowest requests are explained as
    ``device_contention`` in at least 9 of 10, with their steps' GPU time up and their host
    time as usual; none of the interval's requests is blamed on an SM or the host, and the
    contention tests flag no SM."""
    interval, findings, explained, aggregator, within = _planted(HBM_HOG)
    assert interval.kind == "hbm_hog"
    assert findings and all(not f.flagged for f in findings), [(f.kernel, f.flagged) for f in findings]
    causes = [r.cause.name for r in explained.requests]
    assert len(causes) == 10 and causes.count(sc.CAUSE_DEVICE_CONTENTION) >= 9, causes
    evidence = explained.requests[0].cause.evidence
    assert evidence["gpu_slowdown"] >= 1.5 and evidence["host_slowdown"] < 1.2, evidence
    explained_all, blamed = _blamed(aggregator, within, (sc.CAUSE_SM_CONTENTION, sc.CAUSE_HOST_STALL))
    assert explained_all > 20 and not blamed, blamed


def test_the_control_flags_no_sm_and_blames_no_request_on_the_gpu_or_the_host():
    """A control segment (bench/scenarios.py), nothing planted, recorded with the CTAs the
    GPU's dispatch deals each SM: a 128-CTA launch leaves four SMs idle, 64 CTAs leave 68,
    and none of them is called starved."""
    interval, findings, explained, _, _ = _planted(CONTROL)
    assert interval.kind == "control"
    assert findings and all(not f.flagged for f in findings), [(f.kernel, f.flagged) for f in findings]
    causes = {r.cause.name for r in explained.requests}
    assert len(explained.requests) == 10
    assert causes <= {sc.CAUSE_QUEUEING, sc.CAUSE_UNKNOWN, sc.CAUSE_PREFILL_INTERFERENCE}, causes


def _scraped(capture, every_s: float = 2.0, gauge_window_s: float = 15.0) -> list[tuple[float, list[str], int]]:
    """``capture`` replayed export by export at its recorded times, the collector's /metrics
    read every ``every_s`` of them as Prometheus read it live: per read, its time, the
    ``sightline_sm_contention_score`` lines and how many per-SM P99 lines it had."""
    clock = [0.0]
    aggregator = Aggregator(AggregationConfig(gauge_window_s=gauge_window_s), clock=lambda: clock[0])
    sink, reads, due = AggregatorSink(aggregator), [], None
    for signal, t_ns, request in read_capture(capture):
        due = t_ns / 1e9 + every_s if due is None else due
        while t_ns / 1e9 >= due:
            clock[0] = due
            lines = aggregator.sm_page.render(due, openmetrics=False).decode().splitlines()
            reads.append((due, [line for line in lines if line.startswith(sc.COLLECTOR_SM_CONTENTION_SCORE + "{")],
                          sum(line.startswith(sc.COLLECTOR_SM_CTA_P99_SECONDS + "{") for line in lines)))
            due += every_s
        clock[0] = t_ns / 1e9
        sink.send(signal, request, 0)
    return reads


def test_the_control_read_as_prometheus_read_it_live_exposes_no_contended_sm():
    """The control replayed export by export at its recorded times, /metrics read every 2 s
    with the scenarios' 15 s gauge window. Live, its collector also tested the slot still
    open, and in that slot's first seconds (a few launches, each placing a long context's
    CTAs on the same SMs) flagged 4 to 16 SMs: SightlineSMContention fired in a control.
    Tested once their slot has closed, no read exposes a contention score."""
    if not CONTROL.is_file():
        pytest.skip(f"no {CONTROL.name}")
    reads = _scraped(CONTROL)
    assert len(reads) >= 20 and sum(p99 > 0 for _, _, p99 in reads) >= 15, [(t, n) for t, _, n in reads]
    assert [(t, flagged) for t, flagged, _ in reads if flagged] == []


def test_a_gil_holding_thread_is_named_host_stall_and_flags_no_sm():
    """The recorded GIL hog (a thread in the engine core's process holding the GIL 30 ms of
    every 50, ``engine serve``): at least 9 of the interval's 10 slowest requests are
    ``host_stall``, each with host time stretching its steps (by 1.2x at least, the rule's
    bound where the GPU's work ran at its usual speed) while GPU time per step stayed under
    1.3x, and no SM is flagged."""
    interval, findings, explained, _, _ = _planted(HOST_STALL)
    assert interval.kind == "host_stall"
    assert findings and all(not f.flagged for f in findings), [(f.kernel, f.flagged) for f in findings]
    causes = [r.cause.name for r in explained.requests]
    assert len(causes) == 10 and causes.count(sc.CAUSE_HOST_STALL) >= 9, causes
    stalls = [r.cause.evidence for r in explained.requests if r.cause.name == sc.CAUSE_HOST_STALL]
    assert all(e["gpu_slowdown"] < 1.3 and e["host_slowdown"] >= max(e["gpu_slowdown"], 1.2) for e in stalls), stalls


def test_a_priority_burst_is_queueing_and_blames_no_request_on_the_gpu():
    """The recorded priority burst (96 prompts of 2,000-6,000 tokens at once, at the most
    urgent priority; bench/scenarios.py on an H100): at least 9 of the interval's 10 slowest
    requests are ``queueing``, no SM is flagged, and none of the interval's requests is named
    a cause of slowness. Live, its collector named ``device_contention`` for 2 of the 10
    slowest and for more beyond them, and fired a device alert: steps holding 7,700 KV
    blocks read against a block's cost measured on contexts under 400."""
    interval, findings, explained, aggregator, within = _planted(BURST)
    assert interval.kind == "priority_burst"
    assert findings and all(not f.flagged for f in findings), [(f.kernel, f.flagged) for f in findings]
    causes = [r.cause.name for r in explained.requests]
    assert len(causes) == 10 and causes.count(sc.CAUSE_QUEUEING) >= 9, causes
    explained_all, blamed = _blamed(aggregator, within,
                                    (sc.CAUSE_SM_CONTENTION, sc.CAUSE_DEVICE_CONTENTION, sc.CAUSE_HOST_STALL))
    assert explained_all > 100
    assert not blamed, blamed
