"""/metrics with per-SM data, parsed whole by prometheus_client's parsers (text and
OpenMetrics) and compared with exact answers: P99 gauges, hotspots, histograms, exemplars,
escaped labels, one # HELP/# TYPE per family, one # EOF; and served gzipped by a real collector."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import time
import urllib.request

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from sightline.collector.exposition import metrics_page
from sightline.collector.gzip_pieces import deflate_piece, gzip_join
from sightline.collector.contention import hotspots, hottest_sm
from sightline.collector.sm_exposition import SmPage
from sightline.collector.sm_store import kernel_label
from sightline.instrumentation import semconv as sc
from tests.collector.otlp_builders import (OPENMETRICS, T0_S, make_aggregator, otlp_attrs, otlp_cta_point,
                                           otlp_metrics, resource_metrics)
from tests.collector.servers import post, running_collector

# powers of two: every sum below is exact; 2**-15 s lies in (2e-5, 5e-5], 2**-13 s in (1e-4, 2e-4]
FAST, SLOW = 2.0 ** -15, 2.0 ** -13
CTAS = 8
TRICKY = 'node "b"\\ 7\nx'  # a quote, a backslash and a newline: all three escaped
LONG = 'void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, "bf16">, true>'
TRACE, SPAN = bytes(range(16)), bytes(range(8, 16))
PER_SM = (sc.COLLECTOR_SM_CTA_P99_SECONDS, sc.COLLECTOR_SM_HOTSPOT_RATIO, sc.COLLECTOR_SM_HOTTEST,
          sc.COLLECTOR_SM_CONTENDED, sc.COLLECTOR_SM_CONTENTION_SCORE,
          sc.COLLECTOR_GPU_CTA_DURATION_SECONDS, sc.COLLECTOR_GPU_INFO, sc.COLLECTOR_SM_KERNEL_INFO)


def _fleet(**config):
    """Two instances; on each GPU 0 (one with a UUID) two kernels on SMs 0-3, SM 3 slow."""
    agg = make_aggregator(**config)
    for instance, uuid in (("node-a", "GPU-c0ffee"), (TRICKY, None)):
        points = []
        for kernel in ("fa2", LONG):
            for sm in range(4):
                slow = sm == 3
                p = otlp_cta_point(0, sm, kernel, [SLOW if slow else FAST] * CTAS, T0_S - 1,
                                   exemplar=(SLOW, TRACE, SPAN) if slow else None)
                if uuid:
                    p.attributes.extend(otlp_attrs({sc.ATTR_GPU_UUID: uuid}))
                points.append(p)
        agg.consume_metrics(resource_metrics(points, **{sc.RESOURCE_SERVICE_INSTANCE_ID: instance}))
    return agg


def _page(agg, accept: str = "") -> str:
    registry = CollectorRegistry()
    registry.register(agg.prometheus_collector())
    return metrics_page(registry, agg, accept)[0].decode()


def _samples(families, name: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families if f.name == name for s in f.samples}


GPUS = ("GPU-c0ffee", f"{TRICKY}:0")
KERNELS = ("fa2", kernel_label(LONG))


def _expected_p99() -> dict[tuple, float]:
    return {(sc.COLLECTOR_SM_CTA_P99_SECONDS, (("gpu", g), ("kernel", k), ("sm", str(sm)))):
            float(f"{SLOW if sm == 3 else FAST:.6g}") for g in GPUS for k in KERNELS for sm in range(4)}


def _check_page(text: str, families: list) -> None:
    names = [f.name for f in families]
    assert len(names) == len(set(names)) and set(PER_SM) <= set(names)
    for name in PER_SM:
        assert text.count(f"# TYPE {name} ") == 1 and text.count(f"# HELP {name} ") == 1
    assert _samples(families, sc.COLLECTOR_SM_CTA_P99_SECONDS) == _expected_p99()
    by_block = [(("gpu", g), ("kernel", k)) for g in GPUS for k in KERNELS]
    # the slow SM's P99 over the median SM's, from the P99s before rounding to 6 digits
    assert _samples(families, sc.COLLECTOR_SM_HOTSPOT_RATIO) == {
        (sc.COLLECTOR_SM_HOTSPOT_RATIO, b): SLOW / FAST for b in by_block}
    assert _samples(families, sc.COLLECTOR_SM_HOTTEST) == {(sc.COLLECTOR_SM_HOTTEST, b): 3.0 for b in by_block}
    # SM 3's 8 CTAs all above the others' P90: slow (the bound 0.1**8 is under 1e-3 / 4 SMs);
    # its score is its P90 over theirs (exact: one value each); no SM ran short of its share
    assert _samples(families, sc.COLLECTOR_SM_CONTENDED) == {
        (sc.COLLECTOR_SM_CONTENDED, b + (("reason", r),)): float(r == "slow") for b in by_block
        for r in sc.CONTENTION_REASONS}
    assert _samples(families, sc.COLLECTOR_SM_CONTENTION_SCORE) == {
        (sc.COLLECTOR_SM_CONTENTION_SCORE, b + (("sm", "3"),)): SLOW / FAST for b in by_block}
    hist = _samples(families, sc.COLLECTOR_GPU_CTA_DURATION_SECONDS)
    name = sc.COLLECTOR_GPU_CTA_DURATION_SECONDS
    for b in by_block:
        buckets = {dict(labels)["le"]: v for (n, labels), v in hist.items()
                   if n == name + "_bucket" and labels[:2] == b}
        want = {repr(le): 0.0 if le < 5e-5 else 3 * CTAS if le < 2e-4 else 4 * CTAS for le in sc.CTA_BUCKETS_S}
        assert buckets == {**want, "+Inf": 4 * CTAS}
        assert hist[(name + "_count", b)] == 4 * CTAS and hist[(name + "_sum", b)] == CTAS * (3 * FAST + SLOW)
    assert _samples(families, sc.COLLECTOR_GPU_INFO) == {
        (sc.COLLECTOR_GPU_INFO, (("gpu", "GPU-c0ffee"), ("gpu_index", "0"), ("instance_id", "node-a"))): 1.0,
        (sc.COLLECTOR_GPU_INFO, (("gpu", f"{TRICKY}:0"), ("gpu_index", "0"), ("instance_id", TRICKY))): 1.0}
    assert _samples(families, sc.COLLECTOR_SM_KERNEL_INFO) == {
        (sc.COLLECTOR_SM_KERNEL_INFO, (("kernel", k), ("kernel_name", whole))): 1.0
        for k, whole in zip(KERNELS, ("fa2", LONG))}


def test_text_format_parses_with_exact_values_and_escaped_labels():
    text = _page(_fleet())
    families = list(parse_text(text))
    _check_page(text, families)
    assert '\\"b\\"\\\\ 7\\nx' in text and "# EOF" not in text and TRACE.hex() not in text
    if shutil.which("promtool"):  # Prometheus's own linter reads it too
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    # the registry's own families come through prometheus_client, next to the per-SM ones
    assert _samples(families, sc.COLLECTOR_SERIES_OVERFLOW_TOTAL)[
        (sc.COLLECTOR_SERIES_OVERFLOW_TOTAL + "_total", (("family", "sm_cta"),))] == 0


def test_openmetrics_parses_with_exemplars_and_one_eof_at_the_end():
    text = _page(_fleet(), OPENMETRICS)
    assert text.endswith("\n# EOF\n") and text.count("# EOF") == 1
    families = list(parse_openmetrics(text))
    _check_page(text, families)
    exemplars = [(dict(s.labels), s.exemplar) for f in families if f.name == sc.COLLECTOR_GPU_CTA_DURATION_SECONDS
                 for s in f.samples if s.exemplar is not None]
    assert len(exemplars) == 4  # one per (gpu, kernel), on the slow SM's bucket
    for labels, ex in exemplars:
        assert labels["le"] == "0.0002"
        assert ex.labels == {sc.EXEMPLAR_TRACE_ID_LABEL: TRACE.hex(), "span_id": SPAN.hex()}
        assert ex.value == SLOW and float(ex.timestamp) == T0_S - 1


def test_opt_in_per_sm_histograms_parse_in_both_formats():
    agg = _fleet(expose_sm_histograms=True)
    name = sc.COLLECTOR_SM_CTA_DURATION_SECONDS
    for accept, parse in (("", parse_text), (OPENMETRICS, parse_openmetrics)):
        text = _page(agg, accept)
        hist = _samples(list(parse(text)), name)
        assert text.count(f"# TYPE {name} ") == 1
        for g in GPUS:
            for k in KERNELS:
                for sm in range(4):
                    labels = (("gpu", g), ("kernel", k), ("sm", str(sm)))
                    value = SLOW if sm == 3 else FAST
                    assert hist[(name + "_count", labels)] == CTAS and hist[(name + "_sum", labels)] == CTAS * value
                    assert hist[(name + "_bucket", labels[:2] + (("le", "5e-05"),) + labels[2:])] == (
                        0 if sm == 3 else CTAS)
        assert len(hist) == 2 * 2 * 4 * (len(sc.CTA_BUCKETS_S) + 3)


def _pinned_fleet():
    """The fleet with per-SM histograms, on a clock the test moves (``clock[0]``)."""
    clock = [T0_S]
    agg = _fleet(expose_sm_histograms=True)
    agg.clock = agg.sm.now = lambda: clock[0]
    return agg, clock


def test_kept_lines_are_what_formatting_again_gives_after_writes_and_as_the_window_moves():
    agg, clock = _pinned_fleet()
    for openmetrics in (False, True):
        kept = agg.sm_page
        first = kept.render(clock[0], openmetrics)
        assert kept.render(clock[0], openmetrics) == first == SmPage(agg.sm).render(clock[0], openmetrics)
        # one block written (SM 1 of fa2 on node-a turns slow), the others kept
        agg.consume_metrics(resource_metrics(
            [otlp_cta_point(0, 1, "fa2", [SLOW] * CTAS, clock[0] - 1, exemplar=(SLOW, TRACE, SPAN)),
             otlp_cta_point(0, 1, "fa2", [SLOW] * CTAS, clock[0] - 1)],
            **{sc.RESOURCE_SERVICE_INSTANCE_ID: "node-a"}))
        again = kept.render(clock[0], openmetrics)
        assert again != first and again == SmPage(agg.sm).render(clock[0], openmetrics)
        # the gauge window leaves the written slots behind: every P99 line goes
        clock[0] += agg.config.gauge_window_s + agg.config.window.slot_s
        later = kept.render(clock[0], openmetrics)
        assert later == SmPage(agg.sm).render(clock[0], openmetrics)
        assert f"{sc.COLLECTOR_SM_CTA_P99_SECONDS}{{" not in later.decode()
        clock[0] = T0_S


def test_kept_deflate_pieces_decompress_to_the_page_formatted_again():
    agg, clock = _pinned_fleet()
    for openmetrics in (False, True):
        kept = agg.sm_page
        pages = []
        for write in (False, True, False):
            if write:  # one block written, the others' kept pieces reused
                agg.consume_metrics(resource_metrics(
                    [otlp_cta_point(0, 1, "fa2", [SLOW] * CTAS, clock[0] - 1)], **{sc.RESOURCE_SERVICE_INSTANCE_ID: "node-a"}))
            zipped = gzip.decompress(gzip_join(kept.pieces(clock[0], openmetrics, deflate=True)))
            assert zipped == SmPage(agg.sm).render(clock[0], openmetrics)
            pages.append(zipped)
        assert pages[0] != pages[1] == pages[2]


def test_gzip_join_of_kept_and_fresh_pieces_is_the_texts_joined():
    texts = [b"", b"a" * 70_000, b"b\n", bytes(range(256)) * 300, b"", b"tail\n"]
    for kept in ((), (1, 3), range(len(texts))):
        pieces = [(t, deflate_piece(t) if i in kept else None) for i, t in enumerate(texts)]
        assert gzip.decompress(gzip_join(pieces)) == b"".join(texts)
    assert gzip.decompress(gzip_join([])) == b""


def test_hottest_sm_is_what_hotspots_answers_ties_to_the_larger_label():
    p99 = {"7": 2.0, "12": 2.0, "3": 1.0, "4": float("nan"), "5": 1.0, "6": 1.0}
    summary = hotspots(p99)
    assert hottest_sm(list(p99), np.array(list(p99.values()))) == (1.0, 2.0, "7") == (
        summary.median_p99_s, summary.ratio, summary.hottest_sm)
    assert hottest_sm(["0"], np.array([np.nan])) == (None, None, None)


def test_collector_serves_the_page_gzipped_when_asked():
    with running_collector() as running:
        now = time.time()
        points = [otlp_cta_point(0, sm, "fa2", [SLOW if sm == 3 else FAST] * CTAS, now - 1) for sm in range(4)]
        body = otlp_metrics(points).SerializeToString()
        assert post(running.http_url + "/v1/metrics", body, {"Content-Type": "application/x-protobuf"})[0] == 200
        running.idle()
        url = running.query_url + "/metrics"
        for accept, parse in (("", parse_text), (OPENMETRICS, parse_openmetrics)):
            request = urllib.request.Request(url, headers={"Accept": accept, "Accept-Encoding": "gzip"})
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.headers["Content-Encoding"] == "gzip"
                text = gzip.decompress(response.read()).decode()
            with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": accept}), timeout=30) as plain:
                assert plain.headers.get("Content-Encoding") is None
                assert parse_text is parse or plain.read().decode().endswith("# EOF\n")
            p99 = _samples(list(parse(text)), sc.COLLECTOR_SM_CTA_P99_SECONDS)
            assert p99 == {(sc.COLLECTOR_SM_CTA_P99_SECONDS, (("gpu", "unknown:0"), ("kernel", "fa2"), ("sm", str(sm)))):
                           float(f"{SLOW if sm == 3 else FAST:.6g}") for sm in range(4)}
            received = _samples(list(parse(text)), sc.COLLECTOR_DATAPOINTS_RECEIVED_TOTAL)
            assert received[(sc.COLLECTOR_DATAPOINTS_RECEIVED_TOTAL + "_total",
                             (("receiver", sc.RECEIVER_OTLP_HTTP),))] == 4
