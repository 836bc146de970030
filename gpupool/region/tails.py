"""The blocks a planned region's last entry left live, as the plan of its next entry sees them:
until which event of that entry each stays (gpupool.region.planned asks before it installs a
plan, and when it places one around them).

Two rules tell when the next entry frees such a block:

* *by request*: a block of the last entry's request k is the plan's step's tail k (freed by
  the next entry at its event ``free[k] - length``) when the step's request k is a tail no
  smaller. This holds when the last entry has the step's structure; of another structure, its
  request k is another block.
* *at the start*: every block is freed before the entry's first allocation, when the last entry
  freed, before its own first allocation, every block the entry before it left live (or that
  one left none), and the step begins with at least as many frees as there are blocks (those
  can only be of blocks carried into it). This is a training step that frees the last step's
  gradients first, whatever the structures of the two steps (Note [Tails freed at the start]).

A block neither rule covers stays throughout the entry. A rule's prediction that does not hold
costs no correctness: the core takes a place only where its bytes are free, so a place on a
block still live is a miss served the online way.

NumPy, the scan of :func:`freed_first` compiled (gpupool.region.steps); no device.
"""

import numpy as np

from gpupool.region import steps as _steps
from gpupool.region.placement import ALIGN

__all__ = ["fixed_rows", "freed_first", "left_live"]

FOREVER = np.iinfo(np.int64).max    # the end of a block that stays throughout the entry


def freed_first(events, ptr):
    """Whether the last entry of ``events`` freed every pointer of ``ptr`` before its first
    allocation.

    Parameters
    ----------
    events : numpy.ndarray of int64, shape (n, 3)
        A planned region's recorded rows (ptr, bytes, stream): bytes 0 a free, ptr 0 where an
        entry starts; the last entry's rows are those after the last marker.
    ptr : array-like of int
        The pointers of the blocks the entry before the last one left live.

    Returns
    -------
    bool
        False when ``ptr`` is empty or ``events`` has no marker.

    Notes
    -----
    Compiled (``steps.freed_first``): it finds the last marker from the end and reads only
    the frees before the last entry's first allocation, so its cost is theirs, not the
    events kept's (Note [Step time of planned regions]).
    """
    return _steps.freed_first(np.ascontiguousarray(np.asarray(events, np.int64).reshape(-1, 3)),
                              np.ascontiguousarray(np.asarray(ptr, np.int64).reshape(-1)))


def left_live(step, carried, base, at_start):
    """The blocks the last entry left live, for a plan of ``step`` made at ``base``.

    Parameters
    ----------
    step : placement.Step
        The plan's step: the structure the next entry is served by.
    carried : tuple of three int64 arrays
        The blocks' request numbers in the last entry, pointers and bytes (``steps.complete``).
    base : int
        The address the plan's offsets are from.
    at_start : bool
        The last entry freed, before its first allocation, every block the entry before it
        left live (:func:`freed_first`), or that entry left none.

    Returns
    -------
    (offset, nbytes, end, tail) : four numpy.ndarray
        Each block's offset from ``base`` and bytes; the event of the next entry before which
        it is freed (:data:`FOREVER`: it stays throughout), by the module's rules, the
        earlier where both give one; and whether it is the step's tail of its request number.
    """
    k, ptr, nbytes = (np.asarray(a, np.int64) for a in carried)
    inside = k < len(step)
    tail = np.zeros(len(k), bool)
    tail[inside] = step.tails[k[inside]] & (step.nbytes[k[inside]] >= nbytes[inside])
    end = np.full(len(k), FOREVER)
    end[tail] = step.free[k[tail]] - step.length
    if at_start and len(step) and len(k) <= int(step.alloc[0]):
        end = np.minimum(end, int(step.alloc[0]))
    return ptr - base, nbytes, end, tail


def fixed_rows(step, carried, base, obstacles, at_start, freed=None):
    """``placement.plan``'s fixed rows (offset, bytes, from, until) for a plan of ``step`` made
    at ``base``: the ``obstacles`` ((offset from base, bytes) rows) throughout, and the blocks
    the last entry left live at or above ``base`` until :func:`left_live`'s ends. ``freed``,
    (offset from base, bytes asked, until), is a block among the obstacles (its bytes rounded
    up to ``placement.ALIGN``; the pool rounds no less) that stays only until that event of the
    entry: a record step's request 0, freed in the step. An int64 array of shape (m, 4)."""
    offset, nbytes, end, _ = (a[np.asarray(carried[1], np.int64) >= base]
                              for a in left_live(step, carried, base, at_start))
    obstacles = np.asarray(obstacles, np.int64).reshape(-1, 2)
    spans = [np.column_stack([offset, nbytes, np.zeros(len(offset), np.int64), end])]
    if freed is not None:
        lo, hi = freed[0], freed[0] + -(-freed[1] // ALIGN) * ALIGN
        ends = obstacles[:, 0] + obstacles[:, 1]
        cut = (obstacles[:, 0] < hi) & (lo < ends)      # the rows meeting the span: trimmed
        obstacles = np.concatenate([
            obstacles[~cut],
            np.column_stack([obstacles[cut, 0], np.minimum(ends[cut], lo) - obstacles[cut, 0]]),
            np.column_stack([np.maximum(obstacles[cut, 0], hi), ends[cut] - np.maximum(
                obstacles[cut, 0], hi)])]).reshape(-1, 2)
        obstacles = obstacles[obstacles[:, 1] > 0]
        spans.append(np.array([[lo, hi - lo, 0, freed[2]]], np.int64))
    return np.concatenate([
        np.column_stack([obstacles, np.zeros(len(obstacles), np.int64),
                         np.full(len(obstacles), FOREVER)]), *spans]
    ).astype(np.int64).reshape(-1, 4)
