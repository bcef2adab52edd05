"""The causes of slow requests as a Prometheus series: each slow request counted once by cause.

:meth:`SlowRequestCauses.refresh` (run when /metrics is scraped) explains the requests that
ended since the last refresh, at least ``settle_s`` ago (their steps and kernel spans have
arrived by then), whose e2e is at or above the ``quantile`` of the stored requests' e2e,
and adds one to the cause :mod:`.causes` named for each. Guarantee: a request is counted at
most once (a watermark on end times), every cause class is present from the start (at 0),
so ``increase()`` sees the first one. Cost per scrape: the store's pending index, one pass
over its request roots, and one explanation per newly slow request (at most ``max_per_refresh``;
the rest wait for the next scrape).
"""

from __future__ import annotations

import math
import threading

from ..instrumentation import check_range
from ..instrumentation import semconv as sc
from .explain import e2e_of, explain_requests

__all__ = ["SlowRequestCauses"]


class SlowRequestCauses:
    """See the module docstring; thread-safe (scrapes may overlap)."""

    def __init__(self, quantile: float = 0.9, settle_s: float = 5.0, max_per_refresh: int = 200) -> None:
        check_range("SlowRequestCauses.quantile", quantile, 0.0, 1.0)
        check_range("SlowRequestCauses.settle_s", settle_s, 0.0, 3600.0)
        check_range("SlowRequestCauses.max_per_refresh", max_per_refresh, 1, 100_000, integer=True)
        self.quantile, self.settle_s, self.max_per_refresh = quantile, settle_s, max_per_refresh
        self.counts = dict.fromkeys(sc.CAUSES, 0)
        self._watermark_ns = 0  # requests that ended at or before this were considered
        self._lock = threading.Lock()

    def refresh(self, sources, now_s: float) -> dict[str, int]:
        """Classifies the requests newly slow (module docstring); returns the counts by cause."""
        with self._lock:
            horizon_ns = int((now_s - self.settle_s) * 1e9)
            picked: list = []

            def roots_of(store):
                roots = store.request_roots()
                fresh = [r for r in roots if self._watermark_ns < r.end_time_unix_nano <= horizon_ns]
                if not fresh:
                    return []
                ranked = sorted(e2e_of(r) for r in roots)
                threshold = ranked[max(1, math.ceil(self.quantile * len(ranked))) - 1]
                fresh.sort(key=lambda r: r.end_time_unix_nano)
                taken = fresh[:self.max_per_refresh]
                picked.append(taken[-1].end_time_unix_nano if len(taken) < len(fresh) else horizon_ns)
                return [r for r in taken if e2e_of(r) >= threshold]

            explained = explain_requests(sources, roots_of, max_steps=1, max_kernels=1)
            if picked:
                self._watermark_ns = max(self._watermark_ns, picked[0])
            for req in explained:
                name = req.cause.name if req.cause is not None else sc.CAUSE_UNKNOWN
                self.counts[name] = self.counts.get(name, 0) + 1
            return dict(self.counts)
