"""The causes of slow requests as a Prometheus series: each slow request counted once by cause.

:meth:`SlowRequestCauses.refresh` (run when /metrics is scraped) explains the requests that
ended since the last refresh, at least ``settle_s`` ago (their steps and kernel spans have
arrived by then) and, where engines send per-SM data, before the slot still open (its SMs
are tested when it closes: up to one slot later), whose e2e per output token is at least
``factor`` times the usual one (the middle of the densest half of the stored requests': an
incident in fewer than half of them does not move it, so one incident's slow requests never
hide the next one's), and adds one to the cause :mod:`.causes` named for each. Guarantee: a
request is counted at most once (a watermark on end times), every cause class is present
from the start (at 0), so ``increase()`` sees the first one. Cost per scrape: the store's
pending index, one pass and one sort over its request roots, and one explanation per newly
slow request (at most ``max_per_refresh``; the rest wait for the next scrape).
"""

from __future__ import annotations

import threading

import numpy as np

from ..instrumentation import check_range
from ..instrumentation import semconv as sc
from .engine_timeline import usual_value
from .explain import explain_requests

__all__ = ["SlowRequestCauses"]


class SlowRequestCauses:
    """See the module docstring; thread-safe (scrapes may overlap)."""

    def __init__(self, factor: float = 1.5, settle_s: float = 5.0, max_per_refresh: int = 200) -> None:
        check_range("SlowRequestCauses.factor", factor, 1.0, 1000.0)
        check_range("SlowRequestCauses.settle_s", settle_s, 0.0, 3600.0)
        check_range("SlowRequestCauses.max_per_refresh", max_per_refresh, 1, 100_000, integer=True)
        self.factor, self.settle_s, self.max_per_refresh = factor, settle_s, max_per_refresh
        self.counts = dict.fromkeys(sc.CAUSES, 0)
        self._watermark_ns = 0  # requests that ended at or before this were considered
        self._lock = threading.Lock()

    def refresh(self, sources, now_s: float) -> dict[str, int]:
        """Classifies the requests newly slow (module docstring); returns the counts by cause."""
        with self._lock:
            horizon_ns = int((now_s - self.settle_s) * 1e9)
            if sources.points_seen:
                # the contention tests read closed slots only: a life reaching into the open
                # slot has no SM evidence yet, and counted now its cause (a slower GPU, with
                # the SMs that explain it not yet flagged) would stay counted
                horizon_ns = min(horizon_ns, int(sources.sm.window.slot_start(now_s) * 1e9))
            picked: list = []

            def roots_of(store):
                roots = store.request_roots()
                fresh = [r for r in roots if self._watermark_ns < r.end_time_unix_nano <= horizon_ns]
                if not fresh:
                    return []
                threshold = self.factor * usual_value(np.fromiter(map(per_output_token_s, roots), float, len(roots)))
                fresh.sort(key=lambda r: r.end_time_unix_nano)
                taken = fresh[:self.max_per_refresh]
                picked.append(taken[-1].end_time_unix_nano if len(taken) < len(fresh) else horizon_ns)
                return [r for r in taken if per_output_token_s(r) >= threshold]

            explained = explain_requests(sources, roots_of, max_steps=1, max_kernels=1)
            if picked:
                self._watermark_ns = max(self._watermark_ns, picked[0])
            for req in explained:
                name = req.cause.name if req.cause is not None else sc.CAUSE_UNKNOWN
                self.counts[name] = self.counts.get(name, 0) + 1
            return dict(self.counts)


def per_output_token_s(root) -> float:
    """A request's e2e per output token, which compares requests of any length (a request
    without a token count counts as one token)."""
    return root.e2e_s / max(1, root.output_tokens)
