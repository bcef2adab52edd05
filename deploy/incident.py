"""A planted GPU incident and how well Sightline found it.

A capture may say in its metadata (instrumentation/capture.py) what was planted in it and
when: SM neighbours on known SMs (bench/record_incident.py measures them with ``%smid``),
an HBM-bandwidth hog, a host-side stall, a priority burst, a surge of the usual load, or
nothing (a control interval);
each interval's ``kind`` names the cause ``explain`` should give (``EXPECTED_CAUSE``). A
capture whose incident was planted synthetically says so (``synthetic``).
:func:`find` compares an interval's planted SMs with the SMs the collector's contention
tests (collector/contention.py, in the time x SM heatmap) flagged in at least half of the
heatmap slots lying at least half inside the interval. Precision: the share of flagged SMs
that were planted; recall: the share of planted SMs flagged. Cost: one pass over the
heatmap's cells per interval.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..instrumentation import check_range

__all__ = ["EXPECTED_CAUSE", "INCIDENT_FORMAT", "Finding", "Incident", "PlantedInterval", "find", "flag_contended_sms",
           "interval_columns", "interval_s"]

INCIDENT_FORMAT = "sightline.incident/1"


# What each kind of planted interval should be explained as (collector/causes.py's classes);
# a control interval plants nothing; a load surge plants more of the usual requests, which
# makes the engine busier, not slower: no cause of slowness fits it.
EXPECTED_CAUSE = {"sm_neighbour": "sm_contention", "hbm_hog": "device_contention", "host_stall": "host_stall",
                  "priority_burst": "queueing", "load_surge": None, "control": None}


@dataclass(frozen=True)
class PlantedInterval:
    """What was planted on one GPU from ``start`` to ``end`` (capture time, ns): for an SM
    neighbour the SMs it occupied; other kinds hold no SM."""

    start_unix_nano: int
    end_unix_nano: int
    sms: tuple[int, ...]
    gpu: str = "0"
    kind: str = "sm_neighbour"  # a key of EXPECTED_CAUSE

    def __post_init__(self) -> None:
        if not 0 < self.start_unix_nano < self.end_unix_nano:
            raise ValueError(f"interval [{self.start_unix_nano}, {self.end_unix_nano}] must have "
                             "0 < start < end (ns since the Unix epoch)")
        if self.kind not in EXPECTED_CAUSE:
            raise ValueError(f"interval kind={self.kind!r} must be one of {', '.join(EXPECTED_CAUSE)}")
        if (self.kind == "sm_neighbour") != bool(self.sms) or any(not 0 <= sm < 1024 for sm in self.sms):
            raise ValueError(f"interval SMs {self.sms}: an sm_neighbour interval needs a non-empty list of "
                             f"ids in [0, 1024), a {self.kind} interval none")

    @property
    def expected_cause(self) -> str | None:
        return EXPECTED_CAUSE[self.kind]

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
        check_range("Incident.num_sms", self.num_sms, 1, 1024, integer=True)
        if not self.intervals:
            raise ValueError("Incident.intervals is empty: nothing was planted")
        for interval in self.intervals:
            if interval.sms and max(interval.sms) >= self.num_sms:
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
                                              tuple(int(sm) for sm in i["sms"]), str(i.get("gpu", "0")),
                                              str(i.get("kind", "sm_neighbour")))
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
    flagged: dict[int, float | None]  # SM -> its largest contention score in those slots
    reasons: dict[int, str] = field(default_factory=dict)  # SM -> "slow", "starved" or both
    slots_flagged: dict[int, int] = field(default_factory=dict)  # SM -> slots that flagged it

    @property
    def true_positives(self) -> int:
        return len(set(self.planted) & set(self.flagged))

    @property
    def precision(self) -> float | None:
        return self.true_positives / len(self.flagged) if self.flagged else None

    @property
    def recall(self) -> float | None:
        return self.true_positives / len(self.planted) if self.planted else None

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), flagged={str(k): v for k, v in self.flagged.items()},
                    reasons={str(k): v for k, v in self.reasons.items()},
                    slots_flagged={str(k): v for k, v in self.slots_flagged.items()},
                    precision=self.precision, recall=self.recall)


def interval_s(text: str) -> tuple[float, float]:
    """``"START,END"`` (seconds from a recording's start) as a pair; ValueError naming it."""
    try:
        start, end = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"interval {text!r}: expected START,END in seconds, e.g. 60,95") from None
    if not 0 <= start < end:
        raise ValueError(f"interval {text!r}: need 0 <= START < END")
    return start, end


def interval_columns(heatmap: dict[str, Any], start_s: float, end_s: float) -> list[int]:
    """The columns of a ``time_sm`` heatmap (JSON) whose slot lies at least half in the range."""
    slot_s = heatmap["slot_s"]
    return [c for c, t in enumerate(heatmap["times_unix_s"])
            if min(t + slot_s, end_s) - max(t, start_s) >= slot_s / 2]


def flag_contended_sms(heatmap: dict[str, Any], start_s: float, end_s: float
                       ) -> tuple[dict[int, float | None], dict[int, str], dict[int, int], int]:
    """SMs of a ``time_sm`` heatmap (its JSON form) that the collector's contention tests
    flagged in at least half of the slots of ``[start_s, end_s]`` that had CTAs of the
    kernel: their largest score, reasons and flagged slots; and how many slots were read."""
    columns = interval_columns(heatmap, start_s, end_s)
    marks, scores = heatmap.get("contention") or [], heatmap.get("contention_score") or []
    with_data = [c for c in columns if any(c < len(row) and row[c] is not None
                                           for row in heatmap.get("contention_score") or [])]
    flagged, reasons, counted = {}, {}, {}
    for sm, row, row_scores in zip(heatmap["sms"], marks, scores):
        if not str(sm).isdigit():
            continue
        hits = [c for c in with_data if row[c]]
        if not hits or 2 * len(hits) < len(with_data):
            continue
        found = [row_scores[c] for c in hits if row_scores[c] is not None]
        flagged[int(sm)] = max(found) if found else None
        reasons[int(sm)] = "+".join(r for r in ("slow", "starved") if any(r in row[c] for c in hits))
        counted[int(sm)] = len(hits)
    order = sorted(flagged)
    return ({sm: flagged[sm] for sm in order}, {sm: reasons[sm] for sm in order},
            {sm: counted[sm] for sm in order}, len(columns))


def probe_heatmaps(aggregator) -> list[dict[str, Any]]:
    """Each SM-probed kernel's ``time_sm`` heatmap of an in-process collector (``aggregator``),
    in its JSON form with its GPU's ``gpu_index``: what :func:`find` reads."""
    from ..collector.heatmap import time_sm
    return [dict(time_sm(aggregator.sm, aggregator.sm.resolve(e["gpu"], e["kernel"], e["instance"])).to_dict(),
                 gpu_index=e["gpu_index"]) for e in aggregator.kernels() if e["source"] == "sm_probe"]


def find(incident: Incident, heatmaps: list[dict[str, Any]], time_map) -> list[Finding]:
    """A :class:`Finding` per (interval, heatmap of that interval's GPU); ``time_map`` maps
    capture time (ns) to replayed time (ns), e.g. ``collector.replay.TimeMap``. A heatmap is
    the interval's GPU when its ``gpu`` or ``gpu_index`` is the interval's (heatmaps name a
    GPU by its UUID when the engine had NVML; incidents by index)."""
    findings = []
    for interval in incident.intervals:
        start_s = time_map(interval.start_unix_nano) / 1e9
        end_s = time_map(interval.end_unix_nano) / 1e9
        for heatmap in heatmaps:
            if interval.gpu not in (str(heatmap["gpu"]), str(heatmap.get("gpu_index"))):
                continue
            flagged, reasons, counted, slots = flag_contended_sms(heatmap, start_s, end_s)
            findings.append(Finding(str(heatmap["kernel"]), interval.gpu, start_s, end_s, slots,
                                    sorted(interval.sms), flagged, reasons, counted))
    return findings
