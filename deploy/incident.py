"""A planted GPU incident and how well Sightline found it.

A capture may say in its metadata (instrumentation/capture.py) that a noisy neighbour
occupied known SMs in known intervals (bench/record_incident.py measures them with
``%smid``; a capture whose incident was planted synthetically says so, ``synthetic``).
:func:`find` compares those SMs with the SMs the collector's time x SM heatmap flags hot
in the same interval: in every heatmap slot lying at least half inside the interval, an
SM's score is its P99 CTA duration over the median SM's P99 in that slot (the hotspot
score of collector/heatmap.py, per slot); an SM is flagged when the median of its scores
over those slots is at least ``threshold``. Precision is the share of flagged SMs that
were planted, recall the share of planted SMs that were flagged. Optionally (``starve_ratio``)
also the SMs that ran fewer than that share of the median SM's CTAs in those slots, scored
the same way. Cost: one pass over the heatmap's cells per interval.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["INCIDENT_FORMAT", "Finding", "Incident", "PlantedInterval", "find", "flag_hot_sms", "flag_starved_sms",
           "interval_s"]

INCIDENT_FORMAT = "sightline.incident/1"


@dataclass(frozen=True)
class PlantedInterval:
    """SMs a neighbour occupied on one GPU from ``start`` to ``end`` (capture time, ns)."""

    start_unix_nano: int
    end_unix_nano: int
    sms: tuple[int, ...]
    gpu: str = "0"

    def __post_init__(self) -> None:
        if not 0 < self.start_unix_nano < self.end_unix_nano:
            raise ValueError(f"interval [{self.start_unix_nano}, {self.end_unix_nano}] must have "
                             "0 < start < end (ns since the Unix epoch)")
        if not self.sms or any(not 0 <= sm < 1024 for sm in self.sms):
            raise ValueError(f"interval SMs {self.sms} must be a non-empty list of ids in [0, 1024)")

    @property
    def duration_s(self) -> float:
        return (self.end_unix_nano - self.start_unix_nano) / 1e9


@dataclass(frozen=True)
class Incident:
    """What a capture says was planted in it (its metadata, ``INCIDENT_FORMAT``)."""

    synthetic: bool  # True: made up from another capture, measured nowhere
    description: str
    tool: str
    device: str
    num_sms: int
    intervals: tuple[PlantedInterval, ...]
    details: dict[str, Any] = field(default_factory=dict)  # how it was planted (neighbour, factors)

    def __post_init__(self) -> None:
        if not 1 <= self.num_sms <= 1024:
            raise ValueError(f"Incident.num_sms={self.num_sms} must be in [1, 1024]")
        if not self.intervals:
            raise ValueError("Incident.intervals is empty: nothing was planted")
        for interval in self.intervals:
            if max(interval.sms) >= self.num_sms:
                raise ValueError(f"interval SMs {interval.sms} exceed num_sms={self.num_sms}")

    def to_meta(self) -> dict[str, Any]:
        out = asdict(self)
        out["intervals"] = [dict(asdict(i), sms=list(i.sms)) for i in self.intervals]
        return {"format": INCIDENT_FORMAT, **out}

    @staticmethod
    def from_meta(meta: dict[str, Any] | None) -> Incident | None:
        """The incident in a capture's metadata; None when it records none."""
        if not meta or meta.get("format") != INCIDENT_FORMAT:
            return None
        try:
            intervals = tuple(PlantedInterval(int(i["start_unix_nano"]), int(i["end_unix_nano"]),
                                              tuple(int(sm) for sm in i["sms"]), str(i.get("gpu", "0")))
                              for i in meta["intervals"])
            return Incident(bool(meta["synthetic"]), str(meta["description"]), str(meta["tool"]),
                            str(meta["device"]), int(meta["num_sms"]), intervals,
                            dict(meta.get("details") or {}))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"capture metadata is not a {INCIDENT_FORMAT} record: {exc!r}") from None


@dataclass
class Finding:
    """One interval, one kernel: planted against flagged SMs."""

    kernel: str
    gpu: str
    start_unix_s: float  # the interval as replayed (collector time)
    end_unix_s: float
    slots: int  # heatmap slots that lie at least half inside the interval
    planted: list[int]
    flagged: dict[int, float]  # SM -> its median score over the slots
    threshold: float
    # SMs that ran few CTAs then: SM -> its CTAs over the median SM's (with starve_ratio only)
    starved: dict[int, float] = field(default_factory=dict)
    starve_ratio: float | None = None

    @property
    def true_positives(self) -> int:
        return len(set(self.planted) & set(self.flagged))

    @property
    def precision(self) -> float | None:
        return self.true_positives / len(self.flagged) if self.flagged else None

    @property
    def recall(self) -> float | None:
        return self.true_positives / len(self.planted) if self.planted else None

    @property
    def starved_precision(self) -> float | None:
        return len(set(self.planted) & set(self.starved)) / len(self.starved) if self.starved else None

    @property
    def starved_recall(self) -> float | None:
        if self.starve_ratio is None or not self.planted:
            return None
        return len(set(self.planted) & set(self.starved)) / len(self.planted)

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), flagged={str(k): v for k, v in self.flagged.items()},
                    starved={str(k): v for k, v in self.starved.items()},
                    precision=self.precision, recall=self.recall,
                    starved_precision=self.starved_precision, starved_recall=self.starved_recall)


def interval_s(text: str) -> tuple[float, float]:
    """``"START,END"`` (seconds from a recording's start) as a pair; ValueError naming it."""
    try:
        start, end = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"interval {text!r}: expected START,END in seconds, e.g. 60,95") from None
    if not 0 <= start < end:
        raise ValueError(f"interval {text!r}: need 0 <= START < END")
    return start, end


def _interval_columns(times_unix_s: list[float], slot_s: float, start_s: float, end_s: float) -> list[int]:
    columns = []
    for c, t in enumerate(times_unix_s):
        overlap = min(t + slot_s, end_s) - max(t, start_s)
        if overlap >= slot_s / 2:
            columns.append(c)
    return columns


def flag_hot_sms(heatmap: dict[str, Any], start_s: float, end_s: float,
                 threshold: float) -> tuple[dict[int, float], int]:
    """SMs flagged hot in ``[start_s, end_s]`` of a ``time_sm`` heatmap (its JSON form), with
    their median per-slot scores, and how many slots were read (see the module docstring)."""
    if not threshold > 1.0:
        raise ValueError(f"threshold={threshold} must be > 1 (an SM's P99 over the median SM's)")
    columns = _interval_columns(heatmap["times_unix_s"], heatmap["slot_s"], start_s, end_s)
    scores: dict[int, list[float]] = {}
    for c in columns:
        cells = {sm: row[c] for sm, row in zip(heatmap["sms"], heatmap["p99_s"]) if row[c] is not None}
        if not cells:
            continue
        median = statistics.median(cells.values())
        if median <= 0:
            continue
        for sm, p99 in cells.items():
            if str(sm).lstrip("-").isdigit():
                scores.setdefault(int(sm), []).append(p99 / median)
    flagged = {sm: statistics.median(v) for sm, v in scores.items() if statistics.median(v) >= threshold}
    return dict(sorted(flagged.items())), len(columns)


def flag_starved_sms(heatmap: dict[str, Any], start_s: float, end_s: float, ratio: float,
                     num_sms: int) -> dict[int, float]:
    """SMs (of ``0..num_sms-1``) that ran fewer than ``ratio`` times the median SM's CTAs in
    the slots of ``[start_s, end_s]`` (an SM absent from the heatmap ran none), each with
    its CTAs over the median's; empty when the median SM ran none."""
    if not 0.0 < ratio < 1.0:
        raise ValueError(f"starve_ratio={ratio} must be in (0, 1) (an SM's CTAs over the median SM's)")
    columns = _interval_columns(heatmap["times_unix_s"], heatmap["slot_s"], start_s, end_s)
    ctas = dict.fromkeys(range(num_sms), 0)
    for sm, row in zip(heatmap["sms"], heatmap["counts"]):
        if str(sm).isdigit() and int(sm) < num_sms:
            ctas[int(sm)] += sum(row[c] for c in columns)
    median = statistics.median(ctas.values()) if ctas else 0
    if median <= 0:
        return {}
    return {sm: n / median for sm, n in sorted(ctas.items()) if n < ratio * median}


def find(incident: Incident, heatmaps: list[dict[str, Any]], time_map, threshold: float,
         starve_ratio: float | None = None) -> list[Finding]:
    """A :class:`Finding` per (interval, heatmap of that interval's GPU); ``time_map`` maps
    capture time (ns) to replayed time (ns), e.g. ``collector.replay.TimeMap``; with
    ``starve_ratio`` the findings also say which SMs ran few CTAs (heatmaps need ``counts``).
    A heatmap is the interval's GPU when its ``gpu`` or ``gpu_index`` is the interval's
    (heatmaps name a GPU by its UUID when the engine had NVML; incidents by index)."""
    findings = []
    for interval in incident.intervals:
        start_s = time_map(interval.start_unix_nano) / 1e9
        end_s = time_map(interval.end_unix_nano) / 1e9
        for heatmap in heatmaps:
            if interval.gpu not in (str(heatmap["gpu"]), str(heatmap.get("gpu_index"))):
                continue
            flagged, slots = flag_hot_sms(heatmap, start_s, end_s, threshold)
            starved = ({} if starve_ratio is None else
                       flag_starved_sms(heatmap, start_s, end_s, starve_ratio, incident.num_sms))
            findings.append(Finding(str(heatmap["kernel"]), interval.gpu, start_s, end_s, slots,
                                    sorted(interval.sms), flagged, threshold, starved, starve_ratio))
    return findings
