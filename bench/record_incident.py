"""Records an H200 incident capture: minutes of HTTP-served load with a noisy neighbour
planted on known SMs in known intervals, then checks that Sightline finds it.

The engine's server runs in this process (bench/record_capture.py's ``start_server``, trace
level ``kernels``) and writes an OTLP capture during ``--duration-s`` of timed load; in each
``--interval`` a thread runs bench/noisy_neighbour.py. Guarantee: the planted SMs are those
its CTAs ran on (``%smid``) and the interval their ``%globaltimer`` span (else the host's
clock), written in the capture's metadata line; the capture is then replayed into an
in-process aggregator and the demo's finding scored (precision, recall of flagged SMs).
Cost: the load's duration plus engine start-up and the replay. Writes the capture (the name
the demo looks for) and ``record_incident-<device>-<commit8>.json`` into ``--out``.

    python -m bench.record_incident --out "$OUT"                     # H200, llama-8b
    TRITON_INTERPRET=1 python -m bench.record_incident --device cpu --model tiny \\
        --duration-s 20 --interval 6,12 --out /tmp/ri               # CPU check (fake neighbour)
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path

from ._common import device_name, git_commit, utc_now
from .noisy_neighbour import NeighbourRun, NoisyNeighbour
from .record_capture import PlannedRequest, _prompt_text, start_server, stream_one

from sightline.deploy.incident import interval_s, Incident, PlantedInterval, find
from sightline.deploy.load import format_summary, summarize
from sightline.instrumentation.capture import CaptureWriter

CAPTURE_NAME = "h200-noisy-neighbour.jsonl.gz"  # deploy/demo.py's INCIDENT_CAPTURE
HOT_THRESHOLD = 1.5  # deploy/demo.py's DemoConfig.hot_sm_threshold


def plan_load(args: argparse.Namespace, model: str, max_model_len: int) -> list[tuple[float, PlannedRequest]]:
    """(send offset in seconds, request) for the whole run, in time order; prompts are cut
    to fit ``max_model_len`` tokens (one per character under the byte tokenizer)."""
    # Poisson arrivals at --rate per second, a burst of --burst requests every --burst-every-s;
    # prompts short (64-512 characters) or, one in four, long (2,000-6,000); 16-64 output
    # tokens; priorities 0-2; one in six a chat request.
    rng = random.Random(args.seed)
    offsets = []
    t = 0.0
    while True:
        t += rng.expovariate(args.rate)
        if t >= args.duration_s - 5:
            break
        offsets.append(t)
    burst_at = args.burst_every_s / 2
    while burst_at < args.duration_s - 5:
        offsets += [burst_at] * args.burst
        burst_at += args.burst_every_s
    plans = []
    for index, at in enumerate(sorted(offsets)):
        chat = index % 6 == 5
        length = rng.randint(2000, 6000) if rng.random() < 0.25 else rng.randint(64, 512)
        text = _prompt_text(rng, min(length, max_model_len - 256))
        priority = rng.randint(0, 2)
        body = {"model": model, "max_tokens": rng.randint(16, 64), "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, "priority": priority,
                **({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})}
        route = "/v1/chat/completions" if chat else "/v1/completions"
        plans.append((at, PlannedRequest(index, route, body, priority)))
    return plans


async def drive_timed(base_url: str, plans: list[tuple[float, PlannedRequest]], t0: float):
    import aiohttp

    async def at(offset: float, plan: PlannedRequest):
        await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
        return await stream_one(session, base_url, plan)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        return await asyncio.gather(*(at(offset, plan) for offset, plan in plans))


def run_neighbours(neighbour: NoisyNeighbour, intervals: list[tuple[float, float]], t0: float,
                   runs: list[NeighbourRun | BaseException]) -> threading.Thread:
    """A thread that runs the neighbour in each interval (offsets from ``t0``, monotonic)."""

    def target() -> None:
        for start, end in intervals:
            time.sleep(max(0.0, t0 + start - time.monotonic()))
            try:
                runs.append(neighbour.run(end - max(start, time.monotonic() - t0)))
            except BaseException as exc:  # reported in the summary, the load goes on
                runs.append(exc)

    thread = threading.Thread(target=target, name="neighbour-schedule", daemon=True)
    thread.start()
    return thread


def planted_interval(run: NeighbourRun) -> tuple[PlantedInterval, str]:
    """The interval a run occupied, and which clock gave it: the CTAs' own ``%globaltimer``
    when it agrees with the host's clock within 1 s, else the host's launch and finish."""
    device_clock = (not run.fake and run.host_launch_ns - 1e9 <= run.start_ns < run.end_ns
                    <= run.host_done_ns + 1e9)
    start, end = (run.start_ns, run.end_ns) if device_clock else (run.host_launch_ns, run.host_done_ns)
    return PlantedInterval(start, end, run.sms), "%globaltimer" if device_clock else "host clock"


def write_capture(raw: Path, target: Path, incident: Incident) -> None:
    """``target``: the metadata line, then every line of ``raw`` (gzip)."""
    target.unlink(missing_ok=True)
    with CaptureWriter(target) as writer:
        writer.write_meta(incident.to_meta())
    with gzip.open(raw, "rt", encoding="utf-8") as src, gzip.open(target, "at", encoding="utf-8") as dst:
        shutil.copyfileobj(src, dst)


def evaluate(capture: Path, incident: Incident) -> dict:
    """The demo's finding, computed in-process: replay, heatmaps, planted vs flagged SMs."""
    from sightline.collector.aggregator import Aggregator
    from sightline.collector.explain import explain_slowest
    from sightline.collector.heatmap import time_sm
    from sightline.collector.replay import AggregatorSink, ReplayConfig, replay

    aggregator = Aggregator()
    result = replay(capture, AggregatorSink(aggregator), ReplayConfig(speed=0.0))
    heatmaps = [time_sm(aggregator, e["gpu"], e["kernel"]).to_dict() for e in aggregator.kernels()
                if e["source"] == "sm_probe"]
    findings = find(incident, heatmaps, result.time_map, HOT_THRESHOLD)
    slowest = explain_slowest(aggregator, 0.99, 3).to_dict()
    return {"findings": [f.to_dict() for f in findings],
            "hotspot_ratio": {h["kernel"]: h["hotspot"]["ratio"] for h in heatmaps},
            "columns_with_data": {h["kernel"]: sum(any(row[c] is not None for row in h["p99_s"])
                                                   for c in range(len(h["times_unix_s"]))) for h in heatmaps},
            "slowest": [{"trace_id": r["trace_id"], "e2e_s": r["e2e_s"], "slowest_sm": r.get("slowest_sm")}
                        for r in slowest.get("requests", [])],
            "exports": result.exports, "spans": result.spans, "data_points": result.data_points}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--device", default="cuda", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--duration-s", type=float, default=170.0, help="load duration (at most the "
                    "collector's 180 s window, so that a replay shows all of it)")
    ap.add_argument("--interval", type=interval_s, action="append", default=None,
                    help="START,END of a neighbour interval, seconds from the load's start "
                         "(repeatable; default 60,95 and 125,155)")
    ap.add_argument("--neighbour-ctas", type=int, default=33, help="neighbour CTAs (~SMs taken)")
    ap.add_argument("--rate", type=float, default=1.5, help="Poisson arrivals per second")
    ap.add_argument("--burst", type=int, default=12, help="requests per burst")
    ap.add_argument("--burst-every-s", type=float, default=40.0)
    ap.add_argument("--kernel-sample-ratio", type=float, default=0.02)
    ap.add_argument("--metric-export-interval", type=float, default=2.0, help="seconds between per-SM exports")
    ap.add_argument("--fa2-config", default="64,64,4,3", help="SIGHTLINE_FA2_PREFILL_CONFIG for the engine")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/record_incident")))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    args.interval = args.interval or [(60.0, 95.0), (125.0, 155.0)]
    if not 10 <= args.duration_s <= 3600 or any(b > args.duration_s for _, b in args.interval):
        ap.error(f"--duration-s {args.duration_s} must be in [10, 3600] and hold every interval")
    if not (0 < args.rate <= 100 and 0 <= args.burst <= 1000 and args.burst_every_s > 0):
        ap.error("need 0 < --rate <= 100, 0 <= --burst <= 1000, --burst-every-s > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # FA2 with 4 warps (--fa2-config), so that its CTAs fit beside a neighbour CTA on one SM.
    os.environ["SIGHTLINE_FA2_PREFILL_CONFIG"] = args.fa2_config
    wall0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    raw, capture = args.out / "raw-capture.jsonl.gz", args.out / CAPTURE_NAME
    raw.unlink(missing_ok=True)
    # CUPTI kernel spans for --kernel-sample-ratio of the steps plus the slow tail, per-SM CTA
    # histograms every --metric-export-interval seconds.
    running, telemetry = start_server(args, raw)
    device_obj = running.engine.runner.device
    device = device_name(device_obj, cpu_fallback="cpu")
    neighbour = NoisyNeighbour(args.neighbour_ctas, device_obj)
    neighbour.run(0.0)  # compiles it before the load starts
    plans = plan_load(args, running.engine.model_name, running.engine.max_model_len)
    print(f"[{time.time() - wall0:.0f}s] serving {args.model} on {device}: {len(plans)} requests over "
          f"{args.duration_s:.0f} s, neighbour ({args.neighbour_ctas} CTAs) in {args.interval}", flush=True)
    runs: list[NeighbourRun | BaseException] = []
    t0 = time.monotonic()
    schedule = run_neighbours(neighbour, args.interval, t0, runs)
    try:
        records = asyncio.run(drive_timed(running.url, plans, t0))
        load_s = time.monotonic() - t0
        schedule.join(timeout=max(0.0, t0 + args.interval[-1][1] + 60 - time.monotonic()))
    finally:
        running.stop(timeout_s=300.0)
    planted = [planted_interval(r) for r in runs if isinstance(r, NeighbourRun)]
    failures = [repr(r) for r in runs if not isinstance(r, NeighbourRun)]
    client = summarize(records, load_s)
    print(format_summary(client), flush=True)
    if not planted:
        print(f"no neighbour interval completed: {failures}", flush=True)
        return 1
    incident = Incident(
        synthetic=False,
        description=(f"recorded: {args.model} served over HTTP for {args.duration_s:.0f} s with a noisy "
                     f"neighbour ({args.neighbour_ctas} persistent CTAs of bench/noisy_neighbour.py on "
                     "its own stream of the engine's process) in each interval"),
        tool="bench/record_incident.py", device=device, num_sms=_num_sms(device_obj),
        intervals=tuple(p for p, _ in planted),
        details={"clock": [c for _, c in planted], "neighbour_ctas": args.neighbour_ctas,
                 "neighbour_fake": any(r.fake for r in runs if isinstance(r, NeighbourRun)),
                 "cta_sms": [list(r.cta_sms) for r in runs if isinstance(r, NeighbourRun)],
                 "intervals_requested_s": args.interval, "fa2_config": args.fa2_config,
                 "failures": failures})
    write_capture(raw, capture, incident)
    raw.unlink(missing_ok=True)
    print(f"[{time.time() - wall0:.0f}s] wrote {capture} ({capture.stat().st_size / 1e6:.2f} MB); "
          "checking what Sightline finds in it", flush=True)
    found = evaluate(capture, incident)
    commit = git_commit()
    record = {"commit": commit, "device": device, "time_utc": utc_now(),
              "command": "python bench/record_incident.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "wall_s": time.time() - wall0, "capture": str(capture), "capture_bytes": capture.stat().st_size,
              "requests": len(records), "requests_ok": client.ok,
              "errors": [r.error for r in records if r.error][:5], "dropped_spans": telemetry.dropped_spans(),
              "incident": incident.to_meta(), **found}
    path = args.out / f"record_incident-{device.replace(' ', '-').lower()}-{commit[:8]}.json"
    path.write_text(json.dumps(record, indent=1))
    for f in found["findings"]:
        print(f"  {f['kernel']}: planted {len(f['planted'])} SMs, flagged {len(f['flagged'])}, "
              f"precision {f['precision']}, recall {f['recall']} ({f['slots']} slots)")
    print(f"hotspot ratio {found['hotspot_ratio']}, heatmap columns with data {found['columns_with_data']}")
    print(f"[{time.time() - wall0:.0f}s] wrote {path}", flush=True)
    return 0 if client.ok == len(records) and not failures else 1


def _num_sms(device) -> int:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the fake neighbour's SM ids are 0..7


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main())
