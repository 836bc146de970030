"""The planner's compiled loops as NumPy code, the references they must match: the greedy
placement with an n-by-n lifetime mask (gpupool.region.greedy) and a plan's anchors
(gpupool.region.anchors)."""

import numpy as np

from gpupool.region.placement import _order, overlaps


def busy_mask(starts, ends, streams, period, share_streams):
    """Which requests are busy with which: live at once (across the period too) or, unless
    ``share_streams``, of different streams."""
    busy_with = overlaps(starts[:, None], ends[:, None], starts[None, :], ends[None, :], period)
    if not share_streams:
        busy_with |= streams[:, None] != streams[None, :]
    return busy_with


def greedy(sizes, starts, ends, busy_with, order_key, fit, fixed, pinned):
    """Offsets by one greedy strategy. ``fixed``: (offsets, ends, first event, last event + 1)
    of bytes taken for a while; ``pinned``: each request's given offset, -1 where the
    strategy places it."""
    order = _order(sizes, starts, ends, order_key)
    done = pinned >= 0
    offsets = np.where(done, pinned, 0)
    order = order[~done[order]]
    for i in order:
        busy = done & busy_with[i]
        now = (fixed[2] < ends[i]) & (starts[i] < fixed[3])
        lo = np.concatenate((offsets[busy], fixed[0][now]))
        hi = np.concatenate((offsets[busy] + sizes[busy], fixed[1][now]))
        at = 0
        if len(lo):
            by_lo = np.argsort(lo, kind="stable")
            lo, reach = lo[by_lo], np.maximum.accumulate(hi[by_lo])
            before = np.concatenate(([0], reach[:-1]))
            gaps = lo - before
            fits = np.flatnonzero(gaps >= sizes[i])
            if not len(fits):
                at = int(reach[-1])
            elif fit == "first":
                at = int(before[fits[0]])
            else:
                at = int(before[fits[np.argmin(gaps[fits])]])
        offsets[i] = at
        done[i] = True
    return offsets


def anchors(plan):
    """For each planned request k, the request allocated before k, live at k's allocation,
    whose end is the largest at or below k's offset (the first of equal ends); -1 if none."""
    step, off = plan.step, plan.offsets
    ends = off + step.nbytes
    out = np.full(len(step), -1, np.int64)
    planned = step.planned
    for k in np.flatnonzero(planned):
        cand = np.flatnonzero(planned[:k] & (step.free[:k] > step.alloc[k]) &
                              (ends[:k] <= off[k]))
        if len(cand):
            out[k] = cand[np.argmax(ends[cand])]
    return out
