"""The causes today's rules name for a live scenario run's recorded evidence.

A scenario run (bench/scenarios.py) keeps, for each planted interval's 10 slowest requests,
the cause the live collector named and its evidence. This feeds that evidence back through
:func:`sightline.collector.causes.classify` and counts, per scenario and run, the planted
cause then and now. Guarantee: the rules are today's, the figures the live collector's. The
evidence is what a cause keeps, so it is partial: the queue a request found is kept only
where `queueing` was named (elsewhere the wait counts as behind others), the flagged SMs
as how many of each kernel with their strongest score and reasons (runs before that: the
interval's flagged SMs), and the usual only as the figures the rules read (batch and KV).
Where the rules need what was not kept, the count says so. Cost: a few ms.

    python -m bench.reclassify bench/results/scenarios-*.json [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from sightline.collector.causes import CauseEvidence, classify
from sightline.deploy.incident import EXPECTED_CAUSE

from ._common import git_commit, utc_now

_FIELDS = {f.name for f in fields(CauseEvidence)}
_QUEUE = ("depth", "ahead_more_urgent", "overtaken_by", "engine_full")


def evidence_of(request: dict, findings: list[dict] | None = None) -> CauseEvidence:
    """A :class:`CauseEvidence` from one recorded request (``e2e_s``, ``priority``, ``cause``);
    ``findings``: its interval's flagged SMs, read where the request kept no count of its own."""
    ev = request["cause"]["evidence"]
    kept = {k: v for k, v in ev.items()
            if k in _FIELDS and k not in ("e2e_s", "priority", "queue", "usual", "contended_sms", "compiles")}
    return CauseEvidence(**{"queue_s": 0.0, "decode_s": 0.0, **kept}, e2e_s=request["e2e_s"],
                         priority=str(request.get("priority")),
                         queue={k: ev[k] for k in _QUEUE if k in ev} or None,
                         compiles=ev.get("compile_steps") or [],
                         contended_sms=_flags(ev, findings or []),
                         usual={"batch": ev.get("usual_batch") or 0.0, "kv_blocks": ev.get("usual_kv_blocks") or 0.0})


def _flags(ev: dict, findings: list[dict]) -> list[dict]:
    """The SM flags the rules read, rebuilt from what was kept: per kernel, as many SMs as
    were flagged, the first with the kernel's strongest score, all with its reasons."""
    if ev.get("contended_sms"):
        return ev["contended_sms"]
    per_kernel = ev.get("flagged_sms_by_kernel")
    if per_kernel is None and (ev.get("flagged_sms") or ev.get("contended_sms_flags")):
        per_kernel = [{"gpu": f["gpu"], "kernel": f["kernel"], "sms": len(f["flagged"]),
                       "max_score": max(f["flagged"].values()),
                       "reasons": sorted({r for rs in f["reasons"].values() for r in ([rs] if isinstance(rs, str) else rs)})}
                      for f in findings if f.get("flagged")]
    if per_kernel is None:
        strongest = ev.get("strongest_sm")
        return [strongest] if strongest else []
    return [{"gpu": k["gpu"], "kernel": k["kernel"], "sm": str(sm), "score": k["max_score"] if sm == 0 else 0.0,
             "reasons": k["reasons"]} for k in per_kernel for sm in range(k["sms"])]


def reclassify(run: dict) -> list[dict]:
    """Per planted interval of ``run``: the causes named live and now for its slowest requests."""
    out = []
    for seg in run.get("segments", []):
        kind = (seg.get("interval") or {}).get("kind") or seg["scenario"]
        expected = EXPECTED_CAUSE.get(kind)
        live = [r["cause"]["name"] for r in seg.get("slowest", [])]
        now = [classify(evidence_of(r, seg.get("findings"))).name for r in seg.get("slowest", [])]
        out.append({"scenario": seg["scenario"], "run": seg["run"], "expected_cause": expected,
                    "live": live, "now": now,
                    "planted_live": live.count(expected) if expected else None,
                    "planted_now": now.count(expected) if expected else None})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench/scenarios.py result files")
    ap.add_argument("--json", type=Path, help="write the counts here")
    args = ap.parse_args(argv)
    results = []
    for path in args.runs:
        rows = reclassify(json.loads(path.read_text()))
        results.append({"run_file": path.name, "intervals": rows})
        print(path.name)
        for r in rows:
            if r["expected_cause"]:
                print(f"  {r['scenario']} run {r['run']}: {r['expected_cause']} {r['planted_live']}/{len(r['live'])} "
                      f"live, {r['planted_now']}/{len(r['now'])} now")
    if args.json:
        args.json.write_text(json.dumps({"commit": git_commit(), "time_utc": utc_now(),
                                         "command": "python -m bench.reclassify " + " ".join(sys.argv[1:]),
                                         "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
