"""Dashboards as code: fresh, complete, named from semconv, and valid PromQL.

- the committed JSON and Grafana provisioning equal a fresh build (a stale file fails);
- every panel has a query, ids are unique, the grid fits 24 columns;
- every series name and label in every query comes from semconv;
- histogram queries ask for exemplars, and the Prometheus datasource turns the
  exemplar trace-id label into a Tempo link;
- every panel query (variables substituted) is accepted by a real Prometheus;
- the publish plan is idempotent (same actions, overwrite by uid). Grafana itself cannot
  be installed here, so the HTTP calls of ``publish`` are not exercised.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.parse
import urllib.request

import pytest
import yaml

from sightline.dashboards import build, panels, promql, provisioning, publish
from sightline.instrumentation import semconv as sc
from tests.support import free_port, wait_for_http

PROMETHEUS = shutil.which("prometheus")


def _committed() -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted(build.DEFAULT_OUT.glob("*.json"))}


def test_committed_json_equals_fresh_build():
    fresh = build.render_all()
    assert sorted(fresh) == sorted(_committed()), "run: sightline dashboards build"
    for name, text in fresh.items():
        assert (build.DEFAULT_OUT / name).read_text() == text, f"{name} is stale: run sightline dashboards build"


def test_committed_provisioning_equals_fresh_render():
    for relative, text in provisioning.provisioning_files().items():
        path = provisioning.DEFAULT_PROVISIONING_OUT / relative
        assert path.read_text() == text, f"{path} is stale: run sightline dashboards build"


def test_build_command_writes_the_same_files(tmp_path):
    import argparse

    from sightline.dashboards import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["dashboards", "build", "--out", str(tmp_path / "json"),
                              "--provisioning-out", str(tmp_path / "prov")])
    assert args.handler(args) == 0
    for name, text in build.render_all().items():
        assert (tmp_path / "json" / name).read_text() == text
    assert (tmp_path / "prov" / "datasources" / "sightline.yaml").is_file()


def test_four_dashboards_with_their_variables():
    dashboards = {d["uid"]: d for d in _committed().values()}
    assert set(dashboards) == {"sightline-overview", "sightline-requests", "sightline-gpu", "sightline-pipeline"}
    variables = {uid: [v["name"] for v in d.get("templating", {}).get("list", [])] for uid, d in dashboards.items()}
    ds = panels.DATASOURCE_VARIABLE
    assert variables["sightline-overview"] == [ds, sc.LABEL_MODEL]
    assert variables["sightline-requests"] == [ds, sc.LABEL_MODEL, sc.LABEL_PRIORITY]
    assert variables["sightline-gpu"] == [ds, sc.LABEL_GPU, sc.LABEL_KERNEL]
    for dashboard in dashboards.values():
        for variable in dashboard.get("templating", {}).get("list", [])[1:]:
            match = re.fullmatch(r"label_values\(([\w:]*)(\{.*\})?, (\w+)\)", variable["query"])
            assert match, variable["query"]
            names = [match.group(1)] if match.group(1) else \
                re.search(r'__name__=~"([^"]+)"', match.group(2)).group(1).split("|")
            assert all(promql.is_known_metric(name) for name in names), names
            assert match.group(3) in promql.known_label_names()
            assert variable["allValue"] == ".*" and variable["multi"] and variable["includeAll"]
    kernel = next(v for v in dashboards["sightline-gpu"]["templating"]["list"] if v["name"] == sc.LABEL_KERNEL)
    assert promql.count(sc.COLLECTOR_KERNEL_DURATION_SECONDS) in kernel["query"]  # CUPTI-only kernels too


def test_every_panel_has_a_query_and_fits_the_grid():
    for name, dashboard in _committed().items():
        ids = [panel["id"] for panel in dashboard["panels"]]
        assert ids == list(range(1, len(ids) + 1)), name
        for panel in dashboard["panels"]:
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24, (name, panel["title"])
            if panel["type"] == "row":
                continue
            targets = panel.get("targets") or []
            assert targets and all(t["expr"].strip() for t in targets), (name, panel["title"])
            assert panel["datasource"] == {"type": "prometheus", "uid": f"${{{panels.DATASOURCE_VARIABLE}}}"}


def test_panels_the_brief_asks_for():
    titles = {d["uid"]: {p["title"]: p for p in d["panels"]} for d in _committed().values()}
    gpu = titles["sightline-gpu"]
    per_sm = gpu["Per-SM CTA P99, GPU $gpu"]
    assert per_sm["type"] == "heatmap" and per_sm["repeat"] == sc.LABEL_GPU
    assert per_sm["targets"][0]["legendFormat"] == "{{sm}}"
    assert sc.COLLECTOR_SM_CTA_P99_SECONDS in per_sm["targets"][0]["expr"]
    matrix = gpu["Kernel x CTA duration, all SMs, GPU $gpu"]
    assert matrix["transformations"][0]["id"] == "groupingToMatrix"
    assert promql.bucket(sc.COLLECTOR_GPU_CTA_DURATION_SECONDS) in matrix["targets"][0]["expr"]
    assert gpu["Kernel duration, $kernel"]["targets"][0]["format"] == "heatmap"
    requests = titles["sightline-requests"]
    assert requests["TTFT, priority $priority"]["repeat"] == sc.LABEL_PRIORITY
    for title in ("Sampled requests by priority", "Sampled requests by finish reason"):
        assert "Sampled traffic only" in requests[title]["description"]
    assert len(requests["Mean time per phase"]["targets"]) == 3
    overview = titles["sightline-overview"]
    for title in ("Time to first token", "Inter-token latency", "Time per output token", "End-to-end latency"):
        exprs = [t["expr"] for t in overview[title]["targets"]]
        assert [e.split(",")[0] for e in exprs] == ["histogram_quantile(0.5", "histogram_quantile(0.99"]


def test_queries_use_only_semconv_names_and_labels():
    used = set()
    for uid, title, expr in build.panel_queries():
        names = promql.series_names(expr)
        assert names, (uid, title, expr)
        used |= names
        unknown = [n for n in names if n != "up" and not promql.is_known_metric(n)]
        assert not unknown, (uid, title, unknown)
        labels = set(re.findall(r"(\w+)\s*=~?\"", expr))
        for grouping in re.findall(r"\b(?:by|without|ignoring|on)\s*\(([^)]*)\)", expr):
            labels |= {label.strip() for label in grouping.split(",") if label.strip()}
        assert labels <= promql.known_label_names(), (uid, title, labels - promql.known_label_names())
    assert len(used) >= 30


# Histograms whose observations carry trace-id exemplars: the engine's TTFT (also by prefix
# cache outcome), ITL and e2e, and every span-derived histogram of the collector.
_WITH_EXEMPLARS = (sc.ENGINE_TTFT_SECONDS, sc.ENGINE_PREFIX_CACHE_TTFT_SECONDS, sc.ENGINE_ITL_SECONDS,
                   sc.ENGINE_E2E_SECONDS, "sightline_request_",
                   "sightline_kernel_", "sightline_step_", "sightline_sm_")


def test_histogram_queries_request_exemplars():
    """A histogram query asks for exemplars exactly when a series it selects carries them;
    on the llm: copies (recording rules drop exemplars) it must name that source series."""
    checked = 0
    for dashboard in _committed().values():
        if dashboard["uid"] == "sightline-pipeline":
            continue  # the collector's self-metrics carry no trace ids
        for panel in dashboard["panels"]:
            for target in panel.get("targets") or []:
                expr = target["expr"]
                is_histogram = "histogram_quantile" in expr or target.get("format") == "heatmap"
                if not (is_histogram and "_bucket" in expr):
                    continue
                sources = [n for n in promql.series_names(expr) if not n.startswith("llm:")]
                carries = any(n.startswith(_WITH_EXEMPLARS) for n in sources)
                assert target["exemplar"] is carries, (dashboard["uid"], panel["title"], sources)
                checked += carries
    assert checked >= 15


def test_exemplars_link_to_tempo():
    document = yaml.safe_load(provisioning.render_datasources())
    by_uid = {ds["uid"]: ds for ds in document["datasources"]}
    destinations = by_uid[panels.PROMETHEUS_DATASOURCE_UID]["jsonData"]["exemplarTraceIdDestinations"]
    assert destinations == [{"name": sc.EXEMPLAR_TRACE_ID_LABEL, "datasourceUid": panels.TEMPO_DATASOURCE_UID}]
    assert by_uid[panels.TEMPO_DATASOURCE_UID]["type"] == "tempo"
    provider = yaml.safe_load(provisioning.render_dashboard_provider())["providers"][0]
    assert provider["options"]["path"] == provisioning.DASHBOARDS_MOUNT
    with pytest.raises(ValueError, match="prometheus_url='prometheus:9090'"):
        provisioning.render_datasources(prometheus_url="prometheus:9090")


def test_panel_queries_substitute_every_variable():
    queries = build.panel_queries(value="llama|0")
    assert len(queries) == sum(len(panels.all_queries(s)) for s in build.specs())
    for uid, title, expr in queries:
        assert "$" not in expr, (uid, title, expr)
    assert any('model=~"llama|0"' in q.expr for q in queries)
    with pytest.raises(ValueError, match=r"\$nope"):
        build.substitute("rate(x{a=~\"$nope\"}[5m])")
    assert build.substitute('label_replace(x, "a", "$1", "b", "(.*)")') == 'label_replace(x, "a", "$1", "b", "(.*)")'


@pytest.fixture(scope="module")
def prometheus_url(tmp_path_factory):
    if PROMETHEUS is None:
        pytest.skip("prometheus not installed (scripts/setup.sh installs it)")
    folder = tmp_path_factory.mktemp("prometheus")
    (folder / "prometheus.yml").write_text("global:\n  scrape_interval: 15s\n")
    port = free_port()
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--enable-feature=exemplar-storage"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_http(f"http://127.0.0.1:{port}/-/ready", timeout_s=30, process=process)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=20)


def _query(base: str, expr: str) -> dict:
    data = urllib.parse.urlencode({"query": expr}).encode()
    try:
        with urllib.request.urlopen(f"{base}/api/v1/query", data=data, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:  # 400 carries the parse error as JSON
        return json.loads(exc.read())


def test_every_panel_query_parses_in_prometheus(prometheus_url):
    assert _query(prometheus_url, "sum(rate(x[1m]")["status"] == "error"  # the check can fail
    for uid, title, expr in build.panel_queries():
        answer = _query(prometheus_url, expr)
        assert answer["status"] == "success", (uid, title, expr, answer.get("error"))
    for uid, title, expr in build.panel_queries(value="0", rate_interval="30s", range_="5m"):
        assert _query(prometheus_url, expr)["status"] == "success", (uid, title, expr)


def test_every_variable_selector_is_accepted_by_prometheus(prometheus_url):
    """Grafana resolves label_values(selector, label) through /api/v1/series?match[]=selector."""
    checked = 0
    for spec in build.specs():
        for variable in spec.variables:
            selector = build.substitute(re.fullmatch(r"label_values\((.*), \w+\)", variable.query).group(1))
            query = urllib.parse.urlencode({"match[]": selector})
            with urllib.request.urlopen(f"{prometheus_url}/api/v1/series?{query}", timeout=10) as response:
                assert json.loads(response.read())["status"] == "success", selector
            checked += 1
    assert checked == 5


def test_publish_plan_is_idempotent_and_overwrites_by_uid():
    first, second = publish.plan(), publish.plan()
    assert first == second
    assert [a.kind for a in first] == ["ensure_folder"] + ["upsert_dashboard"] * 4
    for action in first[1:]:
        assert action.payload["overwrite"] is True
        assert action.payload["folderUid"] == publish.FOLDER_UID
        assert action.payload["dashboard"]["uid"] == action.uid
        assert "id" not in action.payload["dashboard"]  # Grafana matches by uid, never a stale id
    assert publish.publish("http://127.0.0.1:1", dry_run=True) == first  # dry run: no connection made
    with pytest.raises(ValueError, match="folder uid"):
        publish.plan(folder_uid="")
