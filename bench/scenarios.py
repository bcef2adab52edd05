"""Records issue 30's scenario suite on one GPU and scores what a live collector found.

One ``engine serve`` (the split server: an engine core and an API server, trace level
``kernels``, the plants inside the core's process: bench/core_plants.py) serves a Poisson load
of priorities 1-2 for the whole run; its telemetry goes over OTLP/HTTP to a collector process
and into a raw capture. The suite is ``--runs`` rounds of ``--scenarios``, each a segment:
``--lead-s`` with nothing planted, ``--planted-s`` with the plant (an SM neighbour on every
4th or 2nd SM, an HBM hog, a GIL-holding thread, a burst of priority-0 requests, a surge of
the usual load, or nothing: the control), then ``--tail-s``. A scraper reads the collector's
/metrics every ``--scrape-s`` (alerts: bench/scenario_analysis.py); after each segment the
collector's time x SM heatmaps and its causes for the planted interval's 10 slowest requests
are fetched and scored (where no slowness was planted, also up to 20 of its requests named
one anyway, with their evidence). Guarantee: what was planted is measured (the neighbour's SMs by
``%smid``, the hogs' own clocks) and kept in each capture's metadata; every figure comes from
the live collector. Cost: the segments (60 s each by default) and about a minute of start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from sightline.collector.aggregation_config import WindowConfig
from sightline.collector.replay import TimeMap
from sightline.deploy.incident import EXPECTED_CAUSE, Incident, PlantedInterval, find
from sightline.deploy.load import format_summary as format_load, summarize as summarize_load
from sightline.instrumentation import semconv as sc
from sightline.instrumentation.capture import CaptureWriter

from ._collector import CollectorProcess
from ._common import git_commit, terminate, utc_now, wait_http
from .core_plants import PLAN_ENV, apply_record
from .plants import GilHog, HbmHog, PlantRun
from .record_capture import PlannedRequest, _prompt_text
from .record_incident import drive_timed, planted_interval
from .scenario_analysis import AlertClock, AlertRules, format_summary, score_interval, summarize

__all__ = ["SCENARIOS", "Segment", "main", "plan_load", "segments"]

# scenario -> the kind of interval it plants (deploy/incident.py)
SCENARIOS = {"control": "control", "sm_quarter": "sm_neighbour", "sm_half": "sm_neighbour", "hbm_hog": "hbm_hog",
             "host_stall": "host_stall", "priority_burst": "priority_burst", "load_surge": "load_surge"}
# a control first and incidents apart: most of what the collector compares with stays usual
DEFAULT_ORDER = ("control", "sm_quarter", "hbm_hog", "sm_half", "host_stall", "priority_burst", "load_surge")
SM_STEP = {"sm_quarter": 4, "sm_half": 2}  # the neighbour holds every Nth SM
SLOWNESS_CAUSES = (sc.CAUSE_SM_CONTENTION, sc.CAUSE_DEVICE_CONTENTION, sc.CAUSE_HOST_STALL)
MISNAMED_AMONG, MISNAMED_KEPT = 300, 20   # of an interval's slowest, those named a slowness kept
# a planted interval's slow requests end, and are explained, up to about 6 s after it (an
# H100's HBM hog: the last counted 5.6 s after): a cause alert's window begun then must be
# over by the next segment's onset
CAUSE_CLEAR_S = 10.0


@dataclass
class Segment:
    """One scenario of one round: its times (seconds from the load's start) and what came of it."""

    scenario: str
    run: int
    start_s: float
    onset_s: float
    end_s: float  # of the planted interval
    stop_s: float  # of the segment
    interval: PlantedInterval | None = None
    plant: dict = field(default_factory=dict)
    findings: list[dict] = field(default_factory=list)
    slowest: list[dict] = field(default_factory=list)
    misnamed: list[dict] = field(default_factory=list)  # where no slowness was planted, those named one
    error: str | None = None


def segments(order: list[str], runs: int, lead_s: float, planted_s: float, tail_s: float) -> list[Segment]:
    """The suite's timeline: ``runs`` rounds of ``order``, segment after segment."""
    length = lead_s + planted_s + tail_s
    out = []
    for run in range(runs):
        for i, name in enumerate(order):
            start = (run * len(order) + i) * length
            out.append(Segment(name, run + 1, start, start + lead_s, start + lead_s + planted_s, start + length))
    return out


def plan_load(args: argparse.Namespace, model: str, max_model_len: int,
              timeline: list[Segment]) -> list[tuple[float, PlannedRequest]]:
    """Poisson arrivals at ``--rate`` (priorities 1-2; one in four prompts long) over the whole
    timeline, at each priority burst's onset ``--burst`` long priority-0 requests at once, and
    through each load surge's planted interval ``--surge-rate`` more a second, with short
    prompts and long answers (128-256 tokens: they stay in the batch and grow it)."""
    rng = random.Random(args.seed)
    total = timeline[-1].stop_s
    offsets, t = [], 0.0
    while True:
        t += rng.expovariate(args.rate)
        if t >= total - 2:
            break
        offsets.append((t, rng.randint(1, 2), "usual"))
    for seg in timeline:
        if seg.scenario == "priority_burst":
            offsets += [(seg.onset_s, 0, "burst")] * args.burst
        elif seg.scenario == "load_surge":
            t = seg.onset_s
            while (t := t + rng.expovariate(args.surge_rate)) < seg.end_s:
                offsets.append((t, rng.randint(1, 2), "surge"))
    plans = []
    for index, (at, priority, kind) in enumerate(sorted(offsets)):
        long = kind == "burst" or (kind == "usual" and rng.random() < 0.25)
        length = rng.randint(2000, 6000) if long else rng.randint(64, 512)
        chat = index % 6 == 5
        text = _prompt_text(rng, min(length, max_model_len - 256))
        answer = rng.randint(128, 256) if kind == "surge" else rng.randint(16, 64)
        body = {"model": model, "max_tokens": answer, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, "priority": priority,
                **({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})}
        plans.append((at, PlannedRequest(index, "/v1/chat/completions" if chat else "/v1/completions", body,
                                         priority)))
    return plans


def _get(url: str, timeout_s: float = 60.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read()


class Scraper:
    """Scrapes the collector's /metrics every ``every_s`` into an AlertClock, on a thread."""

    def __init__(self, url: str, every_s: float, rules: AlertRules) -> None:
        self.url, self.every_s, self.clock = url, every_s, AlertClock(rules)
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scraper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                text = _get(self.url + "/metrics", 30).decode()
            except OSError:
                self.failures += 1
                continue
            self.clock.observe(time.time(), text)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def evaluate(collector: str, seg: Segment, num_sms: int, device: str) -> None:
    """The live collector's view of ``seg``'s planted interval: per attention kernel the SMs
    its contention tests flagged, and the cause of each of its 10 slowest requests."""
    interval = seg.interval
    incident = Incident(False, seg.scenario, "bench/scenarios.py", device, num_sms, (interval,))
    heatmaps = []
    for e in json.loads(_get(collector + "/api/v1/kernels"))["kernels"]:
        if e.get("source") != "sm_probe":
            continue
        query = urllib.parse.urlencode({"instance_id": e["instance"], "gpu": e["gpu"], "kernel": e["kernel"],
                                        "kind": "time_sm", "format": "json"})
        heatmaps.append(dict(json.loads(_get(f"{collector}/api/v1/heatmap?{query}")), gpu_index=e["gpu_index"]))
    seg.findings = [f.to_dict() for f in find(incident, heatmaps, TimeMap())]
    # where no slowness was planted, the requests named one anyway (beyond the 10 slowest
    # too: what an alert on the causes counts) are kept too, for what misled the rules
    unplanted = EXPECTED_CAUSE[interval.kind] in (None, sc.CAUSE_QUEUEING)
    query = urllib.parse.urlencode({"quantile": 0, "limit": MISNAMED_AMONG if unplanted else 10,
                                    "start_unix_s": interval.start_unix_nano / 1e9,
                                    "end_unix_s": interval.end_unix_nano / 1e9})
    requests = json.loads(_get(f"{collector}/api/v1/explain?{query}"))["requests"]   # slowest first
    seg.slowest = [_kept(r) for r in requests[:10]]
    if unplanted:
        seg.misnamed = [_kept(r) for r in requests
                        if (r.get("cause") or {}).get("name") in SLOWNESS_CAUSES][:MISNAMED_KEPT]


def _kept(r: dict) -> dict:
    """An explained request as the run keeps it: its cause with the evidence cut (below)."""
    cause = r.get("cause") or {}
    return {"trace_id": r["trace_id"], "e2e_s": r["e2e_s"], "priority": r["priority"],
            "cause": {**{k: cause.get(k) for k in ("name", "summary", "compared_with")},
                      "evidence": _evidence_kept(cause.get("evidence") or {})}}


def _evidence_kept(evidence: dict) -> dict:
    """A cause's evidence with its per-slot SM flags cut to how many, how many distinct SMs
    of each kernel, and the strongest (the full list runs to hundreds of entries per request)."""
    flags = evidence.get("contended_sms")
    if not flags:
        return evidence
    top = max(flags, key=lambda f: f.get("score") or 0.0)
    per_kernel: dict[tuple, dict] = {}
    for f in flags:
        k = per_kernel.setdefault((f.get("gpu"), f.get("kernel")), {"sms": set(), "max_score": 0.0, "reasons": set()})
        k["sms"].add(f.get("sm"))
        k["max_score"] = max(k["max_score"], f.get("score") or 0.0)
        k["reasons"].update(f.get("reasons") or ())
    return {**{k: v for k, v in evidence.items() if k != "contended_sms"}, "contended_sms_flags": len(flags),
            "flagged_sms_by_kernel": [{"gpu": gpu, "kernel": kernel, "sms": len(k["sms"]),
                                       "max_score": k["max_score"], "reasons": sorted(k["reasons"])}
                                      for (gpu, kernel), k in sorted(per_kernel.items(), key=str)],
            "strongest_sm": top}


def make_plants(args: argparse.Namespace, device, num_sms: int, order: list[str]) -> dict:
    """Each scenario's plant, built (and its kernel compiled) before the load starts."""
    from .noisy_neighbour import NeighbourConfig, NoisyNeighbour

    plants = {}
    for name in dict.fromkeys(order):
        if name in SM_STEP:
            config = NeighbourConfig(tuple(range(0, num_sms, SM_STEP[name])), warps=8, carveout="max_shared",
                                     slice_s=0.25, max_duration_s=args.planted_s + 1.0)
            plants[name] = NoisyNeighbour(config, device)
            plants[name].run(0.0)
        elif name == "hbm_hog":
            plants[name] = HbmHog(device, mib=args.hbm_mib)
            plants[name].run(0.05)
        elif name == "host_stall":
            plants[name] = GilHog(hold_s=args.gil_hold_s, period_s=args.gil_period_s)
    return plants


def run_plants(plants: dict, timeline: list[Segment], t0: float, planted_s: float,
               on_done=None) -> threading.Thread:
    """A thread that plants each segment's incident at its onset and records what it did
    (``on_done(index, segment)`` after each)."""
    def target() -> None:
        for index, seg in enumerate(timeline):
            try:
                plant_one(plants, seg, t0, planted_s)
            finally:
                if on_done is not None:
                    on_done(index, seg)

    thread = threading.Thread(target=target, name="plants", daemon=True)
    thread.start()
    return thread


def plant_one(plants: dict, seg: Segment, t0: float, planted_s: float) -> None:
    """Plants ``seg``'s incident at its onset; sets its interval and plant, or its error."""
    time.sleep(max(0.0, t0 + seg.onset_s - time.monotonic()))
    plant = plants.get(seg.scenario)
    try:
        if plant is None:  # control, priority burst, load surge (in the load): the planned times
            start = time.time_ns()
            time.sleep(max(0.0, t0 + seg.end_s - time.monotonic()))
            seg.interval = PlantedInterval(start, time.time_ns(), (), kind=SCENARIOS[seg.scenario])
            return
        done = plant.run(planted_s)
        if isinstance(done, PlantRun):
            seg.interval = PlantedInterval(done.start_ns, done.end_ns, (), kind=SCENARIOS[seg.scenario])
            seg.plant = done.details
        else:  # a NeighbourRun: the SMs its CTAs held, and when (%globaltimer when it agrees)
            seg.interval, clock = planted_interval(done)
            seg.plant = {"clock": clock, "target_sms": len(done.target_sms), "held_sms": len(done.sms),
                         "warps": done.warps, "carveout": done.carveout}
    except Exception as exc:  # the load goes on; the segment says why it has no score
        seg.error = repr(exc)


def run_evaluations(collector: str, timeline: list[Segment], t0: float, settle_s: float, num_sms: int,
                    device: str) -> threading.Thread:
    """A thread that evaluates each segment ``settle_s`` after its planted interval ends."""
    def target() -> None:
        for seg in timeline:
            time.sleep(max(0.0, t0 + seg.end_s + settle_s - time.monotonic()))
            for _ in range(int(settle_s) + 30):  # the plant thread may still be writing the interval
                if seg.interval is not None or seg.error is not None:
                    break
                time.sleep(1.0)
            if seg.interval is None:
                continue
            try:
                evaluate(collector, seg, num_sms, device)
            except Exception as exc:
                seg.error = f"evaluation: {exc!r}"

    thread = threading.Thread(target=target, name="evaluations", daemon=True)
    thread.start()
    return thread


def keep_captures(raw: Path, out: Path, timeline: list[Segment], keep: set[str], device: str, num_sms: int,
                  wall0_ns: int) -> list[str]:
    """Each kept scenario's segment of the raw capture (its lines by write time, and 10 s
    more for the last exports), behind a metadata line saying what was planted and when."""
    chosen = [s for s in timeline if s.scenario in keep and s.interval is not None]
    targets = []
    for seg in chosen:
        target = out / f"scenario-{seg.scenario}-{seg.run}.jsonl.gz"
        target.unlink(missing_ok=True)
        with CaptureWriter(target) as writer:
            writer.write_meta(Incident(False, f"bench/scenarios.py: {seg.scenario}, run {seg.run}",
                                       "bench/scenarios.py", device, num_sms, (seg.interval,),
                                       {"plant": seg.plant}).to_meta())
        targets.append((wall0_ns + int(seg.start_s * 1e9), wall0_ns + int((seg.stop_s + 10) * 1e9),
                        gzip.open(target, "at", encoding="utf-8"), target))
    try:
        with gzip.open(raw, "rt", encoding="utf-8") as src:
            for line in src:
                t = int(json.loads(line).get("time_unix_nano", 0))
                for lo, hi, dst, _ in targets:
                    if lo <= t <= hi:
                        dst.write(line)
    finally:
        for _, _, dst, _ in targets:
            dst.close()
    return [str(target) for *_, target in targets]


@dataclass
class ServedEngine:
    """``engine serve`` (the split server: an engine core and an API server), its plants in
    the core (bench/core_plants.py), what they planted read back from ``plan``'s files."""

    process: subprocess.Popen
    url: str
    plan: Path
    model: str = ""
    max_model_len: int = 0
    device: str = ""
    num_sms: int = 0

    @classmethod
    def start(cls, args: argparse.Namespace, raw: Path, otlp_http: str) -> "ServedEngine":
        from sightline.deploy.processes import free_port

        # the plan and the core's replies are for the two processes alone: not in --out, whose
        # files are the run's results
        plan = Path(tempfile.mkdtemp(prefix="sightline-scenario-")) / "plan.json"
        plan.write_text(json.dumps({"order": args.order, "args": {
            k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))}}))
        port = free_port()
        command = [sys.executable, "-m", "sightline.deploy.cli", "engine", "serve", "--model", args.model,
                   "--device", args.device, "--host", "127.0.0.1", "--port", str(port), "--trace-level", "kernels",
                   "--telemetry-exporter", "otlp", "--otlp-protocol", "http/protobuf", "--otlp-endpoint", otlp_http,
                   "--telemetry-capture-path", str(raw), "--kernel-sample-ratio", str(args.kernel_sample_ratio),
                   "--kernel-sample-ratio-slow", str(args.kernel_sample_ratio_slow),
                   "--telemetry-metric-export-interval-s", str(args.metric_export_interval),
                   # a traced step ends hundreds of kernel spans at once: a queue that holds them
                   # all keeps the capture whole, a long shutdown lets the last reach the file
                   "--telemetry-max-queue-size", str(1 << 17), "--telemetry-shutdown-timeout-s", "120"]
        env = dict(os.environ, SIGHTLINE_CORE_PLUGINS="bench.core_plants:start", **{PLAN_ENV: str(plan)})
        engine = cls(subprocess.Popen(command, cwd=Path(__file__).resolve().parent.parent, env=env),
                     f"http://127.0.0.1:{port}", plan)
        try:
            engine._wait_ready(args.start_timeout)
        except BaseException:
            engine.stop(10.0)
            raise
        return engine

    def _wait_ready(self, timeout_s: float) -> None:
        """Until ``/health`` is 200: the core has run its plugins (they wrote the device file)."""
        wait_http(self.url + "/health", self.process, timeout_s)
        card = json.loads(_get(self.url + "/v1/models", 10.0))["data"][0]
        self.model, self.max_model_len = card["id"], int(card["max_model_len"])
        found = json.loads(Path(f"{self.plan}.device.json").read_text())
        self.device, self.num_sms = found["device"], int(found["num_sms"])

    def go(self, wall_ns: int) -> None:
        """The load's start (Unix ns): the core's plants time their segments from it."""
        staged = Path(f"{self.plan}.go.tmp")
        staged.write_text(str(wall_ns))
        staged.rename(f"{self.plan}.go")   # whole or absent: the core never reads half of it

    def follow(self, timeline: list[Segment]) -> threading.Thread:
        """A thread that fills each segment's interval, plant and error as the core writes them."""
        def target() -> None:
            path, seen, offset = Path(f"{self.plan}.segments.jsonl"), 0, 0
            while seen < len(timeline) and self.process.poll() is None:
                if path.exists():
                    with path.open() as lines:
                        lines.seek(offset)
                        while (line := lines.readline()).endswith("\n"):   # a line being written waits
                            apply_record(timeline, json.loads(line))
                            offset, seen = lines.tell(), seen + 1
                time.sleep(0.2)

        thread = threading.Thread(target=target, name="plants", daemon=True)
        thread.start()
        return thread

    def dropped_spans(self) -> float:
        """Spans the engine's telemetry dropped, from its /metrics (the counter's samples only)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = _get(self.url + "/metrics", 30.0).decode()
        return sum(sample.value for family in text_string_to_metric_families(text)
                   if family.name == sc.TELEMETRY_SPANS_DROPPED_TOTAL
                   for sample in family.samples if sample.name.endswith("_total"))

    def stop(self, timeout_s: float) -> None:
        terminate(self.process, timeout_s)
        shutil.rmtree(self.plan.parent, ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--device", default="cuda", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--scenarios", default=",".join(DEFAULT_ORDER),
                    help=f"comma list, in order, of {', '.join(SCENARIOS)}")
    ap.add_argument("--runs", type=int, default=1, help="rounds of the scenarios")
    ap.add_argument("--lead-s", type=float, default=20.0)
    ap.add_argument("--planted-s", type=float, default=30.0)
    ap.add_argument("--tail-s", type=float, default=10.0)
    ap.add_argument("--settle-s", type=float, default=20.0,
                    help="wait after a planted interval before scoring it (its requests end, their spans arrive)")
    ap.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    ap.add_argument("--burst", type=int, default=96, help="priority-0 requests of a priority burst")
    ap.add_argument("--surge-rate", type=float, default=30.0,
                    help="more Poisson arrivals per second (short prompts, long answers) through a load surge")
    ap.add_argument("--hbm-mib", type=int, default=1024, help="MiB the HBM hog reads and writes per launch")
    ap.add_argument("--gil-hold-s", type=float, default=0.03)
    ap.add_argument("--gil-period-s", type=float, default=0.05)
    ap.add_argument("--scrape-s", type=float, default=2.0)
    ap.add_argument("--alert-for-s", type=float, default=5.0, help="the alerts' wait (the demo's short for)")
    ap.add_argument("--cause-window-s", type=float, default=AlertRules.cause_window_s,
                    help="the cause alerts' window (default: within one segment)")
    ap.add_argument("--gauge-window-s", type=float, default=15.0,
                    help="the collector's gauge window: flags, read once their slot has closed, clear before "
                         "the next segment's onset")
    ap.add_argument("--kernel-sample-ratio", type=float, default=0.02)
    ap.add_argument("--kernel-sample-ratio-slow", type=float, default=0.1,
                    help="steps traced during a slow spell (0: none)")
    ap.add_argument("--metric-export-interval", type=float, default=2.0)
    ap.add_argument("--fa2-config", default="64,64,4,3", help="SIGHTLINE_FA2_PREFILL_CONFIG for the engine")
    ap.add_argument("--keep-captures", default="sm_quarter",
                    help="scenarios whose capture to keep in --out (comma list, 'all' or 'none')")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/scenarios")))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    args.order = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(args.order) - set(SCENARIOS))
    if unknown or not args.order:
        ap.error(f"--scenarios {args.scenarios!r}: unknown {unknown}; choose from {', '.join(SCENARIOS)}")
    if not 1 <= args.runs <= 20:
        ap.error(f"--runs {args.runs} must be in [1, 20]")
    if not (args.rate > 0 and args.surge_rate > 0):
        ap.error(f"--rate {args.rate} and --surge-rate {args.surge_rate} must be above 0 (arrivals a second)")
    if not (5 <= args.lead_s and 10 <= args.planted_s and 0 <= args.tail_s) or args.settle_s < 0:
        ap.error("need --lead-s >= 5, --planted-s >= 10, --tail-s >= 0, --settle-s >= 0")
    slot_s = WindowConfig().slot_s
    if args.gauge_window_s + slot_s >= args.lead_s + args.tail_s:
        ap.error(f"--gauge-window-s {args.gauge_window_s} must be {slot_s:g} s under --lead-s + --tail-s: flags "
                 "of one segment (read once their slot has closed) must clear before the next one's onset")
    if args.cause_window_s + CAUSE_CLEAR_S > args.lead_s + args.tail_s:
        ap.error(f"--cause-window-s {args.cause_window_s} must be at least {CAUSE_CLEAR_S:g} s under --lead-s + "
                 "--tail-s: a cause alert holds for its window after the last slow request ends, and it must "
                 "end before the next segment's onset")
    keep = args.keep_captures
    args.keep = set(SCENARIOS) if keep == "all" else set() if keep == "none" else set(keep.split(","))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["SIGHTLINE_FA2_PREFILL_CONFIG"] = args.fa2_config  # FA2 CTAs that fit beside a neighbour CTA
    wall0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    raw = args.out / "raw-capture.jsonl.gz"
    raw.unlink(missing_ok=True)
    timeline = segments(args.order, args.runs, args.lead_s, args.planted_s, args.tail_s)
    collector_proc = CollectorProcess(args.out / "collector.log", ["--gauge-window-s", f"{args.gauge_window_s:g}"])
    collector, otlp_http = collector_proc.url("query"), collector_proc.url("http")
    running, dropped = None, None
    try:
        running = ServedEngine.start(args, raw, otlp_http)
        device, num_sms = running.device, running.num_sms
        plans = plan_load(args, running.model, running.max_model_len, timeline)
        print(f"[{time.time() - wall0:.0f}s] {args.model} on {device}: {len(timeline)} segments of "
              f"{timeline[0].stop_s:.0f} s, {len(plans)} requests; collector {collector}", flush=True)
        scraper = Scraper(collector, args.scrape_s, AlertRules(args.alert_for_s, args.cause_window_s))
        scraper.start()
        t0, wall0_ns = time.monotonic(), time.time_ns()
        running.go(wall0_ns)
        planter = running.follow(timeline)
        evaluator = run_evaluations(collector, timeline, t0, args.settle_s, num_sms, device)
        records = asyncio.run(drive_timed(running.url, plans, t0))
        load_s = time.monotonic() - t0
        planter.join(timeout=max(0.0, t0 + timeline[-1].stop_s + 60 - time.monotonic()))
        evaluator.join(timeout=max(0.0, t0 + timeline[-1].end_s + args.settle_s + 120 - time.monotonic()))
        scraper.stop()
        dropped = running.dropped_spans()
    finally:
        if running is not None:
            running.stop(timeout_s=300.0)
        collector_proc.stop()
    episodes = scraper.clock.episodes()
    scored = []
    for seg in timeline:
        if seg.interval is None or seg.error:
            continue
        interval = {"kind": seg.interval.kind, "start_unix_s": seg.interval.start_unix_nano / 1e9,
                    "end_unix_s": seg.interval.end_unix_nano / 1e9, "sms": list(seg.interval.sms)}
        since = interval["start_unix_s"] - (seg.onset_s - seg.start_s)  # the segment's start
        scored.append(dict(score_interval(interval, seg.findings, seg.slowest, episodes, since_unix_s=since),
                           scenario=seg.scenario, run=seg.run))
    summary = summarize(scored)
    client = summarize_load(records, load_s)
    failed = [r for r in records if r.status != "ok"]
    commit = git_commit()
    record = {"commit": commit, "device": device, "time_utc": utc_now(), "wall_s": time.time() - wall0,
              "command": "python -m bench.scenarios " + " ".join(sys.argv[1:] if argv is None else argv),
              "config": {k: (sorted(v) if isinstance(v, set) else str(v) if isinstance(v, Path) else v)
                         for k, v in vars(args).items()},
              "requests": len(records), "requests_ok": client.ok, "dropped_spans": dropped,
              "failed_requests": [{"index": r.index, "priority": r.priority, "trace_id": r.trace_id,
                                   "e2e_s": r.e2e_s, "http_status": r.http_status, "error": r.error}
                                  for r in failed],
              "scrapes": len(scraper.clock.contended), "scrape_failures": scraper.failures,
              "cause_counts": scraper.clock.cause_counts(),
              "alert_episodes": episodes, "summary": summary, "scored": scored, "captures": [],
              "segments": [{"scenario": s.scenario, "run": s.run, "onset_s": s.onset_s, "plant": s.plant,
                            "interval": None if s.interval is None else {
                                "start_unix_nano": s.interval.start_unix_nano, "end_unix_nano": s.interval.end_unix_nano,
                                "kind": s.interval.kind, "sms": list(s.interval.sms)},
                            "findings": s.findings, "slowest": s.slowest, "misnamed": s.misnamed,
                            "error": s.error} for s in timeline]}
    path = args.out / f"scenarios-{device.replace(' ', '-').lower()}-{commit[:8]}.json"
    # the scores are written before the captures are cut, which is slow: a run stopped while
    # cutting them (a time limit) keeps its results
    path.write_text(json.dumps(record, indent=1))
    print(format_load(client))
    for r in failed:
        print(f"  request {r.index} (priority {r.priority}, trace {r.trace_id}) failed after {r.e2e_s:.1f} s: "
              f"{r.error}")
    for s in timeline:
        if s.error:
            print(f"  {s.scenario} run {s.run}: {s.error}")
    print(format_summary(summary))
    print(f"[{time.time() - wall0:.0f}s] wrote {path}", flush=True)
    if args.keep:
        record["captures"] = keep_captures(raw, args.out, timeline, args.keep, device, num_sms, wall0_ns)
        path.write_text(json.dumps(record, indent=1))
        print(f"[{time.time() - wall0:.0f}s] kept {len(record['captures'])} captures", flush=True)
    raw.unlink(missing_ok=True)
    return 0 if client.ok == len(records) and not any(s.error for s in timeline) else 1


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main())
