"""The first-fit plan: the placement a planned region falls back to past the greedy
strategies' limits (``placement.plan``'s ``fallback``): cheap, and valid for any step. Pure
NumPy and Python; ``step`` is a ``placement.Step``."""

import numpy as np

__all__ = ["first_fit"]


def first_fit(step, keep):
    """Cheap offsets (int64 bytes from the range's base; -1 where ``keep``, a bool mask of
    ``step``'s requests, is False): each stream's in-step requests first fit in the order of
    their events (a sweep over one free list), the streams' ranges one above the other, and
    the tails stacked above all (every tail lives across the boundary, so they rarely
    share)."""
    offsets = np.full(len(step), -1, np.int64)
    inside = keep & ~step.tails
    base = 0
    for stream in np.unique(step.stream[inside]):
        mine = np.flatnonzero(inside & (step.stream == stream))
        times = np.concatenate([step.alloc[mine], step.free[mine]])
        which = np.concatenate([mine, -1 - mine])
        gaps, top = [], 0                       # free (offset, size) below top, by offset
        for k in which[np.argsort(times, kind="stable")]:
            if k >= 0:
                size = int(step.nbytes[k])
                g = next((g for g, (_, gsize) in enumerate(gaps) if gsize >= size), None)
                if g is None and gaps and sum(gaps[-1]) == top:
                    at = gaps.pop()[0]          # the last free run reaches the top: extend it
                    offsets[k], top = at, at + size
                elif g is None:
                    offsets[k], top = top, top + size
                else:
                    at, gsize = gaps[g]
                    offsets[k] = at
                    gaps[g:g + 1] = [(at + size, gsize - size)] if gsize > size else []
            else:
                k = -1 - k
                _give_back(gaps, int(offsets[k]), int(step.nbytes[k]))
        offsets[mine] += base
        base += top
    tails = np.flatnonzero(keep & step.tails)
    offsets[tails] = base + np.concatenate(([0], np.cumsum(step.nbytes[tails])[:-1]))
    return offsets


def _give_back(gaps, at, size):
    """Insert the free run [at, at + size) into ``gaps``, joining its neighbours."""
    g = next((g for g, (o, _) in enumerate(gaps) if o > at), len(gaps))
    if g < len(gaps) and at + size == gaps[g][0]:
        size += gaps.pop(g)[1]
    if g and gaps[g - 1][0] + gaps[g - 1][1] == at:
        g -= 1
        at, size = gaps[g][0], gaps.pop(g)[1] + size
    gaps.insert(g, (at, size))
