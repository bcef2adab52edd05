"""Scores a scenario-suite run (bench/scenarios.py): what was planted against what Sightline said.

Per planted interval: the SMs the live collector's contention tests flagged (sightline.deploy.incident,
per attention kernel: precision and recall against the planted SMs, or for kinds that plant
none, the SMs flagged at all); the cause explain named for the 10 slowest requests that lived
in it, and the share naming the planted one; onset to alert: :class:`AlertClock` evaluates the
project's alert rules on the collector's /metrics as scraped (the SM-contention rule as it is,
the cause rules over ``cause_window_s``), each firing once its condition held ``for_s``, as
the demo's short ``for`` does. :func:`summarize` pools the runs per scenario (min, median,
max) and checks the bounds (``BOUNDS``), and that a control, a priority burst or a surge of
the usual load fires no alert and a surge's slowest requests are not called slowed (SMs, GPU
or host);
``python -m bench.scenario_analysis FILE...`` pools files. Guarantee: pure functions of what the run recorded (no GPU,
no network); a scrape's sample is read as Prometheus reads it. Cost: one parse per scrape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from sightline.deploy.incident import EXPECTED_CAUSE
from sightline.deploy.prometheus_rules import SM_CONTENTION_ALERT, SloConfig
from sightline.instrumentation import semconv as sc

__all__ = ["ALERT_OF", "AlertClock", "AlertRules", "BOUNDS", "score_interval", "summarize", "format_summary",
           "pool"]

DEVICE_ALERT, HOST_ALERT = "SightlineDeviceContention", "SightlineHostStall"
# the alert each kind of planted interval should fire (None: none should)
ALERT_OF = {"sm_neighbour": SM_CONTENTION_ALERT, "hbm_hog": DEVICE_ALERT, "host_stall": HOST_ALERT,
            "priority_burst": None, "load_surge": None, "control": None}
# causes that say the engine or its GPU ran slow: none of them fits a busier engine
_SLOWNESS = (sc.CAUSE_SM_CONTENTION, sc.CAUSE_DEVICE_CONTENTION, sc.CAUSE_HOST_STALL)
_CAUSE_ALERTS = {DEVICE_ALERT: sc.CAUSE_DEVICE_CONTENTION, HOST_ALERT: sc.CAUSE_HOST_STALL}
# issue 30's bounds: precision and recall per interval, share of the planted cause, onset to alert
BOUNDS = {"precision": 0.9, "recall": 0.9, "cause_share": 0.9, "onset_to_alert_s": 30.0}


@dataclass(frozen=True)
class AlertRules:
    """How the rules are evaluated here: ``for_s`` (the demo's short wait), the cause rules'
    window, and their thresholds (the rules' own, from ``SloConfig``)."""

    for_s: float = 5.0
    # within one scenario's segment: a longer window holds the segment before's causes too
    cause_window_s: float = 20.0
    cause_min_requests: int = SloConfig().cause_min_requests
    cause_min_share: float = SloConfig().cause_min_share


@dataclass
class _Alert:
    pending_since: float | None = None
    episodes: list[list[float | None]] = field(default_factory=list)  # [fired at, ended at or None]


class AlertClock:
    """Feeds on scrapes of the collector's /metrics (:meth:`observe`, in time order) and keeps
    when each alert fired and stopped (module docstring)."""

    def __init__(self, rules: AlertRules | None = None) -> None:
        self.rules = rules or AlertRules()
        self.alerts = {name: _Alert() for name in (SM_CONTENTION_ALERT, DEVICE_ALERT, HOST_ALERT)}
        self._causes: list[tuple[float, dict[str, float]]] = []  # (t, counter per cause)
        self.contended: list[tuple[float, int]] = []  # (t, SMs with a contention score)

    def observe(self, t: float, text: str) -> dict[str, bool]:
        """One scrape at ``t`` (Unix seconds): each alert's condition then."""
        scores, causes = 0, {}
        for family in text_string_to_metric_families(text):
            if family.name == sc.COLLECTOR_SM_CONTENTION_SCORE:
                scores += len(family.samples)
            elif family.name.removesuffix("_total") == sc.COLLECTOR_SLOW_REQUESTS_EXPLAINED:
                for s in family.samples:
                    if s.name.endswith("_total"):
                        causes[s.labels[sc.LABEL_CAUSE]] = causes.get(s.labels[sc.LABEL_CAUSE], 0.0) + s.value
        self.contended.append((t, scores))
        self._causes.append((t, causes))
        conditions = {SM_CONTENTION_ALERT: scores > 0}
        increase = self._increase(t)
        # as the rules do: of the slow requests given a cause (unknown ones do not count)
        total = sum(n for cause, n in increase.items() if cause != sc.CAUSE_UNKNOWN)
        for alert, cause in _CAUSE_ALERTS.items():
            n = increase.get(cause, 0.0)
            conditions[alert] = (n >= self.rules.cause_min_requests and total > 0
                                 and n / total >= self.rules.cause_min_share)
        for name, holds in conditions.items():
            self._step(self.alerts[name], t, holds)
        return conditions

    def cause_counts(self) -> list[list]:
        """[scrape time, the slow-request counters by cause] at each scrape they changed."""
        out: list[list] = []
        for t, counts in self._causes:
            if not out or counts != out[-1][1]:
                out.append([t, counts])
        return out

    def _increase(self, t: float) -> dict[str, float]:
        """Each cause's counter now minus at the newest scrape at least the window ago (or the
        first scrape): ``increase()`` over the window, without its extrapolation."""
        now = self._causes[-1][1]
        before = self._causes[0][1]
        for when, counts in self._causes:
            if when <= t - self.rules.cause_window_s:
                before = counts
            else:
                break
        return {cause: max(0.0, n - before.get(cause, 0.0)) for cause, n in now.items()}

    def _step(self, alert: _Alert, t: float, holds: bool) -> None:
        firing = bool(alert.episodes) and alert.episodes[-1][1] is None
        if not holds:
            alert.pending_since = None
            if firing:
                alert.episodes[-1][1] = t
            return
        if alert.pending_since is None:
            alert.pending_since = t
        if not firing and t - alert.pending_since >= self.rules.for_s:
            alert.episodes.append([t, None])

    def episodes(self) -> dict[str, list[list[float | None]]]:
        return {name: [list(e) for e in a.episodes] for name, a in self.alerts.items()}


def _onset_to_alert(episodes: list[list[float | None]], onset: float, until: float) -> tuple[float | None, str]:
    """Seconds from ``onset`` to the first firing at or after it (before ``until``); an alert
    already firing at the onset counts as 0 and says so."""
    for fired, ended in episodes:
        if fired <= onset and (ended is None or ended > onset):
            return 0.0, "already firing at the onset"
        if onset <= fired <= until:
            return fired - onset, "fired"
    return None, "did not fire"


def score_interval(interval: dict[str, Any], findings: list[dict[str, Any]], slowest: list[dict[str, Any]],
                   episodes: dict[str, list[list[float | None]]], grace_s: float = 30.0,
                   since_unix_s: float | None = None) -> dict[str, Any]:
    """One planted interval: ``interval`` has ``kind``, ``start_unix_s``, ``end_unix_s`` and
    ``sms``; ``findings`` are deploy/incident.py Findings' dicts (one per kernel) of it; ``slowest``
    the explanations (``cause`` with ``name``) of its 10 slowest requests; ``episodes`` from
    :meth:`AlertClock.episodes`. An alert counts when it fires by the interval's end + ``grace_s``.
    ``since_unix_s`` (default: the interval's start) is where its segment began: alerts that
    fired from then to the interval's end are its own, those fired before it and still firing
    at the interval's start are carried (an earlier segment's incident whose alert had not
    resolved by the onset: the segment's lead was too short)."""
    kind, start, end = interval["kind"], interval["start_unix_s"], interval["end_unix_s"]
    expected = EXPECTED_CAUSE[kind]
    kernels = {f["kernel"]: {"planted": len(f["planted"]), "flagged": len(f["flagged"]),
                             "true_positives": len(set(map(str, f["planted"])) & set(map(str, f["flagged"]))),
                             "precision": f.get("precision"), "recall": f.get("recall"), "slots": f["slots"]}
               for f in findings}
    causes: dict[str, int] = {}
    for r in slowest:
        name = (r.get("cause") or {}).get("name", sc.CAUSE_UNKNOWN)
        causes[name] = causes.get(name, 0) + 1
    share = (causes.get(expected, 0) / len(slowest)) if expected and slowest else None
    alert = ALERT_OF[kind]
    onset_to_alert, how = (_onset_to_alert(episodes.get(alert, []), start, end + grace_s)
                           if alert else (None, "no alert expected"))
    # alerts that fired in its segment (for a control or a burst: none should), and those still
    # firing from before it
    since = start if since_unix_s is None else since_unix_s
    fired = sorted(name for name, eps in episodes.items() if any(since <= f <= end for f, _ in eps))
    carried = sorted(name for name, eps in episodes.items() if any(f < since and (e is None or e > start)
                                                                   for f, e in eps))
    return {"kind": kind, "start_unix_s": start, "end_unix_s": end, "planted_sms": len(interval.get("sms", ())),
            "kernels": kernels, "expected_cause": expected, "causes": causes, "cause_share": share,
            "alert": alert, "onset_to_alert_s": onset_to_alert, "alert_how": how, "alerts_fired": fired,
            "alerts_carried": carried}


def _spread(values: list[float]) -> dict[str, float] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "runs": len(values)}


def summarize(scored: list[dict[str, Any]]) -> dict[str, Any]:
    """Per scenario (``scenario`` key of each scored interval, else its kind): the spread of
    each figure over its runs, and whether issue 30's bounds held in every run."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(s.get("scenario", s["kind"]) for s in scored):
        runs = [s for s in scored if s.get("scenario", s["kind"]) == name]
        kind = runs[0]["kind"]
        kernels = sorted({k for s in runs for k in s["kernels"]})
        entry: dict[str, Any] = {"kind": kind, "runs": len(runs), "kernels": {}}
        for k in kernels:
            got = [s["kernels"][k] for s in runs if k in s["kernels"]]
            entry["kernels"][k] = {"precision": _spread([g["precision"] for g in got]),
                                   "recall": _spread([g["recall"] for g in got]),
                                   "flagged": _spread([g["flagged"] for g in got])}
        entry["cause_share"] = _spread([s["cause_share"] for s in runs])
        entry["onset_to_alert_s"] = _spread([s["onset_to_alert_s"] for s in runs])
        entry["alerts_fired"] = sorted({a for s in runs for a in s["alerts_fired"]})
        entry["alerts_carried"] = sorted({a for s in runs for a in s.get("alerts_carried", ())})
        checks = {}
        if kind == "sm_neighbour":
            # per kernel: every interval of every run within the bounds
            checks["sms_found"] = {k: all((s["kernels"].get(k) or {}).get("precision") is not None
                                          and s["kernels"][k]["precision"] >= BOUNDS["precision"]
                                          and s["kernels"][k]["recall"] >= BOUNDS["recall"] for s in runs)
                                   for k in kernels}
        else:
            checks["no_sm_flagged"] = all(g["flagged"] == 0 for s in runs for g in s["kernels"].values())
        if EXPECTED_CAUSE[kind]:
            pooled = [s for s in runs if s["cause_share"] is not None]
            checks["cause"] = bool(pooled) and sum(s["cause_share"] for s in pooled) / len(pooled) >= BOUNDS["cause_share"]
        if ALERT_OF[kind]:
            checks["onset_to_alert"] = all(s["onset_to_alert_s"] is not None
                                           and s["onset_to_alert_s"] <= BOUNDS["onset_to_alert_s"] for s in runs)
        if kind in ("control", "load_surge", "priority_burst"):   # waiting or a busier engine: no alert
            checks["no_alert"] = not entry["alerts_fired"]
        if kind == "load_surge":   # more of the usual load: its slowest requests are not called slowed
            checks["no_slowness_named"] = not any(s["causes"].get(c) for s in runs for c in _SLOWNESS)
        entry["checks"] = checks
        out[name] = entry
    return out


def _fmt(spread: dict[str, float] | None, digits: int = 2) -> str:
    if spread is None:
        return "-"
    if spread["min"] == spread["max"]:
        return f"{spread['min']:.{digits}f}"
    return f"{spread['median']:.{digits}f} [{spread['min']:.{digits}f}, {spread['max']:.{digits}f}]"


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table: median [min, max] over the runs."""
    lines = ["| scenario | runs | kernel | precision | recall | SMs flagged | planted cause in 10 slowest "
             "| onset to alert (s) | checks |", "|---|---|---|---|---|---|---|---|---|"]
    for name, e in summary.items():
        checks = ", ".join(f"{k} {'ok' if v is True else 'FAIL' if v is False else v}" for k, v in e["checks"].items())
        if e.get("alerts_carried"):
            checks += f" (still firing at the onset, from the segment before: {', '.join(e['alerts_carried'])})"
        for i, (kernel, k) in enumerate(sorted(e["kernels"].items()) or [("-", None)]):
            first = i == 0
            lines.append(f"| {name if first else ''} | {e['runs'] if first else ''} | {kernel} "
                         f"| {_fmt(k and k['precision'])} | {_fmt(k and k['recall'])} | {_fmt(k and k['flagged'], 0)} "
                         f"| {_fmt(e['cause_share']) if first else ''} | {_fmt(e['onset_to_alert_s'], 1) if first else ''} "
                         f"| {checks if first else ''} |")
    return "\n".join(lines)


def pool(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary of several runs' result files (bench/scenarios.py's JSON), their scored
    intervals renumbered run by run in the order given."""
    scored, run = [], 0
    for record in records:
        rounds = sorted({s["run"] for s in record["scored"]})
        for s in record["scored"]:
            scored.append(dict(s, run=run + rounds.index(s["run"]) + 1))
        run += len(rounds)
    return summarize(scored)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Pools bench/scenarios.py result files: median [min, max] per scenario.")
    ap.add_argument("results", type=Path, nargs="+", help="scenarios-<device>-<commit>.json files")
    ap.add_argument("--json", type=Path, default=None, help="also write the pooled summary here")
    args = ap.parse_args(argv)
    summary = pool([json.loads(path.read_text()) for path in args.results])
    print(format_summary(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
