# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The planner's greedy placement, compiled (``placement._greedy`` calls it).

Requests are placed one at a time in a given order, each at the lowest offset (``first``) or
in the smallest gap (``best``) free of the requests placed before it that are busy with it
(live at the same event of the step, or of the next entry across the period; or on another
stream when streams do not share bytes) and of the fixed ranges taken while it lives. No
n-by-n mask: "busy with" is computed from the lifetimes as the placed requests are scanned,
in the order of their offsets, so the gaps come out in address order as they are scanned.

The placement is the same, offset for offset, as the NumPy loop it replaces: the placed
requests and the fixed ranges taken are ordered by (offset, then placed before fixed, each by
index), the gap before the first is measured from 0, the gap before each later one from the
highest end so far, and with no gap wide enough the request goes at that highest end (0 when
nothing is taken).

The work is the number of placed requests compared with the one being placed (each fixed
range compared counts as one too): the core stops past ``work_limit`` of it, or past
``budget_ns`` of wall-clock time (steady clock, checked every 64 placements), and says which.
The core runs without the GIL. Measurements: Note [Compiled greedy placement] in docs/design.md.
"""
from libc.stdint cimport int64_t
from libcpp.algorithm cimport lower_bound
from libcpp.pair cimport pair
from libcpp.vector cimport vector

import numpy as np

cdef extern from *:
    """
    #include <chrono>
    static inline long long gp_greedy_now_ns(void) {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(
            std::chrono::steady_clock::now().time_since_epoch()).count();
    }
    """
    long long gp_greedy_now_ns() nogil

cdef enum:
    _DONE = 0           # every request placed
    _PAST_WORK = 1      # stopped past the work limit
    _PAST_TIME = 2      # stopped past the time budget

DONE, PAST_WORK, PAST_TIME = _DONE, _PAST_WORK, _PAST_TIME

ctypedef pair[int64_t, int64_t] placed_t      # (offset, index) of a placed request


cdef inline bint _busy(int64_t sa, int64_t ea, int64_t sb, int64_t eb, int64_t period) \
        noexcept nogil:
    """Whether [sa, ea) and [sb, eb) share an event, in one entry or across the boundary
    (placement.overlaps with a period)."""
    return ((sa < eb and sb < ea) or (sa < eb - period and sb - period < ea) or
            (sa - period < eb and sb < ea - period))


cdef int _place(const int64_t[::1] sizes, const int64_t[::1] starts, const int64_t[::1] ends,
                const int64_t[::1] streams, int64_t period, bint share_streams,
                const int64_t[::1] order, bint best,
                const int64_t[::1] fixed_lo, const int64_t[::1] fixed_hi,
                const int64_t[::1] fixed_first, const int64_t[::1] fixed_end,
                const int64_t[::1] pinned, int64_t[::1] offsets,
                int64_t work_limit, int64_t budget_ns, int64_t* work) noexcept nogil:
    cdef Py_ssize_t n = sizes.shape[0], m = fixed_lo.shape[0]
    cdef Py_ssize_t count = 0, o, p, f
    cdef int64_t i, j, size, sa, ea, lo, hi, before, reach, at, gap, best_gap
    cdef bint any_seen, found, p_busy, f_busy
    cdef long long deadline = gp_greedy_now_ns() + budget_ns if budget_ns >= 0 else 0
    cdef vector[placed_t] placed           # by (offset, index)
    cdef vector[placed_t].iterator where
    placed.reserve(n)
    work[0] = 0
    for j in range(n):
        offsets[j] = pinned[j] if pinned[j] >= 0 else 0
        if pinned[j] >= 0:
            placed.insert(lower_bound(placed.begin(), placed.end(), placed_t(pinned[j], j)),
                          placed_t(pinned[j], j))
    for o in range(order.shape[0]):
        i = order[o]
        if pinned[i] >= 0:
            continue
        if count % 64 == 63 and budget_ns >= 0 and gp_greedy_now_ns() > deadline:
            return _PAST_TIME
        count += 1
        size, sa, ea = sizes[i], starts[i], ends[i]
        any_seen = found = False
        before = reach = at = best_gap = 0
        p = f = 0
        p_busy = f_busy = False         # placed[p], fixed f: already known to be in the way
        while True:
            # The next range taken while i lives, by (offset, placed before fixed).
            while not p_busy and p < <Py_ssize_t>placed.size():
                j = placed[p].second
                work[0] += 1
                p_busy = (not share_streams and streams[i] != streams[j]) or \
                    _busy(sa, ea, starts[j], ends[j], period)
                if not p_busy:
                    p += 1
            while not f_busy and f < m:
                work[0] += 1
                f_busy = fixed_first[f] < ea and sa < fixed_end[f]
                if not f_busy:
                    f += 1
            if p_busy and (not f_busy or placed[p].first <= fixed_lo[f]):
                lo, hi = placed[p].first, placed[p].first + sizes[placed[p].second]
                p += 1
                p_busy = False
            elif f_busy:
                lo, hi = fixed_lo[f], fixed_hi[f]
                f += 1
                f_busy = False
            else:
                break
            before = reach if any_seen else 0
            gap = lo - before
            if gap >= size and (not found or gap < best_gap):
                found, at, best_gap = True, before, gap
                if not best:
                    break
            reach = hi if not any_seen or hi > reach else reach
            any_seen = True
        offsets[i] = at if found else reach
        placed.insert(lower_bound(placed.begin(), placed.end(), placed_t(offsets[i], i)),
                      placed_t(offsets[i], i))
        if work_limit > 0 and work[0] > work_limit:
            return _PAST_WORK
    return _DONE


def place(sizes, starts, ends, streams, period, share_streams, order, fit, fixed, pinned,
          work_limit=0, budget_ns=-1):
    """Offsets of requests placed greedily in ``order``.

    Parameters
    ----------
    sizes, starts, ends : numpy.ndarray of int64
        Each request's bytes and lifetime ``[start, end)`` in events; an end past ``period``
        lives on in the next entry (its ``[0, end - period)``).
    streams : numpy.ndarray of int64
        Each request's stream key.
    period : int
        The step's length in events.
    share_streams : bool
        False: requests of different streams are always busy with each other.
    order : numpy.ndarray of int64
        The requests in the order they are placed (pinned ones are skipped).
    fit : str
        ``"first"`` (the lowest gap wide enough) or ``"best"`` (the narrowest, the lowest of
        equals).
    fixed : tuple of 4 numpy.ndarray of int64
        Ranges taken: their offsets, ends (bytes), first events and end events (exclusive);
        a range is in the way of a request whose lifetime meets ``[first, end)`` (no period).
    pinned : numpy.ndarray of int64
        Each request's given offset in bytes, -1 where it is placed here.
    work_limit : int
        Comparisons allowed (<= 0: no limit).
    budget_ns : int
        Nanoseconds of wall-clock time allowed (< 0: no limit).

    Returns
    -------
    (numpy.ndarray of int64, int, int)
        The offsets (complete only when the status is :data:`DONE`), the work done, and the
        status (:data:`DONE`, :data:`PAST_WORK` or :data:`PAST_TIME`).

    Raises
    ------
    ValueError
        ``fit`` is neither "first" nor "best", or the arrays differ in length.
    """
    if fit not in ("first", "best"):
        raise ValueError(f"fit must be 'first' or 'best', got {fit!r}")
    cdef const int64_t[::1] s = np.ascontiguousarray(sizes, dtype=np.int64)
    cdef const int64_t[::1] a = np.ascontiguousarray(starts, dtype=np.int64)
    cdef const int64_t[::1] e = np.ascontiguousarray(ends, dtype=np.int64)
    cdef const int64_t[::1] k = np.ascontiguousarray(streams, dtype=np.int64)
    cdef const int64_t[::1] pin = np.ascontiguousarray(pinned, dtype=np.int64)
    cdef const int64_t[::1] by = np.ascontiguousarray(order, dtype=np.int64)
    n = s.shape[0]
    if not (a.shape[0] == e.shape[0] == k.shape[0] == pin.shape[0] == n):
        raise ValueError("sizes, starts, ends, streams and pinned must have the same length")
    if by.shape[0] and (np.min(by) < 0 or np.max(by) >= n):
        raise ValueError(f"order must hold request indices in [0, {n})")
    lo, hi, first, end = (np.ascontiguousarray(x, dtype=np.int64) for x in fixed)
    if not (len(lo) == len(hi) == len(first) == len(end)):
        raise ValueError("fixed's four arrays must have the same length")
    # The fixed ranges by offset, ties in their order (a stable sort, as the NumPy loop's).
    by_lo = np.argsort(lo, kind="stable")
    cdef const int64_t[::1] flo = np.ascontiguousarray(lo[by_lo])
    cdef const int64_t[::1] fhi = np.ascontiguousarray(hi[by_lo])
    cdef const int64_t[::1] ffirst = np.ascontiguousarray(first[by_lo])
    cdef const int64_t[::1] fend = np.ascontiguousarray(end[by_lo])
    out = np.zeros(n, np.int64)
    cdef int64_t[::1] offsets = out
    cdef int64_t c_period = period, c_limit = work_limit, c_budget = budget_ns, work = 0
    cdef bint c_share = bool(share_streams), c_best = fit == "best"
    cdef int status
    with nogil:
        status = _place(s, a, e, k, c_period, c_share, by, c_best, flo, fhi, ffirst, fend, pin,
                        offsets, c_limit, c_budget, &work)
    return out, int(work), status
