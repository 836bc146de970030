"""A plan's places moved as a whole: mirrored (each place as far from the top as it lay from
the base) or shifted up. The greedy placement puts the largest places lowest; mirrored, they
lie at the top, next to the range's end, where a request larger than its place, sent the online
way, grows the range by the difference instead of by all of its bytes (Note [Plans mirrored] in
docs/design.md); around blocks that stay in the range, only the places above the highest of
them. Shifted: the first-fit fallback's places moved above the blocks that stay. NumPy."""

import numpy as np

from gpupool.region import placement

__all__ = ["mirrored", "shifted"]


def _moved(plan, offsets):
    """``plan`` with its planned requests at ``offsets`` (the others stay -1), its record of
    how it was made kept."""
    return placement.Plan(plan.step, np.where(plan.step.planned, offsets, -1),
                          method=plan.method, fallback=plan.fallback, tried=plan.tried,
                          planning_ms=plan.planning_ms, work=plan.work)


def mirrored(plan, fixed=(), pinned=None):
    """``plan`` (a ``placement.Plan``) with each planned request above the bytes that stay
    mirrored: its offset ``top + low - (offset + size)``, ``top`` the plan's bytes rounded up
    to ``placement.ALIGN``, ``low`` the end of the highest of the ``fixed`` rows (offset,
    bytes[, first, end], as ``placement.plan`` takes them) and of the requests ``pinned`` (an
    offset each, -1 where none), raised past any place that straddles it. The requests under
    ``low`` stay where they are, so the peak is the same, no two requests that lived apart
    share bytes, and the offsets are still multiples of ``placement.ALIGN``. With nothing
    fixed or pinned, ``low`` is 0 and the whole plan is mirrored. ``plan`` itself where
    ``low`` is not a multiple of ``placement.ALIGN`` or reaches the top."""
    step, offsets = plan.step, plan.offsets
    keep, ends = step.planned, plan.offsets + step.nbytes
    fixed = np.asarray(fixed, np.int64)
    low = int((fixed[:, 0] + fixed[:, 1]).max()) if fixed.size else 0
    if pinned is not None:
        stay = keep & (np.asarray(pinned, np.int64) >= 0)
        low = max(low, int(ends[stay].max(initial=0)))
    while True:
        straddle = keep & (offsets < low) & (ends > low)
        if not straddle.any():
            break
        low = int(ends[straddle].max())
    top = -(-plan.nbytes // placement.ALIGN) * placement.ALIGN
    if low % placement.ALIGN or low >= top:
        return plan
    return _moved(plan, np.where(keep & (offsets >= low), top + low - ends, offsets))


def shifted(plan, nbytes):
    """``plan`` with every planned request's offset ``nbytes`` higher."""
    return _moved(plan, plan.offsets + nbytes)
