# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""A planned region's recorded events made into its last complete step, compiled
(``Planner._complete_step`` calls it at every exit).

The core records a planned region's allocations and frees in order, as rows (ptr, bytes,
stream): bytes 0 is a free, ptr 0 a marker where an entry starts. At an exit this reads them
in one pass, pointers matched through hash maps:

* the last entry's blocks live at its end (after the last marker): each block's request
  number in that entry (its allocations counted from 0, the latest allocation of a pointer
  allocated again while live), its pointer and bytes, in the order a Python dict keyed by
  pointer would hold them (a pointer freed and allocated again moves to the end; one
  allocated again while live keeps its place);
* the step between the last two markers, its frees looked up until the end of the events:
  each allocation in it is a request (its bytes as recorded, its stream, its event: its
  position among the allocations and frees from the step's start, markers not counted), and
  a free of the pointer of request k is request k's free when it comes before the next
  entry's allocation k (a free of a pointer allocated again since frees the later one).

The results are the same as those of the Python loops this replaces (dict-matched pointers,
then ``placement.record_step``): a Hypothesis test compares them on random event lists
(tests/region/test_steps.py against tests/region/steps_reference.py). The core runs without
the GIL. Measurements: Note [Planner bookkeeping] in docs/design.md.
"""
from cython.operator cimport dereference as deref, preincrement as inc
from libc.stdint cimport int64_t
from libcpp.algorithm cimport sort
from libcpp.pair cimport pair
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

import numpy as np

cdef struct live_t:
    int64_t k           # the block's request number in the entry
    int64_t nbytes      # its bytes
    int64_t since       # the event its pointer was put in the map at (its place in order)


cdef void _carried(const int64_t[:, ::1] ev, Py_ssize_t first,
                   vector[pair[int64_t, int64_t]]* order,
                   unordered_map[int64_t, live_t]* live) noexcept nogil:
    """The blocks live at the end of ev[first:]: live maps pointer -> live_t; order gets
    (since, pointer) of each, sorted (the dict's order)."""
    cdef Py_ssize_t t
    cdef int64_t count = 0, ptr
    cdef unordered_map[int64_t, live_t].iterator at
    cdef live_t block
    for t in range(first, ev.shape[0]):
        ptr = ev[t, 0]
        if ev[t, 1]:
            at = live.find(ptr)
            if at == live.end():
                block.k, block.nbytes, block.since = count, ev[t, 1], t
                live[0][ptr] = block
            else:
                deref(at).second.k, deref(at).second.nbytes = count, ev[t, 1]
            count += 1
        else:
            live.erase(ptr)
    order.reserve(live.size())
    at = live.begin()
    while at != live.end():
        order.push_back(pair[int64_t, int64_t](deref(at).second.since, deref(at).first))
        inc(at)
    sort(order.begin(), order.end())


cdef int64_t _step(const int64_t[:, ::1] ev, Py_ssize_t lo, Py_ssize_t hi,
                   int64_t[:, ::1] out) noexcept nogil:
    """The step of ev[lo:hi] (lo, hi: markers), its frees looked up to ev's end: per request
    (nbytes, alloc, free, stream) in out's rows (free -1: escaped). Returns the requests'
    number; out.shape[0] >= their number."""
    cdef Py_ssize_t t
    cdef int64_t pos = 0, mid = -1, n = 0, ptr, k
    cdef unordered_map[int64_t, int64_t] ids            # live pointer -> its event
    cdef vector[int64_t] request                        # event -> request (-1: none)
    cdef unordered_map[int64_t, int64_t].iterator at
    request.assign(ev.shape[0] - lo, -1)
    for t in range(lo, ev.shape[0]):
        ptr = ev[t, 0]
        if ptr == 0:
            if t == hi:
                mid = pos
            continue
        if ev[t, 1]:
            ids[ptr] = pos
            if mid < 0:
                request[pos] = n
                out[n, 0], out[n, 1], out[n, 2], out[n, 3] = ev[t, 1], pos, -1, ev[t, 2]
                n += 1
        else:
            at = ids.find(ptr)
            if at != ids.end():
                k = request[deref(at).second]
                ids.erase(at)
                if k >= 0 and (mid < 0 or pos < mid + out[k, 1]):
                    out[k, 2] = pos
        pos += 1
    return n


def complete(const int64_t[:, ::1] events):
    """The recorded events (rows of ptr, bytes, stream) made into their last complete step.

    Parameters
    ----------
    events : numpy.ndarray of int64, shape (n, 3), C-contiguous
        Allocations (bytes > 0), frees (bytes 0) and entry markers (ptr 0), in order.

    Returns
    -------
    (lo, step, carried)
        lo: the first event of the step (the events before it are no longer needed; 0 when
        there is no step). step: None before two markers or when the step has no events,
        else ``(nbytes, alloc, free, stream, length)`` as ``placement.Step`` takes them
        (int64 arrays; free ``placement.ESCAPED`` where the step and the next entry's
        events before its own allocation do not free it; bytes as recorded, not rounded).
        carried: ``(k, ptr, nbytes)`` int64 arrays of the blocks live after the last marker
        (none without one), in the order described in the module's docstring.

    Raises
    ------
    ValueError
        ``events`` is not of 3 columns.
    """
    if events.shape[1] != 3:
        raise ValueError(f"events must have 3 columns (ptr, bytes, stream), got "
                         f"{events.shape[1]}")
    cdef Py_ssize_t n = events.shape[0], t, lo = -1, hi = -1, i
    cdef vector[pair[int64_t, int64_t]] order
    cdef unordered_map[int64_t, live_t] live
    cdef int64_t count = 0, length = 0
    for t in range(n):
        if events[t, 0] == 0:
            lo, hi = hi, t
    if hi >= 0:
        with nogil:
            _carried(events, hi + 1, &order, &live)
    carried = np.empty((3, order.size()), np.int64)
    cdef int64_t[:, ::1] c = carried
    for i in range(<Py_ssize_t>order.size()):
        c[0, i], c[1, i], c[2, i] = live[order[i].second].k, order[i].second, \
            live[order[i].second].nbytes
    if lo < 0:
        return 0, None, tuple(carried)
    rows = np.empty((hi - lo, 4), np.int64)
    cdef int64_t[:, ::1] out = rows
    with nogil:
        count = _step(events, lo, hi, out)
        for t in range(lo, hi):
            length += events[t, 0] != 0
    if not length:
        return lo, None, tuple(carried)
    rows = rows[:count]
    return lo, (rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], length), tuple(carried)
