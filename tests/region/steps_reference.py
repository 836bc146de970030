"""The Python loops that made a planned region's steps before its bookkeeping was compiled
(gpupool.region.steps, called by gpupool.region.recorded), and the NumPy scan ``tails.freed_first`` ran before: the references
tests/region/test_steps.py compares the compiled ones with."""

import numpy as np

from gpupool.region import placement


def freed_first(events, ptr):
    """Whether the last entry of ``events`` (rows of ptr, nbytes, stream) freed every pointer
    of ``ptr`` before its first allocation, as ``tails.freed_first`` scanned all the events
    kept for it: every marker found, the pointers' membership by ``np.isin``."""
    events = np.asarray(events, np.int64).reshape(-1, 3)
    ptr = np.asarray(ptr, np.int64).reshape(-1)
    marks = np.flatnonzero(events[:, 0] == 0)
    if not len(ptr) or not len(marks):
        return False
    last = events[marks[-1] + 1:]
    allocs = np.flatnonzero(last[:, 1] > 0)
    before = last[:allocs[0] if len(allocs) else len(last)]
    return bool(np.isin(ptr, before[before[:, 1] == 0, 0]).all())


def complete_step(events):
    """(events kept, step or None, carried) of the event list ``events`` (rows of ptr,
    nbytes, stream; ptr 0 where an entry starts), as the planner made them:
    the step of the entry before the last one, its tails' frees looked up in the last one;
    the events before it dropped; carried, the last entry's live blocks, k -> (ptr, bytes),
    a dict in its order."""
    events = list(events)
    starts = [i for i, e in enumerate(events) if e[0] == 0]
    index, count = {}, 0            # the last entry's live blocks: ptr -> (k, bytes)
    for ptr, nbytes, _ in events[starts[-1] + 1:] if starts else ():
        if nbytes:
            index[ptr] = (count, nbytes)
            count += 1
        else:
            index.pop(ptr, None)
    carried = {k: (ptr, n) for ptr, (k, n) in index.items()}
    if len(starts) < 2:
        return events, None, carried
    lo, hi = starts[-2], starts[-1]
    del events[:lo]
    hi -= lo
    trace, ids, mid = [], {}, None
    for t, (ptr, nbytes, stream) in enumerate(events):
        if ptr == 0:
            if t == hi:
                mid = len(trace)
            continue
        if nbytes:
            ids[ptr] = len(trace)
            trace.append((0, len(trace), nbytes, stream))
        else:
            trace.append((1, ids.pop(ptr, -1), 0, 0))
    end = len(trace)
    return events, placement.record_step(trace, 0, mid, end) if mid else None, carried
