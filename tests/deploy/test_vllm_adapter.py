"""Sightline's dashboards and alerts on a vLLM server's series, through the adapter rules.

A static vLLM exposition (``fixtures/vllm_metrics.txt``: vLLM's names, types, labels and
buckets) is served over HTTP with its counters growing by one window per scrape; a real
Prometheus scrapes it every second and evaluates Sightline's rule file (adapter + SLO
rules + alerts). Then:

- every adapted ``llm:`` series exists, with vLLM's ``model_name`` as ``model``;
- every Overview and Requests panel query returns data, except those that read only
  series vLLM has no source for (the prefix cache's blocks, evictions, TTFT by hit / miss;
  slow requests by cause, which the collector explains from Sightline's own spans);
- the adapted counts equal the fixture's (exactly: counters, no interpolation).

The promtool cases on vLLM-shaped series are in ``deploy/prometheus/tests/vllm.yml``
(run by ``test_rules.py``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sightline.dashboards import overview, promql, requests
from sightline.dashboards.build import panel_queries
from sightline.deploy import prometheus_adapter, prometheus_rules
from sightline.deploy.prometheus_config import render_prometheus_config
from sightline.instrumentation import semconv as sc
from tests.support import free_port, wait_for_http

PROMETHEUS = shutil.which("prometheus")
FIXTURE = Path(__file__).parent / "fixtures" / "vllm_metrics.txt"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (scripts/setup.sh installs it)")


def _grown(text: str, k: int) -> str:
    """The fixture after ``k`` windows: counter and histogram samples times ``k``."""
    kinds: dict[str, str] = {}
    out = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            kinds[name] = kind
        elif line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name = series.split("{", 1)[0]
            family = next((f for f in (name, name.rsplit("_", 1)[0]) if f in kinds), None)
            if family is not None and kinds[family] in ("counter", "histogram"):
                line = f"{series} {float(value) * k}"
        out.append(line)
    return "\n".join(out) + "\n"


class _Fixture(BaseHTTPRequestHandler):
    scrapes = 0

    def do_GET(self):  # noqa: N802 (http.server's name)
        type(self).scrapes += 1
        body = _grown(FIXTURE.read_text(), type(self).scrapes).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm-prometheus")
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Fixture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = render_prometheus_config({"vllm": f"127.0.0.1:{server.server_address[1]}"},
                                      rule_files=[prometheus_rules.RULES_PATH],
                                      scrape_interval_s=1.0, evaluation_interval_s=1.0)
    (folder / "prometheus.yml").write_text(config)
    port = free_port()
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/-/ready", timeout_s=30, process=process)
        deadline = time.monotonic() + 60  # a few scrapes and rule evaluations
        while _Fixture.scrapes < 8 and time.monotonic() < deadline:
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=20)
        server.shutdown()


def _query(base: str, expr: str, at: float | None = None) -> dict:
    data = urllib.parse.urlencode({"query": expr} | ({"time": repr(at)} if at is not None else {})).encode()
    try:
        with urllib.request.urlopen(f"{base}/api/v1/query", data=data, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


def _result(base: str, expr: str, at: float | None = None) -> list[dict]:
    answer = _query(base, expr, at)
    assert answer["status"] == "success", (expr, answer.get("error"))
    return answer["data"]["result"]


def test_the_fixture_holds_vllm_names_types_and_buckets():
    families = {f.name: f for f in text_string_to_metric_families(FIXTURE.read_text())}
    for mapping in prometheus_adapter.SERVING + prometheus_adapter.SAMPLED:
        if mapping.vllm is None:
            continue
        name = mapping.vllm.removesuffix("_total") if mapping.kind == "counter" else mapping.vllm
        assert families[name].type == mapping.kind, mapping.vllm
        for sample in families[name].samples:
            assert sample.labels[sc.VLLM_LABEL_MODEL] == MODEL and sample.labels["engine"] == "0"
    ttft = [float(s.labels["le"]) for s in families[sc.VLLM_TTFT_SECONDS].samples if s.name.endswith("_bucket")]
    assert ttft[:len(sc.TTFT_BUCKETS_S)] == list(sc.TTFT_BUCKETS_S)  # an SLO bound of ours is one of vLLM's
    assert len(ttft) == 23 and ttft[-2] == 2560.0  # vLLM's 22 bounds and +Inf


def test_every_llm_series_is_recorded_from_vllm(prometheus):
    missing = []
    for record, _ in prometheus_adapter.adapter_rules()[prometheus_adapter.GROUP_VLLM]:
        found = _result(prometheus, f'{record}{{{sc.LABEL_SOURCE}="{sc.SOURCE_VLLM}"}}')
        if not found:
            missing.append(record)
        assert all(r["metric"][sc.LABEL_MODEL] == MODEL for r in found), record
    assert not missing


def test_adapted_counts_equal_the_fixture(prometheus):
    """At scrape k the fixture's counters are k windows; the copies say the same, exactly."""
    query = (f'{{__name__=~"{sc.VLLM_REQUEST_SUCCESS_TOTAL}_total|{sc.LLM_REQUESTS_TOTAL}_total",'
             f'finished_reason="stop"}}')
    # Read both at the copy's last evaluation time: the rule saw exactly the raw sample that
    # was latest then (reading "now" races the next scrape against the next evaluation).
    copy = f'{sc.LLM_REQUESTS_TOTAL}_total{{finished_reason="stop"}}'
    deadline = time.monotonic() + 20
    while True:
        stamps = _result(prometheus, f"timestamp({copy})")
        values = ({r["metric"]["__name__"]: float(r["value"][1])
                   for r in _result(prometheus, query, at=float(stamps[0]["value"][1]))}
                  if stamps else {})
        if len(values) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert len(values) == 2 and len(set(values.values())) == 1, values
    assert list(values.values())[0] % 14 == 0  # 14 "stop" requests per window
    [errors] = _result(prometheus, f'{sc.LLM_REQUEST_ERRORS_TOTAL}_total{{{sc.LABEL_CODE}="5xx"}}')
    assert errors["metric"][sc.LABEL_MODEL] == MODEL


def test_every_overview_and_requests_panel_returns_data(prometheus):
    uids = {overview.UID, requests.UID}
    rules = prometheus_adapter.adapter_rules()
    sightline_only = ({record for record, _ in rules[prometheus_adapter.GROUP_SIGHTLINE]}
                      - {record for record, _ in rules[prometheus_adapter.GROUP_VLLM]})
    # explained causes come from Sightline's own request and step spans, which vLLM does not send
    sightline_only.add(sc.COLLECTOR_SLOW_REQUESTS_EXPLAINED + "_total")
    assert promql.bucket(sc.LLM_PREFIX_CACHE_TTFT_SECONDS) in sightline_only
    queries = [q for q in panel_queries(".*", rate_interval="10s", range_="1m", interval="1s")
               if q.dashboard_uid in uids and not promql.series_names(q.expr) & sightline_only]
    assert len(queries) >= 27
    deadline = time.monotonic() + 30
    while True:
        empty = [f"{q.dashboard_uid} / {q.panel_title}: {q.expr}" for q in queries if not _result(prometheus, q.expr)]
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not empty, "\n".join(empty)
