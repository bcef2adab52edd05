"""Heatmaps from constructed per-SM data: exact JSON, decodable PNG, the API's errors,
and the interactive page rendered by headless Chromium."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request

import numpy as np
import pytest
from PIL import Image

from sightline.collector import heatmap as hm
from sightline.collector.aggregation_config import ContentionConfig
from sightline.collector.heatmap_page import render_page
from sightline.collector.sm_store import SmKey
from sightline.instrumentation.exphist import relative_error
from tests.collector.otlp_builders import T0_S, make_aggregator, otlp_cta_point, otlp_metrics
from tests.collector.servers import ApiServer

US = 1e-6
# SM -> (value in slot T0-15 s, value in slot T0-5 s); None = the SM ran nothing then.
CELLS = {0: (10 * US, 12 * US), 1: (10 * US, None), 2: (11 * US, 12 * US), 3: (40 * US, 44 * US)}
N_PER_CELL = 50
KEY = SmKey("unknown", "0", "fa2_fwd")  # the test resource names no instance


@pytest.fixture
def aggregator():
    # two slots are too few to learn each SM's usual share: the even split is asked for
    agg = make_aggregator(contention=ContentionConfig(starve_before_usual=True))
    points = []
    for sm, values in CELLS.items():
        for value, t in zip(values, (T0_S - 15, T0_S - 5)):
            if value is not None:
                ex = (value, bytes([sm + 1]) * 16, bytes([sm + 1]) * 8)
                points.append(otlp_cta_point(0, sm, "fa2_fwd", [value] * N_PER_CELL, t, exemplar=ex))
    points.append(otlp_cta_point(1, 0, "other", [5 * US] * 3, T0_S - 5))
    agg.consume_metrics(otlp_metrics(points))
    return agg


def test_time_sm_values_are_exact(aggregator):
    h = hm.time_sm(aggregator.sm, KEY, window_s=30)
    d = json.loads(json.dumps(h.to_dict()))
    assert d["kind"] == "time_sm" and d["sms"] == ["0", "1", "2", "3"]
    assert d["times_unix_s"] == [T0_S - 20, T0_S - 10, T0_S]
    # a cell of identical values is exact (quantiles never leave [min, max])
    assert d["p99_s"] == [[v0, v1, None] for v0, v1 in
                          ([CELLS[s][0], CELLS[s][1]] for s in range(4))]
    assert d["counts"] == [[50, 50, 0], [50, 0, 0], [50, 50, 0], [50, 50, 0]]
    assert d["exemplars"][3][1] == {"trace_id": "04" * 16, "span_id": "04" * 8, "value_s": 44 * US}
    # window P99 per SM: SM0 100 values 10/12 us -> rank 99 is 12 us (within the bound)
    hs = d["hotspot"]
    assert hs["p99_s"]["1"] == 10 * US
    assert hs["p99_s"]["0"] == pytest.approx(12 * US, rel=relative_error(6))
    assert hs["hottest_sm"] == "3"
    assert hs["ratio"] == pytest.approx(44 / 12, rel=2 * relative_error(6))
    assert d["relative_error"] == relative_error(6)
    # per slot: 40 / median(10, 10, 11, 40) and 44 / median(12, 12, 44); the empty slot None
    assert d["hotspot_ratio_by_time"] == [pytest.approx(40 / 10.5, rel=1e-12), pytest.approx(44 / 12, rel=1e-12), None]


def test_time_sm_contention_cells_and_contended_sms(aggregator):
    """SM 3's CTAs (40-44 us) all lie above the other SMs' P90 (10-12 us): slow in both slots;
    SM 1 ran none of the second slot's 150 CTAs where 37.5 were its share: starved there."""
    d = hm.time_sm(aggregator.sm, KEY, window_s=30).to_dict()
    assert d["num_sms"] == 4
    assert d["contention"] == [[None, None, None], [None, "starved", None], [None, None, None], ["slow", "slow", None]]
    # scores: own P90 over the others' (exact here: one value per cell), or expected over own CTAs
    scores = d["contention_score"]
    assert scores[3][0] == pytest.approx(40 / 11, rel=0.011) and scores[3][1] == pytest.approx(44 / 12, rel=0.011)
    assert scores[1][1] == 37.5 and scores[0][2] is None
    assert list(d["contended"]) == ["1", "3"]  # the larger score first
    assert d["contended"]["1"] == {"sm": "1", "score": 37.5, "reasons": ["starved"], "slots_flagged": 1, "slots": 2}
    assert d["contended"]["3"]["reasons"] == ["slow"] and d["contended"]["3"]["slots_flagged"] == 2


def test_sm_latency_counts_are_exact(aggregator):
    h = hm.sm_latency(aggregator.sm, KEY, window_s=30, max_bins=16)
    edges = np.asarray(h.edges_s)
    assert len(edges) - 1 <= 16 and all(len(row) == len(edges) - 1 for row in h.counts)
    assert np.all(np.diff(edges) > 0)
    for r, sm in enumerate(h.sms):
        expected = np.zeros(len(edges) - 1, dtype=int)
        for value in CELLS[int(sm)]:
            if value is not None:
                j = int(np.searchsorted(edges, value, side="left")) - 1  # (edges[j], edges[j+1]]
                expected[j] += N_PER_CELL
        assert h.counts[r] == expected.tolist(), sm
    assert h.zero_counts == [0, 0, 0, 0]


def test_png_decodes(aggregator):
    for fn in (hm.time_sm, hm.sm_latency):
        image = Image.open(io.BytesIO(hm.render_png(fn(aggregator.sm, KEY))))
        image.load()
        assert image.format == "PNG" and image.width > 100 and image.height > 50
        # some pixels carry the viridis extremes (the hottest/coolest cells)
        colours = {c for _, c in image.getcolors(maxcolors=1 << 16)}
        assert hm.colour(1.0) in colours and hm.colour(0.0) in colours
        # the time x SM view outlines SM 3's slow cells red and SM 1's starved (empty) one blue
        outlines = {hm._SLOW, hm._STARVED} & colours
        assert outlines == ({hm._SLOW, hm._STARVED} if fn is hm.time_sm else set())


@pytest.fixture
def server(aggregator):
    s = ApiServer(aggregator)
    yield s
    s.close()


def test_png_title_keeps_its_word_gaps(aggregator):
    """Every space of the title shows as a blank gap of >= 3 px columns (Pillow's 10 px
    default font drew "P99 CTAduration, GPU0": 4 gaps for 5 spaces); letters sit closer."""
    for fn, title in ((hm.time_sm, "P99 CTA duration, GPU 0, fa2_fwd"),
                      (hm.sm_latency, "CTA count by duration, GPU 0, fa2_fwd")):
        image = Image.open(io.BytesIO(hm.render_png(fn(aggregator.sm, KEY)))).convert("L")
        band = range(0, 24)  # the title's rows, above the first cell row (top = 28)
        ink = [any(image.getpixel((x, y)) < 128 for y in band) for x in range(image.width)]
        columns = [x for x, dark in enumerate(ink) if dark]
        gaps, blank = 0, 0
        for x in range(columns[0], columns[-1] + 1):
            if ink[x]:
                gaps += blank >= 3
                blank = 0
            else:
                blank += 1
        assert gaps == title.count(" "), (fn.__name__, gaps)


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers.get("Content-Type"), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type"), exc.read()


def test_api_heatmap_routes_and_errors(server, aggregator):
    status, ctype, body = _get(server.url("/api/v1/kernels"))
    kernels = json.loads(body)["kernels"]
    assert status == 200 and {(k["gpu"], k["kernel"], k["sms"]) for k in kernels} == {
        ("0", "fa2_fwd", 4), ("1", "other", 1)}
    status, _, body = _get(server.url("/api/v1/heatmap?gpu=0&kernel=fa2_fwd&window_s=30"))
    assert status == 200
    assert json.loads(body) == json.loads(json.dumps(hm.time_sm(aggregator.sm, KEY, window_s=30).to_dict()))
    status, ctype, body = _get(server.url("/api/v1/heatmap?gpu=1&kind=sm_latency&format=png"))
    assert status == 200 and ctype == "image/png" and Image.open(io.BytesIO(body)).format == "PNG"
    for query, param, code in (("kind=nope&gpu=0&kernel=fa2_fwd", "kind", 400),
                               ("format=svg&gpu=0&kernel=fa2_fwd", "format", 400),
                               ("window_s=-1&gpu=0&kernel=fa2_fwd", "window_s", 400),
                               ("", "gpu", 400),  # two pairs exist: ambiguous
                               ("gpu=7&kernel=fa2_fwd", "kernel", 404)):
        status, ctype, body = _get(server.url("/api/v1/heatmap?" + query))
        error = json.loads(body)["error"]
        assert (status, error["code"], error["param"]) == (code, code, param), query
        assert ctype.startswith("application/json")
    status, ctype, body = _get(server.url("/api/v1/nope"))
    assert status == 404 and json.loads(body)["error"]["code"] == 404


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium (scripts/setup.sh)")
def test_page_renders_in_headless_chromium(server):
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run(
            ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--dump-dom",
             server.url("/api/v1/heatmap.html?window_s=30")],
            capture_output=True, text=True, timeout=120).stdout
    # the first (gpu 0, fa2_fwd, time_sm) view is drawn: 4 SMs x 3 slots
    cells = re.findall(r'<rect class="cell[^"]*"[^>]*>', dom)
    assert len(cells) == 12, dom[-2000:]
    assert sum('data-value="no CTAs' in c for c in cells) == 5  # 4 x 3 minus 7 cells with CTAs
    assert 'data-sm="3"' in dom and "hotspot ratio" in dom
    # contended cells outlined: SM 3 slow in both slots, SM 1 starved (no CTAs) in the second
    assert sorted(re.search(r'data-sm="(\d+)"', c).group(1) for c in cells if 'class="cell slow"' in c) == ["3", "3"]
    [starved] = [c for c in cells if 'class="cell starved"' in c]
    assert 'data-sm="1"' in starved and "no CTAs" in starved and "contention: starved" in starved
    assert re.search(r"contended SMs \(red: slow, dashed blue: starved\): SM 1 starved in 1/2 slots "
                     r"\(score 37.50\), SM 3 slow in 2/2 slots \(score 3.\d\d\)", dom)
    assert '<g id="legend">' in dom and "10.00 us" in dom and "44.00 us" in dom  # legend ends: min, max P99
    ticks = re.findall(r'<text class="axis tick"[^>]*>([^<]*)</text>', dom)  # one per slot: 3 columns
    assert len(ticks) == 3 and all(re.fullmatch(r"\d\d:\d\d:\d\d", t) for t in ticks), ticks
    # cells with an exemplar link to the trace of the slowest CTA's step (click-through)
    assert sorted(re.findall(r'data-trace="([0-9a-f]{32})"', dom)) == sorted(
        [f"{sm + 1:02x}" * 16 for sm, values in CELLS.items() for v in values if v is not None])
    assert f'data-api-base="http://127.0.0.1:{server.port}"' in dom
    assert re.search(r'<select id="gpu">.*<option value="0">0</option><option value="1">1</option>', dom)


def test_page_is_self_contained():
    page = render_page([{"gpu": "0", "kernel": "</script><b>", "kind": "time_sm"}])
    assert "</script><b>" not in page  # cannot break out of the data element
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in page
