"""The GPU's CTA dispatch order: which SM the block scheduler gives each CTA of a launch.

On an idle GPU the scheduler deals a launch's CTAs over the SMs in one fixed order, one CTA
per SM per round: CTA ``i`` of a launch goes to SM ``order[i % S]`` (S SMs) while the
launch fits on the GPU at once. A launch of fewer than S CTAs leaves the order's tail idle
and one of 1-2 waves leaves it a CTA short, launch after launch. Counted against an even
split, those SMs read as starved with nothing on the GPU; counted against this deal
(``sm_histograms.DeviceCtaHistograms`` does, per CTA), they do not.

Learned once at start-up from probed launches of S CTAs, each CTA holding its SM for a few
microseconds so that every SM is dealt one before any CTA ends. Guarantee: the order is
returned only when every launch put exactly one CTA on each SM, in the same order (another
process on the GPU breaks that: then None, and the telemetry reports no deal). Cost: a few
launches of S tiny CTAs, about a millisecond, once.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np

from .sm_probe import PROBE_FAKE, PROBE_HW, RECORD_WORDS, probe_begin, probe_cta_index, probe_end

__all__ = ["dispatch_order_from", "learn_dispatch_order"]

log = logging.getLogger(__name__)

_HOLD_NS = 20_000   # long enough for the scheduler to deal every SM a CTA (a few hundred ns)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is in the gpu/test extras
    triton = None

if triton is not None:
    @triton.jit(do_not_specialize=["hold_ns"])
    def _dispatch_probe(probe_ptr, hold_ns, PROBE: tl.constexpr):
        t0 = probe_begin(PROBE)
        now = t0
        while now - t0 < hold_ns:
            now = probe_begin(PROBE)
        probe_end(probe_ptr, probe_cta_index(), t0, PROBE)


def dispatch_order_from(launches: list[np.ndarray], num_sms: int) -> np.ndarray | None:
    """The SM of each CTA index, from the SM ids of launches of ``num_sms`` CTAs (in CTA
    order); None unless each launch is the same permutation of ``0..num_sms-1``."""
    if not launches:
        return None
    first = np.asarray(launches[0], dtype=np.int64)
    if first.shape != (num_sms,) or not np.array_equal(np.sort(first), np.arange(num_sms)):
        return None
    if any(not np.array_equal(np.asarray(sms, dtype=np.int64), first) for sms in launches[1:]):
        return None
    return first


def learn_dispatch_order(device, num_sms: int, launches: int = 3, fake: bool = False) -> np.ndarray | None:
    """Launches ``launches`` probed grids of ``num_sms`` CTAs on ``device`` and returns
    :func:`dispatch_order_from` of them. ``fake``: the interpreter's probe (SM = CTA % 8;
    it describes no hardware, for the tests). Syncs the device; call it before serving."""
    import torch
    if triton is None:
        return None
    mode = PROBE_FAKE if fake else PROBE_HW
    device = torch.device(device)
    seen = []
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            for _ in range(launches):
                records = torch.full((num_sms * RECORD_WORDS,), -1, dtype=torch.int64, device=device)
                _dispatch_probe[(num_sms,)](records, 0 if fake else _HOLD_NS, PROBE=mode)
                seen.append(records.view(num_sms, RECORD_WORDS)[:, 0].cpu().numpy())
    except Exception:   # telemetry never stops the engine: without the order, the even split
        log.exception("the dispatch-order launch failed")
        return None
    order = dispatch_order_from(seen, num_sms)
    if order is None:
        log.warning("the GPU's CTA dispatch order could not be learned (a launch of %d CTAs did "
                    "not cover each SM once); SM shares are tested against an even split", num_sms)
    return order
