"""The demo's incident chapter: what the replayed capture planted against what Sightline found.

* :func:`demo_rules`: the project's alert rules with ``SightlineSMContention``'s ``for`` cut to
  seconds, so that the alert can fire within the demo (production waits 15 minutes); the
  summary says so.
* :func:`wait_for_alert`: that alert as the demo's real Alertmanager lists it.
* :func:`story_kernel`: the attention kernel the story follows, the one with the most SMs
  flagged contended (then the highest hotspot ratio): what the heatmaps point a user at.
* :func:`screenshot_heatmap`: that kernel's time x SM heatmap page in headless Chromium,
  saved next to the heatmap PNGs.
* :func:`format_incident` / :func:`incident_record`: the summary's lines and JSON: each
  interval's planted SMs, the SMs the contention tests flagged then (deploy/incident.py),
  precision and recall, what each SM was compared with, where the slowest requests ran and
  the cause explain named for each (with its baseline), and the alert.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from .screenshot import screenshot
from . import prometheus_rules
from .stack import default_rules_files

__all__ = ["SM_CONTENTION_ALERT", "demo_rules", "format_incident", "incident_record",
           "screenshot_heatmap", "story_kernel", "wait_for_alert"]

SM_CONTENTION_ALERT = prometheus_rules.SM_CONTENTION_ALERT


def story_kernel(time_sm: list[dict[str, Any]]) -> str | None:
    """The kernel of the time x SM heatmap with the most SMs the contention tests flagged,
    then the highest hotspot ratio (hottest SM's P99 over the median SM's); None without
    one. Chosen from the data alone: no planted SM is looked at."""
    rated = [(len(h.get("contended") or {}), h["hotspot"]["ratio"], h["kernel"]) for h in time_sm
             if (h.get("hotspot") or {}).get("ratio") is not None]
    return max(rated)[2] if rated else None


def demo_rules(folder: Path, for_s: int) -> tuple[Path, ...] | None:
    """The rules files for the demo's Prometheus (None: the stack's default, when the
    checkout has no rules)."""
    sources = default_rules_files()
    if not sources:
        return None
    data = yaml.safe_load(sources[0].read_text())
    for group in data.get("groups", []):
        for rule in group.get("rules", []):
            if rule.get("alert") == SM_CONTENTION_ALERT:
                rule["for"] = f"{for_s}s"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "demo-rules.yml"
    path.write_text(f"# {sources[0].name} with {SM_CONTENTION_ALERT} waiting {for_s}s instead of its "
                    "production duration, so that it can fire within the demo\n"
                    + yaml.safe_dump(data, sort_keys=False))
    return (path, *sources[1:])


def wait_for_alert(alertmanager_url: str, name: str, timeout_s: float) -> list[dict[str, Any]]:
    """The alerts named ``name`` that Alertmanager lists (labels, startsAt, state), as soon
    as there is one; [] after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{alertmanager_url}/api/v2/alerts", timeout=10) as response:
                alerts = json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError):
            alerts = []
        found = [{"labels": a.get("labels", {}), "startsAt": a.get("startsAt"),
                  "state": (a.get("status") or {}).get("state")}
                 for a in alerts if a.get("labels", {}).get("alertname") == name]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(1.0)


def screenshot_heatmap(folder: Path, kernel: str | None) -> Path:
    """A Chromium screenshot of ``kernel``'s time x SM page (else the first one) in
    ``folder``, written beside it as ``<page>-chromium.png``."""
    pages = sorted(folder.glob("*-time_sm.html"))
    if not pages:
        raise RuntimeError(f"no time x SM heatmap page in {folder}")
    page = next((p for p in pages if kernel and f"-{kernel}-" in p.name), pages[0])
    return screenshot(page.resolve().as_uri(), page.with_name(page.stem + "-chromium.png"))


def _clock(t_s: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t_s))


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _slowest_requests(report) -> list[dict[str, Any]]:
    """The capture's slowest requests: in which interval each ran, and its slowest SM."""
    source = next((e for e in report.explanations if e["source"] != "this run"), None)
    rows = []
    for r in (source or {}).get("requests", []):
        start_s, end_s = r["start_time_unix_nano"] / 1e9, r["end_time_unix_nano"] / 1e9
        during = [i for i, f in enumerate(_by_interval(report)) if start_s < f[1] and end_s > f[0]]
        sm = r.get("slowest_sm") or {}
        planted = [i for i in during if sm.get("sm") is not None
                   and int(sm["sm"]) in report.incident.intervals[i].sms]
        cause = r.get("cause") or {}
        expected = {report.incident.intervals[i].expected_cause for i in during}
        rows.append({"trace_id": r["trace_id"], "e2e_s": r["e2e_s"], "intervals": [i + 1 for i in during],
                     "slowest_sm": sm.get("sm"), "slowest_sm_kernel": sm.get("kernel"),
                     "slowest_sm_source": sm.get("source"), "slowest_sm_planted": bool(planted),
                     "cause": cause.get("name"), "cause_summary": cause.get("summary"),
                     "cause_compared_with": cause.get("compared_with"),
                     "cause_is_planted": bool(during) and cause.get("name") in expected})
    return rows


def _by_interval(report) -> list[tuple[float, float]]:
    """Each interval as replayed (collector time, seconds)."""
    spans = {}
    for f in report.findings:
        spans.setdefault((f.start_unix_s, f.end_unix_s), None)
    return list(spans)


def incident_record(report) -> dict[str, Any]:
    return {"incident": report.incident.to_meta(), "story_kernel": report.story_kernel,
            "replayed_intervals_unix_s": _by_interval(report),
            "findings": [f.to_dict() for f in report.findings], "slowest_requests": _slowest_requests(report),
            "alerts": report.alerts}


def format_incident(report) -> list[str]:
    incident = report.incident
    kind = ("SYNTHETIC (planted into a measured capture, not a measurement)" if incident.synthetic
            else f"recorded on {incident.device} by {incident.tool}")
    lines = [f"The incident in the replayed capture, {kind}:", f"  {incident.description}"]
    if report.story_kernel:
        lines.append(f"  The story follows {report.story_kernel}: its per-SM view stands out most "
                     "(the most SMs flagged contended of the attention kernels).")
    replayed = _by_interval(report)
    for n, interval in enumerate(incident.intervals):
        when = (f"{_clock(replayed[n][0])}..{_clock(replayed[n][1])} UTC as replayed"
                if n < len(replayed) else "not replayed")
        lines.append(f"  interval {n + 1}: {interval.duration_s:.0f} s ({when}), a noisy neighbour on "
                     f"GPU {interval.gpu}, {len(interval.sms)} SMs: {', '.join(map(str, interval.sms))}")
        for f in report.findings:
            if (f.start_unix_s, f.end_unix_s) != replayed[n]:
                continue
            missed = sorted(set(f.planted) - set(f.flagged))
            extra = sorted(set(f.flagged) - set(f.planted))
            lines.append(f"    {f.kernel}: Sightline flags {len(f.flagged)} SMs contended over {f.slots} slots "
                         f"(in at least half of them: slow or starved against the kernel's other SMs in the same "
                         f"slot), {f.true_positives} planted: "
                         f"precision {_ratio(f.precision)}, recall {_ratio(f.recall)}"
                         + (f"; missed {missed}" if missed else "") + (f"; not planted {extra}" if extra else ""))
    lines.append("  How: each SM is compared with the kernel's other SMs in the same 10 s slot: slow when more "
                 "of its CTAs ran longer than their P90 than chance allows, starved when it ran fewer CTAs than "
                 "its share of the launches that cover every SM (collector/contention.py).")
    rows = _slowest_requests(report)
    if rows:
        inside = sum(bool(r["intervals"]) for r in rows)
        named = sum(r["cause_is_planted"] for r in rows if r["intervals"])
        lines.append(f"  The {len(rows)} slowest replayed requests: {inside} ran during an interval, "
                     f"{named} of those explained by the planted cause.")
        for r in rows:
            where = f"interval {', '.join(map(str, r['intervals']))}" if r["intervals"] else "no interval"
            sm = ("no SM known" if r["slowest_sm"] is None else
                  f"slowest SM {r['slowest_sm']} ({r['slowest_sm_kernel']}, from {r['slowest_sm_source']}; "
                  + ("a planted SM)" if r["slowest_sm_planted"] else "not planted)"))
            lines.append(f"    {r['trace_id']}: {r['e2e_s'] * 1e3:.0f} ms, {where}, {sm}")
            if r["cause"]:
                lines.append(f"      cause: {r['cause']}: {r['cause_summary']}")
        compared = next((r["cause_compared_with"] for r in rows if r["cause_compared_with"]), None)
        if compared:
            lines.append(f"    (causes compared with: {compared})")
    if report.alerts:
        for a in report.alerts:
            labels = a["labels"]
            lines.append(f"  Alertmanager: {SM_CONTENTION_ALERT} {a['state'] or 'received'} for GPU "
                         f"{labels.get('gpu', '?')} {labels.get('kernel', '?')} since {a['startsAt']} "
                         "(the demo's rule waits seconds; production waits 15 minutes)")
    else:
        lines.append(f"  Alertmanager: {SM_CONTENTION_ALERT} did not arrive in time")
    return lines
