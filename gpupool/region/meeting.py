"""Which places of a plan (gpupool.region.placement.Plan) blocks in its range meet: the blocks
an entry finds there when it starts (the blocks that stay, those the entry before left live),
in space alone or in space and time. The planned region (gpupool.region.planned) asks before it
installs a plan: whether its steady plan serves as it is, and which of its places a transition
must move. NumPy; no device.
"""

import numpy as np

__all__ = ["meeting", "meets"]


def meets(plan, blocks):
    """Whether any of ``blocks`` ((offset, bytes) rows, offsets from the plan's base) meets a
    place of ``plan`` in space, whenever either lives."""
    keep = plan.step.planned
    lo = plan.offsets[keep]
    if not len(lo) or not len(blocks):
        return False
    hi = lo + plan.step.nbytes[keep]
    order = np.argsort(lo)
    lo, reach = lo[order], np.maximum.accumulate(hi[order])
    # A block [a, b) meets a place when some place starting below b reaches past a.
    k = np.searchsorted(lo, blocks[:, 0] + blocks[:, 1], side="left")
    return bool(((k > 0) & (reach[np.maximum(k - 1, 0)] > blocks[:, 0])).any())


def _runs(first, last):
    """The indices ``first[i]`` to ``last[i] - 1`` of every i, one after the other, and the i
    each belongs to (int64 arrays; a run with ``last <= first`` is empty)."""
    counts = np.maximum(last - first, 0)
    owner = np.repeat(np.arange(len(first)), counts)
    start = np.cumsum(counts) - counts
    return first[owner] + np.arange(int(counts.sum())) - start[owner], owner


def meeting(plan, offset, nbytes, end):
    """Which places of ``plan`` blocks in its range meet in space while both live.

    Parameters
    ----------
    plan : placement.Plan
        Its places live from their request's allocation to its free (event indices of the
        plan's step; a tail past the step's length).
    offset, nbytes, end : array-like of int
        One entry per block: its offset from the plan's base and its bytes, and the event of
        the entry before which it is freed (the int64 most: it stays throughout). A block
        lives from the entry's start; blocks of no bytes meet nothing.

    Returns
    -------
    numpy.ndarray of bool
        One entry per request of the plan's step: its place meets a block (False for a request
        the plan does not place).

    Notes
    -----
    Output-sensitive: the pairs of a place and a block that share bytes are listed (those where
    the place starts inside the block, then those where the block starts inside the place, the
    two cases of two ranges that share bytes), then kept where the place is allocated before
    the block is freed.
    """
    step = plan.step
    met = np.zeros(len(step), bool)
    offset, nbytes, end = (np.asarray(a, np.int64).reshape(-1) for a in (offset, nbytes, end))
    if not (len(offset) == len(nbytes) == len(end)):
        raise ValueError("offset, nbytes and end must have the same length")
    some = nbytes > 0
    a, b, end = offset[some], offset[some] + nbytes[some], end[some]
    idx = np.flatnonzero(step.planned)
    if not len(idx) or not len(a):
        return met
    lo = plan.offsets[idx]
    hi = lo + step.nbytes[idx]
    by_lo = np.argsort(lo, kind="stable")
    places, blocks = _runs(np.searchsorted(lo[by_lo], a, side="left"),
                           np.searchsorted(lo[by_lo], b, side="left"))
    places = by_lo[places]                      # a place starting in [a, b)
    by_a = np.argsort(a, kind="stable")
    inside, owner = _runs(np.searchsorted(a[by_a], lo, side="right"),
                          np.searchsorted(a[by_a], hi, side="left"))
    places = np.concatenate([places, owner])    # a block starting in (lo, hi)
    blocks = np.concatenate([blocks, by_a[inside]])
    alive = step.alloc[idx[places]] < end[blocks]
    met[idx[places[alive]]] = True
    return met
