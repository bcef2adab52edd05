"""Records an H200 incident capture: minutes of HTTP-served load with a noisy neighbour
holding known SMs in known intervals, then checks that Sightline finds it.

The engine's server runs in this process (bench/record_capture.py's ``start_server``, trace
level ``kernels``) and writes an OTLP capture during ``--duration-s`` of timed load; in each
``--interval`` a thread runs bench/noisy_neighbour.py on ``--neighbour-sms``, in the variant
bench/neighbour_calibration.py found to slow FA2 CTAs most (CUDA only). Guarantee: the
planted SMs are those its CTAs held (``%smid``) for half the interval or more, the interval
their ``%globaltimer`` span (else the host's clock), all in the capture's metadata; the demo's
finding is scored and the capture diagnosed in-process (bench/incident_analysis.py). Cost:
the load, engine start-up, about 20 s of calibration, the replay. Writes the capture and
``record_incident-<device>-<commit8>.json`` into ``--out``.

    python -m bench.record_incident --out <dir>                     # H200, llama-8b
    TRITON_INTERPRET=1 python -m bench.record_incident --device cpu --model tiny --duration-s 20 --interval 6,12
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
from .incident_analysis import analyse
from .neighbour_calibration import calibrate, choose, parse_variants
from .noisy_neighbour import NeighbourConfig, NeighbourRun, NoisyNeighbour, parse_sms
from .record_capture import PlannedRequest, _prompt_text, client_session, start_server, stream_one

from sightline.deploy.incident import interval_s, Incident, PlantedInterval
from sightline.deploy.load import format_summary, summarize
from sightline.instrumentation.capture import CaptureWriter

CAPTURE_NAME = "h200-noisy-neighbour.jsonl.gz"  # deploy/demo.py's INCIDENT_CAPTURE


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
    async def at(offset: float, plan: PlannedRequest):
        await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
        return await stream_one(session, base_url, plan)

    async with client_session() as session:
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
    when it agrees with the host's clock within 1 s, else the host's launch and finish.
    Its SMs are those the run held for at least half of it (ValueError when none was)."""
    if not run.sms:
        raise ValueError(f"the neighbour held no SM for half the run (occupancy {run.occupancy})")
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--device", default="cuda", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--duration-s", type=float, default=170.0, help="load duration (at most the "
                    "collector's 180 s window, so that a replay shows all of it)")
    ap.add_argument("--interval", type=interval_s, action="append", default=None,
                    help="START,END of a neighbour interval, seconds from the load's start "
                         "(repeatable; default 50,95 and 120,160)")
    ap.add_argument("--neighbour-sms", default=None,
                    help="SMs the neighbour holds: START:STOP:STEP or a comma list (default every 4th SM)")
    ap.add_argument("--neighbour-warps", type=int, default=8, choices=(4, 8),
                    help="warps of each neighbour CTA, when not calibrated")
    ap.add_argument("--neighbour-carveout", default="max_shared", choices=("max_shared", "default"),
                    help="shared-memory preference of the neighbour kernel, when not calibrated")
    ap.add_argument("--slice-s", type=float, default=0.25, help="length of each neighbour launch")
    ap.add_argument("--calibrate", default="auto", choices=("auto", "on", "off"),
                    help="measure the neighbour variants on FA2 first (auto: on CUDA)")
    ap.add_argument("--calibration-variants", type=parse_variants,
                    default=parse_variants("8:max_shared,4:max_shared,8:default,4:default"),
                    help="WARPS:CARVEOUT,... tried by the calibration, in order of preference on a tie")
    ap.add_argument("--rate", type=float, default=1.5, help="Poisson arrivals per second")
    ap.add_argument("--burst", type=int, default=12, help="requests per burst")
    ap.add_argument("--burst-every-s", type=float, default=40.0)
    ap.add_argument("--kernel-sample-ratio", type=float, default=0.02)
    ap.add_argument("--metric-export-interval", type=float, default=2.0, help="seconds between per-SM exports")
    ap.add_argument("--fa2-config", default="64,64,4,3", help="SIGHTLINE_FA2_PREFILL_CONFIG for the engine")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("RESULTS_DIR", "/tmp/record_incident")))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    # Long intervals: per-SM histograms leave the engine every 10 s and the collector keeps
    # 10 s slots, so an interval needs several whole slots inside it.
    args.interval = args.interval or [(50.0, 95.0), (120.0, 160.0)]
    if not 10 <= args.duration_s <= 3600 or any(b > args.duration_s for _, b in args.interval):
        ap.error(f"--duration-s {args.duration_s} must be in [10, 3600] and hold every interval")
    if not (0 < args.rate <= 100 and 0 <= args.burst <= 1000 and args.burst_every_s > 0):
        ap.error("need 0 < --rate <= 100, 0 <= --burst <= 1000, --burst-every-s > 0")
    if not 0.01 <= args.slice_s <= 10:
        ap.error(f"--slice-s {args.slice_s} must be in [0.01, 10]")
    return args


def choose_neighbour(args: argparse.Namespace, device, num_sms: int) -> tuple[NeighbourConfig, dict]:
    """The neighbour's config: the calibrated variant that slowed FA2 CTAs most on the SMs it
    held (CUDA, unless ``--calibrate off``), else the flags'; and how it was chosen."""
    import torch

    targets = parse_sms(args.neighbour_sms, num_sms) if args.neighbour_sms else tuple(range(0, num_sms, 4))
    base = {"target_sms": targets, "slice_s": args.slice_s,
            "max_duration_s": max(b - a for a, b in args.interval) + 1.0}
    warps, carveout, how, runs = args.neighbour_warps, args.neighbour_carveout, "flags", []
    if args.calibrate == "on" or (args.calibrate == "auto" and device.type == "cuda"):
        # tiny shapes off the GPU, where the interpreter runs FA2 (plumbing only, fake figures)
        small = {} if device.type == "cuda" else {
            "launches": 2, "neighbour_s": 0.3, "seq": 64, "batch": 2, "heads": 2, "kv_heads": 1,
            "head_dim": 16, "dtype": torch.float16}
        try:
            runs = calibrate(device, targets, args.calibration_variants, slice_s=args.slice_s, **small)
        except Exception as exc:  # the recording is worth more than the calibration: go on, say why
            how = f"flags: calibration failed: {exc!r}"
        else:
            best = choose(runs)
            if best is not None:
                warps, carveout = args.calibration_variants[best - 1]  # runs[0] is the baseline
                how = f"calibration: variant {warps}:{carveout}"
            else:
                how = "flags: no calibrated variant ran FA2 CTAs on the SMs it held"
    return NeighbourConfig(warps=warps, carveout=carveout, **base), {
        "chosen_by": how, "calibration": [r.to_dict() for r in runs]}


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
    try:
        device_obj = running.engine.runner.device
        device = device_name(device_obj, cpu_fallback="cpu")
        num_sms = _num_sms(device_obj)
        config, chosen = choose_neighbour(args, device_obj, num_sms)
        for run in chosen["calibration"]:
            print(f"  calibration warps {run['warps']} carveout {run['carveout']}: FA2 CTAs on held SMs "
                  f"{run['ctas_held']} (share {run['held_share']}, even {run['even_share']:.3f}), "
                  f"P99 ratio {run['p99_ratio']}, median ratio {run['median_ratio']}", flush=True)
        neighbour = NoisyNeighbour(config, device_obj)
        neighbour.run(0.0)  # compiles it before the load starts
        plans = plan_load(args, running.engine.model_name, running.engine.max_model_len)
        print(f"[{time.time() - wall0:.0f}s] serving {args.model} on {device}: {len(plans)} requests over "
              f"{args.duration_s:.0f} s, neighbour on {len(config.target_sms)} SMs ({config.warps} warps, "
              f"carveout {neighbour.carveout}; {chosen['chosen_by']}) in {args.interval}", flush=True)
        runs: list[NeighbourRun | BaseException] = []
        t0 = time.monotonic()
        schedule = run_neighbours(neighbour, args.interval, t0, runs)
        records = asyncio.run(drive_timed(running.url, plans, t0))
        load_s = time.monotonic() - t0
        schedule.join(timeout=max(0.0, t0 + args.interval[-1][1] + 60 - time.monotonic()))
    finally:
        running.stop(timeout_s=300.0)
    planted, failures = [], [repr(r) for r in runs if not isinstance(r, NeighbourRun)]
    for run in (r for r in runs if isinstance(r, NeighbourRun)):
        try:
            planted.append((planted_interval(run), run))
        except ValueError as exc:
            failures.append(str(exc))
    client = summarize(records, load_s)
    print(format_summary(client), flush=True)
    if not planted:
        print(f"no neighbour interval completed: {failures}", flush=True)
        return 1
    incident = Incident(
        synthetic=False,
        description=(f"recorded: {args.model} served over HTTP for {args.duration_s:.0f} s with a noisy "
                     f"neighbour (bench/noisy_neighbour.py holding {len(config.target_sms)} SMs with "
                     f"{config.warps}-warp tensor-core CTAs, on its own stream of the engine's process) "
                     "in each interval"),
        tool="bench/record_incident.py", device=device, num_sms=num_sms,
        intervals=tuple(p for (p, _), _ in planted),
        details={"clock": [c for (_, c), _ in planted], "neighbour_fake": any(r.fake for _, r in planted),
                 "target_sms": list(config.target_sms),
                 "occupancy": [{str(sm): share for sm, share in r.occupancy.items()} for _, r in planted],
                 "neighbour": {"warps": config.warps, "carveout": neighbour.carveout, "slice_s": config.slice_s,
                               "chosen_by": chosen["chosen_by"]},
                 "intervals_requested_s": args.interval, "fa2_config": args.fa2_config,
                 "failures": failures})
    write_capture(raw, capture, incident)
    raw.unlink(missing_ok=True)
    print(f"[{time.time() - wall0:.0f}s] wrote {capture} ({capture.stat().st_size / 1e6:.2f} MB); "
          "checking what Sightline finds in it", flush=True)
    try:
        report = analyse(capture)
        found = report.pop("finding")
    except Exception as exc:  # keep the record (and the capture) whatever the analysis does
        report, found = {"error": repr(exc)}, {"findings": [], "hotspot_ratio": {}, "columns_with_data": {}}
    commit = git_commit()
    record = {"commit": commit, "device": device, "time_utc": utc_now(),
              "command": "python bench/record_incident.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "wall_s": time.time() - wall0, "capture": str(capture), "capture_bytes": capture.stat().st_size,
              "requests": len(records), "requests_ok": client.ok,
              "errors": [r.error for r in records if r.error][:5], "dropped_spans": telemetry.dropped_spans(),
              "incident": incident.to_meta(), "calibration": chosen["calibration"], **found,
              "diagnostics": report}
    path = args.out / f"record_incident-{device.replace(' ', '-').lower()}-{commit[:8]}.json"
    path.write_text(json.dumps(record, indent=1))
    for f in found["findings"]:
        print(f"  {f['kernel']}: planted {len(f['planted'])} SMs, flagged contended {len(f['flagged'])} "
              f"(precision {f['precision']}, recall {f['recall']}) in {f['slots']} slots")
    for n, interval in enumerate(report.get("intervals", []), start=1):
        for cls, body in interval["by_export_window"].items():
            for kernel, k in body["kernels"].items():
                print(f"  interval {n} {cls} exports, {kernel}: planted-SM CTA share {k['planted_cta_share']} "
                      f"(even {k['even_share']:.3f}), P99 ratio {k['p99_ratio']}")
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
