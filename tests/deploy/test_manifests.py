"""Kubernetes manifests and the compose file: valid, consistent with each other and with
the code they run.

- every built-in Kubernetes object validates against the bundled OpenAPI schema
  (kubernetes-validate, strict: unknown fields fail); CRDs (PrometheusRule,
  ServiceMonitor) have no schema there and are skipped *explicitly*; the
  PrometheusRule's rules are checked by promtool instead and equal
  deploy/prometheus/sightline-rules.yml;
- references resolve: ConfigMaps mounted, Service selectors and named ports, the HPA's
  target and metric (a semconv name), the gateway's DNS resolver (the headless Service);
- the otelcol configs' pipelines only name defined components, and the gateway routes
  spans by trace id and metrics by resource;
- every container command parses with the real ``sightline`` CLI;
- compose parses, has every service, and every file it mounts or builds from exists.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from sightline.deploy import prometheus_rules
from sightline.instrumentation import semconv as sc

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
COMPOSE = REPO / "deploy" / "compose" / "compose.yaml"
CRD_KINDS = {"PrometheusRule", "ServiceMonitor"}  # Prometheus Operator CRDs: no bundled schema
PROMTOOL = shutil.which("promtool")


def _documents() -> list[tuple[str, dict]]:
    documents = []
    for path in sorted(K8S.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                documents.append((path.name, document))
    return documents


def _by_kind(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for _, doc in _documents() if doc["kind"] == kind}


def test_builtin_objects_validate_against_the_kubernetes_schema():
    version = kubernetes_validate.latest_version()
    validated, skipped = [], []
    for filename, document in _documents():
        name = f"{filename}:{document['kind']}/{document['metadata']['name']}"
        if document["kind"] in CRD_KINDS:
            skipped.append(name)
            continue
        kubernetes_validate.validate(document, version, strict=True)  # raises ValidationError
        validated.append(name)
    kinds = {name.split(":")[1].split("/")[0] for name in validated}
    assert kinds == {"Namespace", "ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler"}
    assert len(skipped) == 3, skipped  # one PrometheusRule, two ServiceMonitors


def test_the_schema_check_can_fail():
    deployment = dict(_by_kind("Deployment")["sightline-engine"])
    deployment["spec"] = {**deployment["spec"], "replicas": "one"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(), strict=True)


def test_prometheus_rule_equals_the_rule_file():
    rule = _by_kind("PrometheusRule")["sightline-rules"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == yaml.safe_load(prometheus_rules.RULES_PATH.read_text())


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (scripts/setup.sh installs it)")
def test_prometheus_rule_passes_promtool(tmp_path):
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(_by_kind("PrometheusRule")["sightline-rules"]["spec"]))
    result = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def test_references_resolve():
    deployments, services, configmaps = _by_kind("Deployment"), _by_kind("Service"), _by_kind("ConfigMap")
    assert set(deployments) == {"sightline-engine", "sightline-otel-gateway", "sightline-collector"}
    for name, deployment in deployments.items():
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items(), name
        for volume in _pod_spec(deployment).get("volumes", []):
            if "hostPath" in volume:   # only the engine's compile cache lives on the node
                assert (name, volume["name"]) == ("sightline-engine", "compile-cache")
                continue
            assert volume["configMap"]["name"] in configmaps, (name, volume)
    for name, service in services.items():
        matching = [d for d in deployments.values()
                    if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matching) == 1, name
        port_names = {p["name"] for c in _pod_spec(matching[0])["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, (name, port)
    engine = _pod_spec(deployments["sightline-engine"])
    assert [c["name"] for c in engine["containers"]] == ["engine", "otelcol"]  # the sidecar
    assert services["sightline-collector-otlp"]["spec"]["clusterIP"] == "None"  # headless, for the DNS resolver


def test_engine_probes_fit_the_start_up_and_the_compile_cache_is_a_volume():
    """Readiness is /health (503 until warm), liveness /live (200 once HTTP is served); the
    start-up probe waits on /health at least as long as the warm-up and graph capture may
    take (their limits, from the container's own flags); the compile cache directory the
    engine is given is the mounted volume."""
    from sightline.deploy.cli import build_parser

    pod = _pod_spec(_by_kind("Deployment")["sightline-engine"])
    engine = pod["containers"][0]
    assert engine["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert engine["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    startup = engine["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    args = build_parser().parse_args(engine["args"][1:])
    allowed_s = startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"]
    assert args.warmup and allowed_s >= args.warmup_limit_s + args.cuda_graph_capture_limit_s + 60
    [mount] = [m for m in engine["volumeMounts"] if m["name"] == "compile-cache"]
    assert mount["mountPath"] == args.compile_cache_dir and not mount.get("readOnly")
    [volume] = [v for v in pod["volumes"] if v["name"] == "compile-cache"]
    assert volume["hostPath"] == {"path": args.compile_cache_dir, "type": "DirectoryOrCreate"}
    compose = yaml.safe_load(COMPOSE.read_text())
    service = compose["services"]["engine"]
    cache_dir = build_parser().parse_args(service["command"][1:]).compile_cache_dir
    assert f"compile-cache:{cache_dir}" in service["volumes"] and "compile-cache" in compose["volumes"]


def test_hpa_scales_the_engine_on_queue_depth():
    hpa = _by_kind("HorizontalPodAutoscaler")["sightline-engine"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "sightline-engine"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == sc.ENGINE_WAITING


def _otelcol_config(configmap: str) -> dict:
    return yaml.safe_load(_by_kind("ConfigMap")[configmap]["data"]["config.yaml"])


def _check_pipelines(config: dict) -> None:
    for pipeline, spec in config["service"]["pipelines"].items():
        for section in ("receivers", "processors", "exporters"):
            for component in spec.get(section, []):
                assert component in config[section], (pipeline, section, component)
    for extension in config["service"].get("extensions", []):
        assert extension in config["extensions"]


def test_gateway_load_balances_by_trace_id_and_resource():
    config = _otelcol_config("sightline-otel-gateway")
    _check_pipelines(config)
    pipelines = config["service"]["pipelines"]
    traces = config["exporters"][pipelines["traces"]["exporters"][0]]
    metrics = config["exporters"][pipelines["metrics"]["exporters"][0]]
    assert traces["routing_key"] == "traceID"
    assert metrics["routing_key"] == "resource"
    headless = _by_kind("Service")["sightline-collector-otlp"]
    for exporter in (traces, metrics):
        resolver = exporter["resolver"]["dns"]
        assert resolver["hostname"] == f"{headless['metadata']['name']}.{headless['metadata']['namespace']}.svc.cluster.local"
        assert resolver["port"] == headless["spec"]["ports"][0]["port"]


def test_sidecar_forwards_to_the_gateway():
    config = _otelcol_config("sightline-engine-otelcol")
    _check_pipelines(config)
    gateway = _by_kind("Service")["sightline-otel-gateway"]
    endpoint = config["exporters"]["otlp"]["endpoint"]
    assert endpoint == f"sightline-otel-gateway.{gateway['metadata']['namespace']}.svc.cluster.local:4317"
    engine = _pod_spec(_by_kind("Deployment")["sightline-engine"])["containers"][0]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:4317"
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "127.0.0.1:4317"


def _parses_with_sightline(argv: list[str]) -> None:
    from sightline.deploy.cli import build_parser

    assert argv[0] == "sightline"
    build_parser().parse_args(argv[1:])  # SystemExit on an unknown flag


def test_container_commands_parse_with_the_real_cli():
    for name in ("sightline-engine", "sightline-collector"):
        container = _pod_spec(_by_kind("Deployment")[name])["containers"][0]
        _parses_with_sightline(container["args"])
    compose = yaml.safe_load(COMPOSE.read_text())
    for service in ("engine", "collector"):
        _parses_with_sightline(compose["services"][service]["command"])


def test_compose_services_and_files():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == {"engine", "otelcol", "collector", "prometheus", "alertmanager", "grafana", "tempo"}
    assert services["otelcol"]["network_mode"] == "service:engine"  # a sidecar: shares the engine's localhost
    base = COMPOSE.parent
    mounted = 0
    for name, service in services.items():
        for volume in service.get("volumes", []):
            host = volume.split(":")[0]
            if host.startswith((".", "/")):
                assert (base / host).resolve().exists(), (name, volume)
                mounted += 1
        build = service.get("build")
        if build:
            context = (base / build["context"]).resolve()
            assert (context / build["dockerfile"]).is_file(), name
            assert (context / "pyproject.toml").is_file()
        for dependency in service.get("depends_on", []):
            assert dependency in services, (name, dependency)
    assert mounted == 7
    otelcol = yaml.safe_load((base / "otelcol.yaml").read_text())
    _check_pipelines(otelcol)
    assert "otlp/tempo" in otelcol["service"]["pipelines"]["traces"]["exporters"]  # exemplar links resolve
    prometheus = yaml.safe_load((base / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job["static_configs"][0]["targets"] for job in prometheus["scrape_configs"]}
    assert jobs == {sc.SERVICE_NAME_ENGINE: ["engine:8000"], sc.SERVICE_NAME_COLLECTOR: ["collector:8889"]}
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]


def test_the_query_api_is_not_open_to_the_network():
    """Kubernetes listens on every interface: the query API takes a token from a Secret. Compose
    publishes the query port on the host's loopback only. (``sightline up`` binds loopback.)"""
    collector = _pod_spec(_by_kind("Deployment")["sightline-collector"])["containers"][0]
    assert "--query-auth" in collector["args"]
    [token] = [e for e in collector["env"] if e["name"] == "SIGHTLINE_COLLECTOR_READ_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "sightline-collector-read-token", "key": "token"}
    compose = yaml.safe_load(COMPOSE.read_text())
    assert "127.0.0.1:8889:8889" in compose["services"]["collector"]["ports"]


def test_the_kubernetes_collector_command_refuses_the_query_api_without_the_token(tmp_path):
    """The manifest's own command line, run for real: /api/v1 401 without the token, 200 with."""
    import os
    import signal
    import sys
    import urllib.error
    import urllib.request

    from tests.support import free_port, wait_for_collector

    args = list(_pod_spec(_by_kind("Deployment")["sightline-collector"])["containers"][0]["args"])
    for flag in ("--otlp-grpc", "--otlp-http", "--zipkin", "--http"):  # free loopback ports
        args[args.index(flag) + 1] = f"127.0.0.1:{free_port()}"
    query = args[args.index("--http") + 1]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SIGHTLINE_COLLECTOR")},
           "SIGHTLINE_COLLECTOR_READ_TOKEN": "reader-token"}
    process = subprocess.Popen([sys.executable, "-m", "sightline.deploy.cli", *args[1:]], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_collector(f"http://{query}", process)

        def status(path: str, token: str | None = None) -> int:
            request = urllib.request.Request(f"http://{query}{path}")
            if token:
                request.add_header("Authorization", f"Bearer {token}")
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    return response.status
            except urllib.error.HTTPError as error:
                return error.code

        assert status("/api/v1/kernels") == 401 and status("/api/v1/kernels", "wrong") == 401
        assert status("/api/v1/kernels", "reader-token") == 200
        assert status("/metrics") == 200 and status("/healthz") == 200
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
