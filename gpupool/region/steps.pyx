# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""A planned region's recorded events made into its last complete step, compiled
(``recorded.Recorded.read`` calls it at an exit), and the scan of the last entry's first
frees behind ``tails.freed_first``.

The core records a planned region's allocations and frees in order, as rows (ptr, bytes,
stream): bytes 0 is a free, ptr 0 a marker where an entry starts. At an exit this reads them
from the last two markers (found from the end), pointers numbered densely through an
open-addressed hash table, then matched by number:

* the last entry's blocks live at its end (after the last marker): each block's request
  number in that entry (its allocations counted from 0, the latest allocation of a pointer
  allocated again while live), its pointer and bytes, in the order a Python dict keyed by
  pointer would hold them (a pointer freed and allocated again moves to the end; one
  allocated again while live keeps its place);
* the step between the last two markers, its frees looked up until the end of the events:
  each allocation in it is a request (its bytes as recorded, its stream, its event: its
  position among the allocations and frees from the step's start, markers not counted), and
  a free of the pointer of request k is request k's free when it comes before the next
  entry's allocation k or before its first allocation (a free of a pointer allocated again
  since frees the later one).

The results are the same as those of the Python loops this replaces (dict-matched pointers,
then ``placement.record_step``): a Hypothesis test compares them on random event lists
(tests/region/test_steps.py against tests/region/steps_reference.py). The core runs without
the GIL. Measurements: Note [Planner bookkeeping] in docs/design.md.
"""
from libc.stdint cimport int64_t, uint64_t
from libcpp.algorithm cimport binary_search, sort
from libcpp.pair cimport pair
from libcpp.vector cimport vector

import numpy as np

cdef uint64_t GOLDEN = 0x9E3779B97F4A7C15ULL     # Fibonacci hashing's multiplier (2**64 / phi)


cdef struct slot_t:
    int64_t ptr         # the pointer (0: an empty slot; no block is at address 0)
    int64_t number      # its number


cdef void _rehash(vector[slot_t]* table, const vector[int64_t]* ptrs, int shift) noexcept nogil:
    """``table`` made 2**(64 - shift) empty slots, then each number i of ``ptrs`` put at its
    pointer's slot: the first empty one from its Fibonacci hash on."""
    cdef uint64_t mask = (<uint64_t>1 << (64 - shift)) - 1, h
    cdef size_t i
    cdef slot_t empty
    empty.ptr, empty.number = 0, -1
    table.assign(mask + 1, empty)
    for i in range(ptrs.size()):
        h = (<uint64_t>ptrs[0][i] * GOLDEN) >> shift
        while table[0][h].ptr != 0:
            h = (h + 1) & mask
        table[0][h].ptr, table[0][h].number = ptrs[0][i], i


cdef Py_ssize_t _intern(const int64_t[:, ::1] ev, Py_ssize_t first, vector[int64_t]* ids,
                        vector[int64_t]* ptrs) noexcept nogil:
    """Each pointer of ev[first:] numbered densely, in the order first seen: ids[t - first] is
    row t's number (-1: a marker, ptr 0), ptrs[i] number i's pointer. Returns the numbers'
    count. An open-addressed table of the pointers and their numbers, probed linearly from the
    pointer's Fibonacci hash, doubled whenever more than half full (a step has far fewer
    pointers than events: each is allocated and freed again)."""
    cdef Py_ssize_t t, rows = ev.shape[0] - first
    cdef int shift = 54                     # 1024 slots to begin with
    cdef uint64_t mask = (<uint64_t>1 << (64 - shift)) - 1, h
    cdef int64_t ptr, number
    cdef vector[slot_t] table
    _rehash(&table, ptrs, shift)
    ids.resize(rows)
    cdef int64_t* out = ids.data()
    cdef slot_t* slots = table.data()
    for t in range(first, ev.shape[0]):
        ptr = ev[t, 0]
        if ptr == 0:
            out[t - first] = -1
            continue
        h = (<uint64_t>ptr * GOLDEN) >> shift
        while slots[h].ptr != ptr and slots[h].ptr != 0:
            h = (h + 1) & mask
        number = slots[h].number
        if number < 0:
            number = ptrs.size()
            slots[h].ptr, slots[h].number = ptr, number
            ptrs.push_back(ptr)
            if 2 * ptrs.size() > mask + 1:
                shift -= 1
                mask = 2 * mask + 1
                _rehash(&table, ptrs, shift)
                slots = table.data()
        out[t - first] = number
    return ptrs.size()


cdef void _carried(const int64_t[:, ::1] ev, Py_ssize_t first, const int64_t* ids,
                   Py_ssize_t d, vector[pair[int64_t, int64_t]]* order,
                   vector[int64_t]* k, vector[int64_t]* nbytes) noexcept nogil:
    """The blocks live at the end of ev[first:] (ids: its rows' pointer numbers, d of them):
    k and nbytes get each pointer number's request number in that entry and bytes; order gets
    (since, number) of each live one, sorted (the dict's order: since, the event its pointer
    was last allocated at while not live)."""
    cdef Py_ssize_t t
    cdef int64_t count = 0, i
    cdef vector[int64_t] since                  # per number: -1 while not live
    since.assign(d, -1)
    k.resize(d)
    nbytes.resize(d)
    for t in range(first, ev.shape[0]):
        i = ids[t - first]
        if ev[t, 1]:
            if since[i] < 0:
                since[i] = t
            k[0][i], nbytes[0][i] = count, ev[t, 1]
            count += 1
        else:
            since[i] = -1
    for i in range(d):
        if since[i] >= 0:
            order.push_back(pair[int64_t, int64_t](since[i], i))
    sort(order.begin(), order.end())


cdef int64_t _step(const int64_t[:, ::1] ev, Py_ssize_t lo, Py_ssize_t hi, const int64_t* ids,
                   Py_ssize_t d, int64_t[:, ::1] out) noexcept nogil:
    """The step of ev[lo:hi] (lo, hi: markers), its frees looked up to ev's end (ids: the
    pointer numbers of ev[lo:]'s rows, d of them): per request (nbytes, alloc, free, stream)
    in out's rows (free -1: escaped). Returns the requests' number; out.shape[0] >= their
    number."""
    cdef Py_ssize_t t
    cdef int64_t pos = 0, mid = -1, n = 0, k, i
    cdef bint begun = False                             # the next entry has allocated
    cdef vector[int64_t] at                             # number -> its live event (-1: none)
    cdef vector[int64_t] request                        # event -> request (-1: none)
    at.assign(d, -1)
    request.assign(ev.shape[0] - lo, -1)
    for t in range(lo, ev.shape[0]):
        i = ids[t - lo]
        if i < 0:
            if t == hi:
                mid = pos
            continue
        if ev[t, 1]:
            at[i] = pos
            begun = mid >= 0
            if mid < 0:
                request[pos] = n
                out[n, 0], out[n, 1], out[n, 2], out[n, 3] = ev[t, 1], pos, -1, ev[t, 2]
                n += 1
        elif at[i] >= 0:
            k = request[at[i]]
            at[i] = -1
            if k >= 0 and (mid < 0 or pos < mid + out[k, 1] or not begun):
                out[k, 2] = pos
        pos += 1
    return n


cdef int _check_columns(const int64_t[:, ::1] events) except -1:
    """Raise ValueError unless ``events`` has 3 columns (ptr, bytes, stream)."""
    if events.shape[1] != 3:
        raise ValueError(f"events must have 3 columns (ptr, bytes, stream), got "
                         f"{events.shape[1]}")
    return 0


def freed_first(const int64_t[:, ::1] events, const int64_t[::1] ptr):
    """Whether the last entry of ``events`` (the rows after the last marker, found from the
    end) freed every pointer of ``ptr`` before its first allocation: ``tails.freed_first``'s
    scan, which reads only the last entry's frees before its first allocation.

    Parameters
    ----------
    events : numpy.ndarray of int64, shape (n, 3), C-contiguous
        Allocations (bytes > 0), frees (bytes 0) and entry markers (ptr 0), in order.
    ptr : numpy.ndarray of int64, shape (m,), contiguous
        The pointers asked about.

    Returns
    -------
    bool
        False when ``ptr`` is empty or ``events`` has no marker.

    Raises
    ------
    ValueError
        ``events`` is not of 3 columns.
    """
    _check_columns(events)
    cdef Py_ssize_t t = events.shape[0] - 1, i
    cdef vector[int64_t] freed
    cdef bint every = ptr.shape[0] > 0
    with nogil:
        while t >= 0 and events[t, 0] != 0:
            t -= 1
        every = every and t >= 0
        t += 1
        while every and t < events.shape[0] and events[t, 1] <= 0:
            if events[t, 1] == 0:
                freed.push_back(events[t, 0])
            t += 1
        sort(freed.begin(), freed.end())
        for i in range(ptr.shape[0] if every else 0):
            if not binary_search(freed.begin(), freed.end(), ptr[i]):
                every = False
                break
    return every


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
        (int64 arrays; free ``placement.ESCAPED`` where neither the step nor the next
        entry's events before its own allocation, or before its first, free it; bytes as
        recorded, not rounded).
        carried: ``(k, ptr, nbytes)`` int64 arrays of the blocks live after the last marker
        (none without one), in the order described in the module's docstring.

    Raises
    ------
    ValueError
        ``events`` is not of 3 columns.
    """
    _check_columns(events)
    cdef Py_ssize_t t = events.shape[0] - 1, lo = -1, hi = -1, i, d = 0
    cdef vector[pair[int64_t, int64_t]] order
    cdef vector[int64_t] ids, ptrs, k, nbytes
    cdef int64_t count = 0
    while t >= 0 and lo < 0:                # the last two markers, found from the end
        if events[t, 0] == 0 and hi < 0:
            hi = t
        elif events[t, 0] == 0:
            lo = t
        t -= 1
    if hi >= 0:
        with nogil:
            d = _intern(events, lo if lo >= 0 else hi + 1, &ids, &ptrs)
            _carried(events, hi + 1, ids.data() + (hi + 1 - lo if lo >= 0 else 0), d, &order, &k,
                     &nbytes)
    carried = np.empty((3, order.size()), np.int64)
    cdef int64_t[:, ::1] c = carried
    for i in range(<Py_ssize_t>order.size()):
        c[0, i], c[1, i], c[2, i] = k[order[i].second], ptrs[order[i].second], \
            nbytes[order[i].second]
    if lo < 0:
        return 0, None, tuple(carried)
    if hi == lo + 1:                        # an entry without events
        return lo, None, tuple(carried)
    rows = np.empty((hi - lo, 4), np.int64)
    cdef int64_t[:, ::1] out = rows
    with nogil:
        count = _step(events, lo, hi, ids.data(), d, out)
    rows = rows[:count]
    return lo, (rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], hi - lo - 1), tuple(carried)

