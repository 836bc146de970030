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


def scan_work(sizes, starts, ends, streams, period, share_streams, order, fit, fixed, pinned):
    """The compiled greedy's offsets and work by its definition: each placement scans the
    placed requests by (offset, index) and the fixed ranges by offset (stably), merged (a
    placed one before a fixed one at its offset); the work counts every fixed range read and
    the placed requests up to the last one read in the way, or all of them when the scan reads
    to their end (no index by time, every placed request scanned)."""
    busy_with = busy_mask(starts, ends, streams, period, share_streams)
    by_lo = np.argsort(fixed[0], kind="stable")
    f_lo, f_hi, f_first, f_end = (np.asarray(x)[by_lo] for x in fixed)
    offsets = np.where(pinned >= 0, pinned, 0)
    placed = [(int(offsets[i]), i) for i in range(len(sizes)) if pinned[i] >= 0]
    placed.sort()
    work = 0
    for i in order:
        if pinned[i] >= 0:
            continue
        size = int(sizes[i])
        ways = [k for k, (_, j) in enumerate(placed) if busy_with[i, j]]
        now = [f for f in range(len(f_lo)) if f_first[f] < ends[i] and starts[i] < f_end[f]]
        taken = sorted([(placed[k][0], 0, k) for k in ways] + [(int(f_lo[f]), 1, f) for f in now])
        reach, any_seen, at, best_gap, stop = 0, False, None, 0, None
        for t, (lo, kind, k) in enumerate(taken):
            hi = lo + int(sizes[placed[k][1]]) if kind == 0 else int(f_hi[k])
            before = reach if any_seen else 0
            if lo - before >= size and (at is None or lo - before < best_gap):
                at, best_gap = before, lo - before
                if fit == "first":
                    stop = t
                    break
            reach = hi if not any_seen or hi > reach else reach
            any_seen = True
        offsets[i] = at if at is not None else reach
        # Fixed ranges read: those passed up to the one in the way next (or all of them).
        nxt = [f for f in now if stop is not None and taken[stop] < (int(f_lo[f]), 1, f)]
        fixed_read = len(f_lo) if not nxt else min(nxt) + 1
        if stop is not None and taken[stop][1] == 1:
            fixed_read = taken[stop][2] + 1
        # Placed requests read: up to the next one in the way past the stop (read ahead), or
        # the one it stopped at, or all of them when no request in the way is left.
        later = [k for k in ways if stop is None or (placed[k][0], 0, k) > taken[stop][:3]]
        if stop is not None and taken[stop][1] == 0:
            placed_read = taken[stop][2] + 1
        elif stop is not None and later:
            placed_read = min(later) + 1
        else:
            placed_read = len(placed)
        work += fixed_read + placed_read
        placed.append((int(offsets[i]), int(i)))
        placed.sort()
    return offsets, work
