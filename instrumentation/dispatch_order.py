"""The GPU's CTA dispatch: which SM the block scheduler gives each CTA of a launch.

On an idle GPU the scheduler places a launch's CTAs the same way every time, and how
depends on the launch's size: 64 CTAs on an H200's 132 SMs take one SM of each TPC pair
first, 128 leave the same four SMs idle, and a launch of 1-2 waves leaves a fixed group a
CTA short. Counted against an even split, those SMs read as starved with nothing on the
GPU; counted against this deal (``sm_histograms.DeviceCtaHistograms`` does, per CTA),
they do not. :class:`DispatchDeal` holds the placement of every launch of 1 to S CTAs (S
SMs); a wider one deals whole rounds as the launch of S does, then the rest as a launch of
that many (a model: past one wave, CTAs go where earlier ones ended).

Learned once at start-up: two passes of probed launches of 1..S CTAs, each CTA holding its
SM for a few microseconds so that all of a launch's CTAs are placed before any ends.
Guarantee: a deal is returned only when both passes agree and no launch put two CTAs on one
SM (another process on the GPU breaks that: then None, and no deal is reported). Cost: 2 S
launches of at most S tiny CTAs, a few milliseconds, once.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import numpy as np

from .sm_probe import PROBE_FAKE, PROBE_HW, RECORD_WORDS, probe_begin, probe_cta_index, probe_end

__all__ = ["DispatchDeal", "dispatch_deal_from", "learn_dispatch_deal"]

log = logging.getLogger(__name__)

_HOLD_NS = 20_000   # long enough for the scheduler to place every CTA (a few hundred ns)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is in the gpu/test extras
    triton = None

if triton is not None:
    @triton.jit(do_not_specialize=["base", "hold_ns"])
    def _dispatch_probe(probe_ptr, base, hold_ns, PROBE: tl.constexpr):
        t0 = probe_begin(PROBE)
        now = t0
        while now - t0 < hold_ns:
            now = probe_begin(PROBE)
        probe_end(probe_ptr, base + probe_cta_index(), t0, PROBE)


def _offset(grid: int) -> int:
    """Where the launch of ``grid`` CTAs starts in :attr:`DispatchDeal.flat`."""
    return grid * (grid - 1) // 2


@dataclass(frozen=True)
class DispatchDeal:
    """The SM of each CTA of launches of 1..``num_sms`` CTAs on the idle GPU."""

    num_sms: int
    flat: np.ndarray   # int64: the launches of 1, 2, ..., num_sms CTAs, one after another

    def sms_of(self, grid: int) -> np.ndarray:
        """The SM of each CTA of a launch of ``grid`` CTAs: whole rounds as the launch of
        ``num_sms``, the rest as a launch of that many."""
        s = self.num_sms
        full, rest = divmod(grid, s)
        widest = self.flat[_offset(s):_offset(s) + s]
        return np.concatenate([np.tile(widest, full), self.flat[_offset(rest):_offset(rest) + rest]])

    def per_sm(self, grid: int) -> np.ndarray:
        """CTAs each SM gets of a launch of ``grid``."""
        return np.bincount(self.sms_of(grid), minlength=self.num_sms)


def dispatch_deal_from(passes: list[np.ndarray], num_sms: int) -> DispatchDeal | None:
    """The deal from passes of the SMs that launches of 1..``num_sms`` CTAs used (each pass
    those launches' SMs one after another, in CTA order); None unless every pass agrees and
    no launch used an SM twice or one outside ``0..num_sms-1``."""
    size = _offset(num_sms + 1)
    if not passes or any(np.shape(p) != (size,) for p in passes):
        return None
    first = np.asarray(passes[0], dtype=np.int64)
    if any(not np.array_equal(np.asarray(p, dtype=np.int64), first) for p in passes[1:]):
        return None
    for grid in range(1, num_sms + 1):
        sms = first[_offset(grid):_offset(grid) + grid]
        if sms.min() < 0 or sms.max() >= num_sms or np.unique(sms).size != grid:
            return None
    return DispatchDeal(num_sms, first)


def learn_dispatch_deal(device, num_sms: int, passes: int = 2, fake: bool = False) -> DispatchDeal | None:
    """Launches ``passes`` rounds of probed grids of 1..``num_sms`` CTAs on ``device`` and
    returns :func:`dispatch_deal_from` of them. ``fake``: the interpreter's probe (SM = CTA
    % 8; it describes no hardware, for the tests). Syncs the device; call it before serving."""
    import torch
    if triton is None:
        return None
    mode = PROBE_FAKE if fake else PROBE_HW
    device = torch.device(device)
    size = _offset(num_sms + 1)
    seen = []
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            for _ in range(passes):
                records = torch.full((size * RECORD_WORDS,), -1, dtype=torch.int64, device=device)
                for grid in range(1, num_sms + 1):
                    _dispatch_probe[(grid,)](records, _offset(grid), 0 if fake else _HOLD_NS, PROBE=mode)
                seen.append(records.view(size, RECORD_WORDS)[:, 0].cpu().numpy())
    except Exception:   # telemetry never stops the engine: without the deal, the even split
        log.exception("the dispatch-order launches failed")
        return None
    deal = dispatch_deal_from(seen, num_sms)
    if deal is None:
        log.warning("the GPU's CTA dispatch could not be learned (launches of 1..%d CTAs placed "
                    "differently twice, or two CTAs on one SM); SM shares are tested against an "
                    "even split", num_sms)
    return deal
