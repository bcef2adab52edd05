"""The GPU's CTA dispatch: which SMs the block scheduler gives the CTAs of a launch.

On an idle GPU a launch of a given size lands on the same SMs every time: 64 CTAs on an
H200's 132 SMs leave the same 68 SMs idle (mostly one of each TPC pair), 128 leave four, 1-2
waves leave a fixed group a CTA short. Against an even split those SMs read as starved with
nothing else on the GPU; against this deal (``sm_histograms.DeviceCtaHistograms`` counts
each CTA where it says) they do not. :class:`DispatchDeal` holds the placement of every
launch of 1 to S CTAs (S SMs); a wider one deals whole rounds as the launch of S, then the
rest as a launch of that many (a model: past one wave, CTAs go where earlier ones ended).

Learned once at start-up from two passes of probed launches of 1..S CTAs, each CTA holding
its SM for 20 us so that all are placed before any ends. Guarantee: returned only when both
passes put each launch on the same SMs, none on one SM twice (another process on the GPU
breaks that: then None, and no deal is reported). Cost: 2 S tiny launches, milliseconds, once.
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
    those launches' SMs one after another, in CTA order); None unless every pass put each
    launch on the same SMs (the order among them may differ: the first pass's is kept) and
    no launch used an SM twice or one outside ``0..num_sms-1``."""
    size = _offset(num_sms + 1)
    if not passes or any(np.shape(p) != (size,) for p in passes):
        return None
    first = np.asarray(passes[0], dtype=np.int64)
    for grid in range(1, num_sms + 1):
        at = slice(_offset(grid), _offset(grid) + grid)
        sms = np.sort(first[at])
        if sms[0] < 0 or sms[-1] >= num_sms or np.unique(sms).size != grid:
            return None
        if any(not np.array_equal(np.sort(np.asarray(p[at], dtype=np.int64)), sms) for p in passes[1:]):
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
