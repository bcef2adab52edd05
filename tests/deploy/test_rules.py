"""Prometheus rules and configs, checked by the real tools: promtool and amtool.

- the committed rule file, PrometheusRule, promtool unit tests, prometheus.yml files and
  alertmanager.yml equal a fresh render (a stale file fails);
- ``promtool check rules`` and ``promtool test rules`` on every unit-test file, which
  cover every alert firing and not firing;
- a rule with a changed threshold makes its unit test fail (the tests can fail);
- ``promtool check config`` and ``amtool check-config`` on rendered configs; a real
  Alertmanager delivers page and ticket alerts to a webhook listener and inhibits;
- every alert has severity/summary/description/runbook_url, and the runbook exists.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from sightline.dashboards import promql
from sightline.deploy import alertmanager_config, prometheus_config, prometheus_rule_tests, prometheus_rules

PROMTOOL = shutil.which("promtool")
AMTOOL = shutil.which("amtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (scripts/setup.sh installs it)")
needs_amtool = pytest.mark.skipif(AMTOOL is None, reason="amtool not installed (scripts/setup.sh installs it)")

RULES = prometheus_rules.RULES_PATH
TEST_DIR = prometheus_rule_tests.TEST_DIR


def _run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_committed_files_are_fresh():
    assert RULES.read_text() == prometheus_rules.render_rules_yaml(), "run python -m sightline.deploy.prometheus_rules"
    assert prometheus_rules.PROMETHEUS_RULE_PATH.read_text() == prometheus_rules.render_prometheus_rule()
    for name, text in prometheus_rule_tests.render_test_files().items():
        assert (TEST_DIR / name).read_text() == text, f"run python -m sightline.deploy.prometheus_rule_tests ({name})"
    assert sorted(p.name for p in TEST_DIR.glob("*.yml")) == sorted(prometheus_rule_tests.render_test_files())
    assert prometheus_config.LOCAL_CONFIG_PATH.read_text() == prometheus_config.render_local()
    assert prometheus_config.COMPOSE_CONFIG_PATH.read_text() == prometheus_config.render_compose()
    assert alertmanager_config.CONFIG_PATH.read_text() == alertmanager_config.render_default()


def test_every_alert_is_unit_tested_firing_and_silent():
    coverage = prometheus_rule_tests.coverage()
    assert len(coverage) == 20
    missing = {name: state for name, state in coverage.items() if state != (True, True)}
    assert not missing, f"alerts without a firing and a silent unit test: {missing}"


def test_every_alert_has_severity_annotations_and_runbook():
    document = yaml.safe_load(RULES.read_text())
    alerts = [rule for group in document["groups"] for rule in group["rules"] if "alert" in rule]
    assert len(alerts) == 20
    for rule in alerts:
        assert rule["labels"]["severity"] in ("page", "ticket"), rule["alert"]
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, rule["alert"]
        assert annotations["summary"] and annotations["description"]
        runbook = annotations["runbook_url"].removeprefix(prometheus_rules.RUNBOOK_BASE_URL + "/")
        assert (prometheus_rules.RUNBOOK_DIR / runbook).is_file(), f"{rule['alert']}: no runbook {runbook}"
    assert {rule["alert"] for rule in alerts if rule["labels"]["severity"] == "page"} == {
        "SightlineTTFTBudgetBurnFast", "SightlineErrorsBudgetBurnFast", "SightlineTargetDown"}


def test_rules_use_only_semconv_names():
    document = yaml.safe_load(RULES.read_text())
    used = set()
    for group in document["groups"]:
        for rule in group["rules"]:
            used |= promql.series_names(rule["expr"])
            if "record" in rule:
                assert promql.is_known_metric(rule["record"]), rule["record"]
    assert len(used) > 20, f"the name extraction found too little: {used}"
    unknown = sorted(name for name in used if name != "up" and not promql.is_known_metric(name))
    assert not unknown, f"names not in semconv: {unknown}"


def test_series_name_extraction():
    assert promql.series_names('histogram_quantile(0.99, sum by (model, le) (rate(a_bucket{le="1.0"}[5m]))) > 1e-05') == {"a_bucket"}
    assert promql.series_names("x:y:z offset 1d / ignoring(le) group_left max by (sm) (b)") == {"x:y:z", "b"}


@needs_promtool
def test_promtool_check_rules():
    result = _run(PROMTOOL, "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 149 rules found" in result.stdout


@needs_promtool
@pytest.mark.parametrize("name", sorted(prometheus_rule_tests.render_test_files()))
def test_promtool_unit_tests(name):
    result = _run(PROMTOOL, "test", "rules", f"tests/{name}", cwd=RULES.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_unit_tests_fail_when_a_threshold_moves(tmp_path):
    """KV usage threshold raised from 95% to 98%: the 97%-for-20-minutes case must fail."""
    slo = prometheus_rules.SloConfig(kv_usage_threshold=0.98)
    (tmp_path / RULES.name).write_text(prometheus_rules.render_rules_yaml(slo))
    (tmp_path / "tests").mkdir()
    shutil.copy(TEST_DIR / "engine.yml", tmp_path / "tests" / "engine.yml")
    result = _run(PROMTOOL, "test", "rules", "tests/engine.yml", cwd=tmp_path)
    assert result.returncode != 0
    assert "SightlineKVCacheNearFull" in result.stdout + result.stderr


def test_slo_config_rejects_bad_values():
    with pytest.raises(ValueError, match="ttft_threshold_s=0.7"):
        prometheus_rules.SloConfig(ttft_threshold_s=0.7)  # not a bucket bound: the alert could never fire
    with pytest.raises(ValueError, match="ttft_objective=1.0"):
        prometheus_rules.SloConfig(ttft_objective=1.0)


@needs_promtool
def test_promtool_check_config_on_committed_and_rendered(tmp_path):
    result = _run(PROMTOOL, "check", "config", str(prometheus_config.LOCAL_CONFIG_PATH))
    assert result.returncode == 0, result.stdout + result.stderr
    shutil.copy(RULES, tmp_path / RULES.name)
    config = prometheus_config.render_prometheus_config(
        {"sightline-engine": "127.0.0.1:18000", "sightline-collector": ["127.0.0.1:18889", "127.0.0.1:18890"]},
        rule_files=[RULES.name],
        alertmanagers=["127.0.0.1:19093"],
        scrape_interval_s=0.5,
        evaluation_interval_s=1,
    )
    (tmp_path / "prometheus.yml").write_text(config)
    result = _run(PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    parsed = yaml.safe_load(config)
    assert parsed["global"]["scrape_interval"] == "500ms"
    assert parsed["scrape_configs"][1]["static_configs"][0]["targets"] == ["127.0.0.1:18889", "127.0.0.1:18890"]


def test_prometheus_config_rejects_bad_targets():
    with pytest.raises(ValueError, match="'localhost'"):
        prometheus_config.render_prometheus_config({"engine": "localhost"})
    with pytest.raises(ValueError, match="99999"):
        prometheus_config.render_prometheus_config({"engine": "127.0.0.1:99999"})
    with pytest.raises(ValueError, match="scrape_interval_s=0.01"):
        prometheus_config.render_prometheus_config({"engine": "127.0.0.1:1"}, scrape_interval_s=0.01)


@needs_amtool
def test_amtool_check_config(tmp_path):
    result = _run(AMTOOL, "check-config", str(alertmanager_config.CONFIG_PATH))
    assert result.returncode == 0, result.stdout + result.stderr
    path = tmp_path / "alertmanager.yml"
    path.write_text(alertmanager_config.render_alertmanager_config("http://127.0.0.1:1/hook", group_wait_s=0.5))
    result = _run(AMTOOL, "check-config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 receivers" in result.stdout


@needs_amtool
def test_alertmanager_routes_by_severity(tmp_path):
    """amtool's own router: page alerts reach the page receiver, the rest the ticket one."""
    path = tmp_path / "alertmanager.yml"
    path.write_text(alertmanager_config.render_default())

    def route(*labels: str) -> str:
        result = _run(AMTOOL, "config", "routes", "test", f"--config.file={path}", *labels)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout.strip()

    assert route("severity=page", "alertname=SightlineTargetDown") == alertmanager_config.PAGE_RECEIVER
    assert route("severity=ticket", "alertname=SightlineSMContention") == alertmanager_config.TICKET_RECEIVER
    assert route("alertname=Unlabelled") == alertmanager_config.TICKET_RECEIVER


def test_alertmanager_config_rejects_bad_url():
    with pytest.raises(ValueError, match="webhook_url='ftp://x'"):
        alertmanager_config.render_alertmanager_config("ftp://x")


ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


@pytest.mark.skipif(ALERTMANAGER is None, reason="Alertmanager not installed (scripts/setup.sh installs it)")
def test_real_alertmanager_routes_and_inhibits(tmp_path):
    """A real Alertmanager with the rendered config delivers to a real webhook listener:
    the page alert to the page URL, an unrelated ticket to the ticket URL, and the ticket
    burn alert of the same SLO and model is inhibited by the page one."""
    import json
    import threading
    import time
    import urllib.request
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tests.support import free_port, wait_for_http

    received: list[tuple[str, dict]] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append((self.path, body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    hook = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{hook.server_address[1]}"
    config = alertmanager_config.render_alertmanager_config(
        f"{base}/page", ticket_webhook_url=f"{base}/ticket", group_wait_s=0.5, group_interval_s=1)
    (tmp_path / "alertmanager.yml").write_text(config)
    port = free_port()
    process = subprocess.Popen(
        [ALERTMANAGER, f"--config.file={tmp_path / 'alertmanager.yml'}", f"--storage.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/-/ready", timeout_s=30, process=process)
        common = {"model": "llama-tiny", "job": "sightline-engine", "instance": "engine-0:8000"}
        alerts = [
            {"alertname": "SightlineTTFTBudgetBurnFast", "severity": "page", "slo": "ttft", **common},
            {"alertname": "SightlineTTFTBudgetBurnSlow", "severity": "ticket", "slo": "ttft", **common},
            {"alertname": "SightlineSMContention", "severity": "ticket", "gpu": "0", "kernel": "fa2"},
        ]
        payload = json.dumps([{"labels": labels, "annotations": {"summary": "test"}} for labels in alerts]).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/api/v2/alerts", data=payload,
                                         headers={"Content-Type": "application/json"})
        assert urllib.request.urlopen(request, timeout=10).status == 200
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len({path for path, _ in received}) < 2:
            time.sleep(0.2)
        time.sleep(2)  # would-be deliveries of the inhibited alert have had their chance
    finally:
        process.terminate()
        process.wait(timeout=20)
        hook.shutdown()
    delivered = {(path, alert["labels"]["alertname"]) for path, body in received for alert in body["alerts"]}
    assert delivered == {("/page", "SightlineTTFTBudgetBurnFast"), ("/ticket", "SightlineSMContention")}
