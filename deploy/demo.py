"""``sightline demo``: the whole pipeline on this machine, in a few minutes, then a summary.

Steps, one printed line each: bring the local stack up (deploy/stack.py; CPU and the
``tiny`` model by default, CUDA and ``llama-1b`` when a GPU is present, which then traces
its own kernels and CTAs); drive a mixed-priority streamed load (deploy/load.py); without a
GPU, replay the recorded H200 capture (deploy/captures/h200-*.jsonl.gz) into the collector
so that the per-SM heatmaps hold real GPU data, and say plainly that this data is recorded,
not from this machine; ask the collector to explain the slowest requests, fetch the
heatmaps, build the dashboards' JSON and write a summary.

Outputs under ``out_dir`` (default ``sightline-out/``): ``summary.txt``, ``summary.json``,
``requests.jsonl``, ``explain/``, ``heatmaps/``, ``dashboards/``, ``logs/``. Cost: the
engine's start, its CPU forward passes and the capture's replay dominate.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from ..collector.aggregation_config import WindowConfig
from ..instrumentation import check_range, read_capture_meta
from .demo_incident import (SM_CONTENTION_ALERT, demo_rules, format_incident, incident_record,
                            screenshot_heatmap, story_kernel, wait_for_alert)
from .incident import Finding, Incident, find
from .load import LoadConfig, LoadResult, format_summary, run_load_sync
from .stack import Stack, StackConfig, format_urls

__all__ = ["DemoConfig", "DemoReport", "demo", "run_demo", "find_capture", "INCIDENT_CAPTURE"]

_REPO_ROOT = Path(__file__).resolve().parent.parent
CAPTURES_DIR = _REPO_ROOT / "deploy" / "captures"
# The recorded H200 incident (bench/record_incident.py writes it under this name)
INCIDENT_CAPTURE = CAPTURES_DIR / "h200-noisy-neighbour.jsonl.gz"


@dataclass(frozen=True)
class DemoConfig:
    out_dir: Path = Path("sightline-out")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    model: str | None = None
    trace_level: str | None = None
    requests: int = 36
    concurrency: int = 12
    # The engine runs at most this many requests per step, so that a load above it queues
    # and the priority scheduler visibly serves priority 0 first. None: engine default.
    max_num_seqs: int | None = 4
    priorities: tuple[int, ...] = (0, 1, 2)
    max_tokens: int = 16
    stream: bool = True
    capture: Path | None = None  # None: find_capture()
    slowest: int = 3
    incident_slowest: int = 10  # the replayed capture's slowest requests explained (with their cause)
    telemetry_settle_s: float = 20.0  # how long to wait for spans to reach the collector
    # 0: the capture lands at once, shifted to end now with its spacing kept (its minutes
    # fill the heatmap's columns); N: replayed live at N x, time compressed.
    replay_speed: float = 0.0
    # The SM-hotspot alert waits 15 min in production; the demo's Prometheus waits this.
    alert_for_s: int = 5
    alert_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        check_range("DemoConfig.slowest", self.slowest, 0, 50, integer=True)
        check_range("DemoConfig.incident_slowest", self.incident_slowest, 0, 50, integer=True)
        check_range("DemoConfig.telemetry_settle_s", self.telemetry_settle_s, 0, 600, lo_open=True)
        if self.max_num_seqs is not None:
            check_range("DemoConfig.max_num_seqs", self.max_num_seqs, 1, 4096, integer=True)
        check_range("DemoConfig.replay_speed", self.replay_speed, 0, 1000)
        check_range("DemoConfig.alert_for_s", self.alert_for_s, 0, 3600)
        check_range("DemoConfig.alert_timeout_s", self.alert_timeout_s, 1, 3600)
        if self.capture is not None and not Path(self.capture).is_file():
            raise ValueError(f"DemoConfig.capture={str(self.capture)!r} is not a file")
        self.load_config("http://127.0.0.1:1")  # the load's own checks, before anything starts

    def load_config(self, url: str) -> LoadConfig:
        return LoadConfig(url=url, requests=self.requests, concurrency=self.concurrency,
                          priorities=self.priorities, max_tokens=self.max_tokens,
                          stream=self.stream)


@dataclass
class DemoReport:
    """What the demo produced; ``files`` maps a description to a path under out_dir."""

    out_dir: Path
    device: str
    model: str
    load: LoadResult
    gpu_data_source: str  # "live" | "recorded H200 capture <path>" | "none: <why>"
    explanations: list[dict[str, Any]] = field(default_factory=list)
    hotspots: list[str] = field(default_factory=list)  # one line per (gpu, kernel)
    incident: Incident | None = None  # what the replayed capture says was planted
    findings: list[Finding] = field(default_factory=list)
    alerts: list[dict[str, Any]] = field(default_factory=list)  # SM-hotspot alerts in Alertmanager
    story_kernel: str | None = None   # the kernel whose per-SM view the story follows
    files: dict[str, Path] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def find_capture() -> Path | None:
    """The recorded H200 incident capture, else the newest recorded H200 capture in
    deploy/captures/, else None."""
    if INCIDENT_CAPTURE.is_file():
        return INCIDENT_CAPTURE
    captures = sorted(CAPTURES_DIR.glob("h200-*.jsonl.gz"))
    return captures[-1] if captures else None


def _get(url: str, timeout_s: float = 10.0) -> tuple[int, bytes, str]:
    request = urllib.request.Request(url, headers={"Accept": "*/*"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Content-Type", "")


def _get_json(url: str, timeout_s: float = 10.0) -> Any:
    status, body, _ = _get(url, timeout_s)
    if status != 200:
        raise RuntimeError(f"GET {url} answered {status}: {body[:300]!r}")
    return json.loads(body)


class _Say:
    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.start = time.monotonic()

    def __call__(self, text: str) -> None:
        self.stream.write(f"[{time.monotonic() - self.start:6.1f}s] {text}\n")
        self.stream.flush()


def _wait_for_traces(collector_url: str, trace_ids: list[str], timeout_s: float) -> int:
    """Polls the collector's trace store until it holds the request spans of ``trace_ids``;
    returns how many it has."""
    deadline = time.monotonic() + timeout_s
    found: set[str] = set()
    while True:
        for trace_id in trace_ids:
            if trace_id in found:
                continue
            status, body, _ = _get(f"{collector_url}/api/v1/traces/{trace_id}", timeout_s=5)
            # Complete once the request's SERVER span (OTLP kind 2) is in: it ends, so
            # it is exported, after all of its phases.
            if status == 200 and any(span.get("kind") == 2
                                     for span in json.loads(body).get("spans", [])):
                found.add(trace_id)
        if len(found) == len(trace_ids) or time.monotonic() > deadline:
            return len(found)
        time.sleep(0.5)


def _explained(collector_url: str, keep, limit: int) -> dict[str, Any]:
    """The collector's explanation of every stored request (slowest first), filtered by
    ``keep(trace_id)`` and cut to ``limit``; same shape as ``/api/v1/explain``."""
    result = _get_json(f"{collector_url}/api/v1/explain?quantile=0&limit=1000", timeout_s=60)
    kept = [r for r in result.get("requests", []) if keep(r.get("trace_id", ""))]
    return dict(result, requests=kept[:limit], requests_considered=len(kept))


def _format_explanation(result: dict[str, Any]) -> str:
    """The collector's own text rendering, under a header that says what was selected."""
    from ..collector.query_cli import format_explanation

    try:
        text = format_explanation(result)
    except (KeyError, TypeError):  # an answer of another shape: show it raw, not crash
        return json.dumps(result, indent=2)[:4000]
    if not result.get("requests"):
        return text
    # Its first line names a quantile; these were chosen as the slowest N instead.
    body = text.split("\n", 1)[1] if "\n" in text else ""
    return (f"the {len(result['requests'])} slowest (end to end) of "
            f"{result['requests_considered']} requests:" + "\n" + body.lstrip("\n"))


def _replay_capture(capture: Path, otlp_http_url: str, speed: float, signals: tuple[str, ...],
                    time_map=None) -> tuple[str, Any]:
    """Replays ``signals`` of ``capture`` into the collector (on ``time_map`` when given);
    a one-line account and the replay's TimeMap."""
    from ..collector.replay import HttpSink, ReplayConfig, replay

    from ..collector.aggregation_config import WindowConfig
    aligned = ReplayConfig(speed=speed, rebase=True, signals=signals, align_slot_s=WindowConfig().slot_s)
    result = replay(capture, HttpSink(otlp_http_url), aligned, time_map=time_map)
    pace = "at once, shifted to end now" if speed == 0 else f"at {speed:g}x, time compressed"
    what = f"{result.spans} spans" if signals == ("traces",) else f"{result.data_points} data points"
    return f"{result.exports} exports ({what}) in {result.duration_s:.1f}s ({pace})", result.time_map


def _fetch_heatmaps(collector_url: str, folder: Path) -> tuple[list[Path], list[str], list[dict]]:
    """Both views of every (gpu, kernel) with per-SM data, as PNG and HTML (the time x SM
    view also as JSON), plus index.html; one line per (gpu, kernel) naming its hottest SM
    (from the JSON view); and the time x SM heatmaps' JSON."""
    folder.mkdir(parents=True, exist_ok=True)
    kernels = _get_json(f"{collector_url}/api/v1/kernels").get("kernels", [])
    written: list[Path] = []
    hotspots: list[str] = []
    time_sm: list[dict] = []
    for entry in kernels:
        if entry.get("source") != "sm_probe":
            continue
        pair = {"gpu": entry["gpu"], "kernel": entry["kernel"]}
        stem = f"gpu{_slug(str(entry['gpu']))}-{_slug(entry['kernel'])}"
        for kind in ("time_sm", "sm_latency"):
            for fmt in ("png", "html", "json"):
                query = urllib.parse.urlencode({**pair, "kind": kind, "format": fmt})
                status, body, _ = _get(f"{collector_url}/api/v1/heatmap?{query}", timeout_s=60)
                if status != 200:
                    continue
                path = folder / f"{stem}-{kind}.{fmt}"
                path.write_bytes(body)
                written.append(path)
                if fmt == "json" and kind == "time_sm":
                    time_sm.append({**json.loads(body), "gpu_index": entry.get("gpu_index")})
                elif fmt == "json":
                    line = _hotspot_line(json.loads(body))
                    if line:
                        hotspots.append(line)
    if written:
        status, body, _ = _get(f"{collector_url}/api/v1/heatmap.html", timeout_s=60)
        if status == 200:
            (folder / "index.html").write_bytes(body)
            written.append(folder / "index.html")
    return written, hotspots, time_sm


def _hotspot_line(heatmap: dict[str, Any]) -> str | None:
    spot = heatmap.get("hotspot") or {}
    sm, median, ratio = spot.get("hottest_sm"), spot.get("median_p99_s"), spot.get("ratio")
    if sm is None or median is None or ratio is None:
        return None
    p99 = (spot.get("p99_s") or {}).get(sm)
    p99_text = f"{p99 * 1e6:.1f} us" if p99 is not None else "?"
    return (f"GPU {heatmap.get('gpu')} {str(heatmap.get('kernel'))[:60]}: hottest SM {sm}, CTA P99 "
            f"{p99_text} = {ratio:.2f}x the median SM's {median * 1e6:.1f} us "
            f"({len(heatmap.get('sms', []))} SMs)")


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:80].strip("_") or "x"


def _build_dashboards(folder: Path) -> list[Path]:
    from ..dashboards.build import build_all

    return list(build_all(folder))


def _prometheus_value(prometheus_url: str, expr: str) -> float | None:
    query = urllib.parse.urlencode({"query": expr})
    try:
        answer = _get_json(f"{prometheus_url}/api/v1/query?{query}")
    except (RuntimeError, OSError, ValueError):
        return None
    result = answer.get("data", {}).get("result", [])
    return float(result[0]["value"][1]) if result else None


def _wait_prometheus(prometheus_url: str, expr: str, want: float, timeout_s: float) -> float | None:
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        value = _prometheus_value(prometheus_url, expr)
        if value is not None and value >= want:
            return value
        time.sleep(0.5)
    return value


def _firing_alerts(alertmanager_url: str) -> list[str]:
    try:
        alerts = _get_json(f"{alertmanager_url}/api/v2/alerts")
    except (RuntimeError, OSError, ValueError):
        return []
    return sorted({a.get("labels", {}).get("alertname", "?") for a in alerts})


def demo(config: DemoConfig, *, stream: IO[str] = sys.stdout,
         progress: IO[str] | None = sys.stderr) -> DemoReport:
    """Runs the demo and returns its report (the stack is stopped on return)."""
    say = _Say(stream)
    out = Path(config.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("heatmaps", "explain"):  # the demo's own folders: no leftovers of a last run
        shutil.rmtree(out / stale, ignore_errors=True)
    engine_args = (("--max-num-seqs", str(config.max_num_seqs))
                   if config.max_num_seqs is not None else ())
    # The per-SM gauges and contention flags cover a recorded capture's length (the default
    # horizon), so a replayed incident counts wherever it lies in the capture; the collector
    # keeps twice that, so the capture's first minute is still there when the demo explains
    # its requests after replaying its spans (the per-SM evidence of their causes).
    capture_s = WindowConfig().horizon_s
    window = WindowConfig(num_slots=2 * WindowConfig().num_slots)
    stack_config = StackConfig(run_dir=out, device=config.device, model=config.model,
                               trace_level=config.trace_level, prefer_default_ports=False,
                               engine_args=engine_args, fresh_data=True,
                               collector_args=("--gauge-window-s", f"{capture_s:g}",
                                               "--window-slots", str(window.num_slots)),
                               rules_files=demo_rules(out / "prometheus", config.alert_for_s))
    stack = Stack(stack_config)
    device, model = stack_config.resolved_device, stack_config.resolved_model
    say(f"starting the stack: engine ({model} on {device}), rotel, collector, Prometheus, "
        f"Alertmanager; logs in {stack.log_dir}")
    stack.start(on_started=lambda name, seconds: say(f"  {name} ready ({seconds:.1f}s)"))
    try:
        p = stack.ports
        say("up:\n" + format_urls(stack.urls()))
        load_config = config.load_config(p.engine_url)
        say(f"load: {config.requests} streamed completions, priorities "
            f"{','.join(map(str, config.priorities))}, {config.concurrency} in flight, "
            f"{config.max_tokens} tokens each")
        result = run_load_sync(load_config, progress=progress)
        report = DemoReport(out_dir=out, device=device, model=model, load=result,
                            gpu_data_source="")
        stack.check()
        records_path = out / "requests.jsonl"
        with open(records_path, "w", encoding="utf-8") as fh:
            for record in result.records:
                fh.write(json.dumps(dataclasses.asdict(record)) + "\n")
        report.files["per-request records"] = records_path

        ours = {r.trace_id for r in result.records}
        finished = [r.trace_id for r in result.records if r.status == "ok"]
        have = _wait_for_traces(p.collector_url, finished, config.telemetry_settle_s)
        say(f"collector holds the traces of {have}/{len(finished)} requests")
        explain_dir = out / "explain"
        explain_dir.mkdir(exist_ok=True)
        local = _explained(p.collector_url, lambda t: t in ours, config.slowest)
        report.explanations.append({"source": "this run", **local})
        (explain_dir / "this-run.json").write_text(json.dumps(local, indent=2))
        (explain_dir / "this-run.txt").write_text(_format_explanation(local) + "\n")
        report.files["slowest requests of this run explained"] = explain_dir / "this-run.txt"

        replayed = None  # (capture, label, time map) once its metrics are in
        if device == "cuda":
            report.gpu_data_source = "live: this machine's GPU, traced by the engine"
        else:
            capture = config.capture or find_capture()
            incident = Incident.from_meta(read_capture_meta(capture)) if capture else None
            label = ("synthetic capture (made from a recorded H200 capture, not measured)"
                     if incident is not None and incident.synthetic else "recorded H200 capture")
            if capture is None:
                report.gpu_data_source = ("none: no GPU here and no recorded capture in "
                                          f"{CAPTURES_DIR}")
            else:
                say(f"no GPU here: replaying the {label} {capture.name} into the collector "
                    "for the per-SM views")
                # Metrics first: the heatmaps then cover the capture's whole span before
                # the (slower) spans arrive on the same clock.
                summary, time_map = _replay_capture(capture, f"http://{p.host}:{p.collector_http}",
                                                    config.replay_speed, ("metrics",))
                say(f"  replayed per-SM metrics: {summary}")
                report.gpu_data_source = f"{label} {capture}"
                report.incident = incident
                replayed = (capture, label, time_map)

        heatmaps, hotspots, time_sm = _fetch_heatmaps(p.collector_url, out / "heatmaps")
        report.story_kernel = story_kernel(time_sm)
        if replayed is not None:
            capture, label, time_map = replayed
            if report.incident is not None:
                report.findings = find(report.incident, time_sm, time_map)
            summary, _ = _replay_capture(capture, f"http://{p.host}:{p.collector_http}",
                                         config.replay_speed, ("traces",), time_map)
            say(f"  replayed spans: {summary}")
            gpu = _explained(p.collector_url, lambda t: t not in ours, config.incident_slowest)
            report.explanations.append({"source": f"{label} {capture.name}", **gpu})
            (explain_dir / "capture.json").write_text(json.dumps(gpu, indent=2))
            (explain_dir / "capture.txt").write_text(_format_explanation(gpu) + "\n")
            report.files["slowest replayed requests explained"] = explain_dir / "capture.txt"
        report.hotspots.extend(hotspots)
        if heatmaps:
            report.files["per-SM heatmaps (PNG + HTML)"] = out / "heatmaps"
            try:
                shot = screenshot_heatmap(out / "heatmaps", report.story_kernel)
                report.files["heatmap page in headless Chromium"] = shot
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                report.notes.append(f"no screenshot of the heatmap page: {exc}")
        else:
            report.notes.append("no per-SM data reached the collector, so no heatmaps")
        if report.incident is not None:
            say(f"waiting up to {config.alert_timeout_s:.0f}s for {SM_CONTENTION_ALERT} in Alertmanager")
            report.alerts = wait_for_alert(p.alertmanager_url, SM_CONTENTION_ALERT, config.alert_timeout_s)
            (out / "incident.json").write_text(json.dumps(incident_record(report), indent=2) + "\n")
            report.files["planted vs found (JSON)"] = out / "incident.json"
        dashboards = _build_dashboards(out / "dashboards")
        report.files["Grafana dashboards (JSON)"] = out / "dashboards"

        seen = _wait_prometheus(p.prometheus_url, "sum(sightline_engine_requests_total)",
                                config.requests, timeout_s=15)
        report.notes.append(f"Prometheus scraped the engine: {seen or 0:.0f} requests counted "
                            f"(sent {config.requests})")
        firing = _firing_alerts(p.alertmanager_url)
        report.notes.append("Alertmanager: " + (f"firing {', '.join(firing)}" if firing
                                                 else "no alerts firing"))
        report.notes.append(f"{len(dashboards)} dashboards, {len(heatmaps)} heatmap files")
    finally:
        say("stopping the stack")
        stack.stop()
    report.files["logs"] = stack.log_dir
    _write_summary(report, out)
    report.files["summary"] = out / "summary.txt"
    report.files["summary (JSON)"] = out / "summary.json"
    return report


def _summary_text(report: DemoReport) -> str:
    lines = [f"Sightline demo: engine {report.model} on {report.device}", "",
             "Client-side latency per priority (lower priority number = more urgent):",
             format_summary(report.load.summary), ""]
    for explanation in report.explanations:
        source = explanation["source"]
        body = {k: v for k, v in explanation.items() if k != "source"}
        lines.append(f"Slowest requests explained ({source}):")
        lines.append(_format_explanation(body))
        lines.append("")
    if report.hotspots:
        lines.append("Per-SM CTA latency hotspots (P99 per SM over the collector's window):")
        lines.extend(f"  {line}" for line in report.hotspots)
        lines.append("")
    if report.incident is not None:
        lines.extend(format_incident(report))
        lines.append("")
    lines.append(f"Per-SM data (kernels, SMs, heatmaps) comes from: {report.gpu_data_source}")
    if report.device != "cuda":
        recorded = not report.gpu_data_source.startswith(("none", "live"))  # a replayed capture
        label = report.gpu_data_source.rsplit(" ", 1)[0]
        lines.append("  This machine has no GPU: the engine ran on the CPU, so this run's requests "
                     "are explained down to engine steps only (no CUDA kernels, no SMs)."
                     + (f" Every kernel and per-SM figure above, and the heatmaps, come from the "
                        f"{label} replayed into the collector, not from this run."
                        if recorded else ""))
    lines.extend(f"- {note}" for note in report.notes)
    return "\n".join(lines)


def _write_summary(report: DemoReport, out: Path) -> None:
    (out / "summary.txt").write_text(_summary_text(report) + "\n")
    payload = {
        "device": report.device,
        "model": report.model,
        "gpu_data_source": report.gpu_data_source,
        "load": dataclasses.asdict(report.load.summary),
        "explanations": report.explanations,
        "files": {k: str(v) for k, v in report.files.items()},
        "notes": report.notes,
        "incident": incident_record(report) if report.incident is not None else None,
    }
    (out / "summary.json").write_text(json.dumps(payload, indent=2) + "\n")


def run_demo(config: DemoConfig, *, stream: IO[str] = sys.stdout) -> int:
    """``sightline demo``: runs, prints the summary and where everything is; exit code."""
    report = demo(config, stream=stream)
    stream.write("\n" + _summary_text(report) + "\n\nWritten:\n")
    width = max(len(k) for k in report.files)
    for what, path in report.files.items():
        stream.write(f"  {what:<{width}}  {path}\n")
    stream.flush()
    return 0 if report.load.summary.errors == 0 else 1
