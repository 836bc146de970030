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

With ``buckets`` (off by default), the placed requests are also indexed by time: windows of
two strides each, a stride every ``period / buckets`` events (then 4 times coarser, down to
4 windows), each holding the placed requests whose lifetime meets it, by (offset, index). A
request whose lifetime lies in one window scans that window's requests alone: every request
busy with it meets that window (lifetimes taken round the period), so the same requests are
busy, in the same order, and the offsets are the same; only fewer placed requests are
compared. Lifetimes off ``[0, period)`` or streams that keep apart scan every placed request.

The work is the number of placed requests the scan of every placed request compares with the
one being placed (each fixed range compared counts as one too), with the index or without:
that scan compares the placed requests up to the last one in the way it meets, or all of them,
so the index counts it by the position of that request among all those placed (one binary
search a placement). The core stops past ``work_limit`` of it, or past
``budget_ns`` of wall-clock time (steady clock, checked every 64 placements), and says which.
The core runs without the GIL. Measurements: Note [Compiled greedy placement] in docs/design.md.
"""
from libc.stdint cimport int64_t
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

cdef extern from *:
    """
    #include <algorithm>
    #include <cstdint>
    #include <vector>
    /* A placed request; trivially copyable, so that an insertion moves the run by memmove. */
    struct gp_placed { int64_t offset; int64_t index; };
    static inline bool gp_placed_less(const gp_placed& a, const gp_placed& b) {
        return a.offset < b.offset || (a.offset == b.offset && a.index < b.index);
    }
    static inline void gp_placed_insert(std::vector<gp_placed>& run, int64_t offset,
                                        int64_t index) {
        gp_placed x = {offset, index};
        run.insert(std::lower_bound(run.begin(), run.end(), x, gp_placed_less), x);
    }
    /* The position of a placed request in a run that holds it. */
    static inline Py_ssize_t gp_placed_rank(const std::vector<gp_placed>& run,
                                            const gp_placed& x) {
        return std::lower_bound(run.begin(), run.end(), x, gp_placed_less) - run.begin();
    }
    """
    cdef struct gp_placed:
        int64_t offset
        int64_t index
    void gp_placed_insert(vector[gp_placed]& run, int64_t offset, int64_t index) nogil
    Py_ssize_t gp_placed_rank(const vector[gp_placed]& run, const gp_placed& x) nogil

cdef enum:
    _DONE = 0           # every request placed
    _PAST_WORK = 1      # stopped past the work limit
    _PAST_TIME = 2      # stopped past the time budget

DONE, PAST_WORK, PAST_TIME = _DONE, _PAST_WORK, _PAST_TIME

# The index by time where it pays (``place``'s default): INDEX_BUCKETS windows at the finest
# level when at least INDEX_FROM requests are placed (pinned ones not counted); below, keeping
# the windows costs more than the scans it saves (Note [Compiled greedy placement]).
INDEX_BUCKETS = 32
INDEX_FROM = 1536


cdef inline bint _busy(int64_t sa, int64_t ea, int64_t sb, int64_t eb, int64_t period) \
        noexcept nogil:
    """Whether [sa, ea) and [sb, eb) share an event, in one entry or across the boundary
    (placement.overlaps with a period)."""
    return ((sa < eb and sb < ea) or (sa < eb - period and sb - period < ea) or
            (sa - period < eb and sb < ea - period))


ctypedef vector[gp_placed] run_t              # placed requests by (offset, index)


cdef inline bint _meets(int64_t s, int64_t e, int64_t c, int64_t length, int64_t period) \
        noexcept nogil:
    """Whether lifetime [s, e) and the window of ``length`` events from event ``c`` meet,
    both taken round the period (an end past it goes on from event 0 of the next entry)."""
    return e - s >= period or (s - c) % period < length or (c - s) % period < e - s


cdef int _place(const int64_t[::1] sizes, const int64_t[::1] starts, const int64_t[::1] ends,
                const int64_t[::1] streams, int64_t period, bint share_streams,
                const int64_t[::1] order, bint best,
                const int64_t[::1] fixed_lo, const int64_t[::1] fixed_hi,
                const int64_t[::1] fixed_first, const int64_t[::1] fixed_end,
                const int64_t[::1] pinned, int64_t[::1] offsets, Py_ssize_t nb,
                int64_t work_limit, int64_t budget_ns, int64_t* work) noexcept nogil:
    cdef Py_ssize_t n = sizes.shape[0], m = fixed_lo.shape[0]
    cdef Py_ssize_t count = 0, o, f, b, q, p
    cdef int64_t i, j, size, sa, ea, lo, hi, before, reach, at, gap, best_gap, w
    cdef bint any_seen, found, p_busy, f_busy, p_end
    cdef long long deadline = gp_greedy_now_ns() + budget_ns if budget_ns >= 0 else 0
    # Levels of windows, finest first: level q's start every stride[q] events and span two
    # strides (round the period); each holds the placed requests that meet it.
    cdef vector[int64_t] stride
    cdef vector[Py_ssize_t] windows, base
    cdef vector[run_t] runs
    cdef run_t placed                       # every placed request
    cdef run_t* run
    cdef const gp_placed* data
    cdef Py_ssize_t nrun
    while nb >= 4:
        w = (period + nb - 1) // nb
        stride.push_back(w)
        windows.push_back((period + w - 1) // w)
        base.push_back(0 if base.empty() else base.back() + windows[windows.size() - 2])
        nb //= 4
    runs.resize(base.back() + windows.back() if not base.empty() else 0)
    placed.reserve(n)
    cdef int64_t done = 0              # the work, kept here and handed back at the end
    for j in range(n):
        offsets[j] = pinned[j] if pinned[j] >= 0 else 0
    for o in range(-n, order.shape[0]):
        # Pinned requests first (as placed, in index order), then the others in order.
        i = o + n if o < 0 else order[o]
        if (o < 0) != (pinned[i] >= 0):
            continue
        size, sa, ea = sizes[i], starts[i], ends[i]
        if o >= 0:
            if count % 64 == 63 and budget_ns >= 0 and gp_greedy_now_ns() > deadline:
                work[0] = done
                return _PAST_TIME
            count += 1
            # The run to scan: the finest window that holds i's lifetime (every request busy
            # with i meets it: Note [Compiled greedy placement]), else every placed request.
            run = &placed
            for q in range(<Py_ssize_t>stride.size()):
                b = sa // stride[q]
                if ea - sa <= min(2 * stride[q], period) - (sa - b * stride[q]):
                    run = &runs[base[q] + b]
                    break
            data, nrun = run.data(), run.size()
            any_seen = found = False
            before = reach = at = best_gap = 0
            p = f = 0
            p_busy = f_busy = False         # data[p - 1], fixed f: known to be in the way
            p_end = False                   # the run scanned to its end
            while True:
                # The next range taken while i lives, by (offset, placed before fixed).
                while not p_busy and p < nrun:
                    j = data[p].index
                    p += 1
                    p_busy = (not share_streams and streams[i] != streams[j]) or \
                        _busy(sa, ea, starts[j], ends[j], period)
                p_end = p_end or not p_busy
                while not f_busy and f < m:
                    done += 1
                    f_busy = fixed_first[f] < ea and sa < fixed_end[f]
                    if not f_busy:
                        f += 1
                if p_busy and (not f_busy or data[p - 1].offset <= fixed_lo[f]):
                    lo, hi = data[p - 1].offset, data[p - 1].offset + sizes[data[p - 1].index]
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
            # The work counts the placed requests the scan of every placed request compares:
            # all of them when the run is scanned to its end (no request busy with i is left
            # in it), else those up to the last one in the way, the last the run compares.
            if p_end:
                done += <int64_t>placed.size()
            elif run == &placed:
                done += p
            else:
                done += gp_placed_rank(placed, data[p - 1]) + 1
        gp_placed_insert(placed, offsets[i], i)
        for q in range(<Py_ssize_t>stride.size()):
            for b in range(windows[q]):
                if _meets(sa, ea, b * stride[q], min(2 * stride[q], period), period):
                    gp_placed_insert(runs[base[q] + b], offsets[i], i)
        if o >= 0 and work_limit > 0 and done > work_limit:
            work[0] = done
            return _PAST_WORK
    work[0] = done
    return _DONE


def place(sizes, starts, ends, streams, period, share_streams, order, fit, fixed, pinned,
          work_limit=0, budget_ns=-1, buckets=None):
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
    buckets : int or None
        Windows of the finest level of the index of placed requests by time (0: no index,
        every placed request scanned for each one placed; None, the default:
        :data:`INDEX_BUCKETS` when at least :data:`INDEX_FROM` requests are placed, else 0).
        The offsets, the work counted and so where ``work_limit`` stops the placement are the
        same whatever it is.

    Returns
    -------
    (numpy.ndarray of int64, int, int)
        The offsets (complete only when the status is :data:`DONE`), the work done, and the
        status (:data:`DONE`, :data:`PAST_WORK` or :data:`PAST_TIME`).

    Raises
    ------
    ValueError
        ``fit`` is neither "first" nor "best", the arrays differ in length, or ``buckets``
        is negative.
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
    nb = int(buckets) if buckets is not None else \
        INDEX_BUCKETS if int(np.count_nonzero(np.asarray(pin) < 0)) >= INDEX_FROM else 0
    if nb < 0:
        raise ValueError(f"buckets must be >= 0, got {buckets}")
    if nb and n and not (period > 0 and np.min(a) >= 0 and np.max(a) < period and
                         bool((np.asarray(e) > np.asarray(a)).all()) and
                         (share_streams or np.min(k) == np.max(k))):
        nb = 0          # lifetimes off the period, or streams that keep apart: scan all
    out = np.zeros(n, np.int64)
    cdef int64_t[::1] offsets = out
    cdef Py_ssize_t c_nb = min(nb, period) if nb else 0
    cdef int64_t c_period = period, c_limit = work_limit, c_budget = budget_ns, work = 0
    cdef bint c_share = bool(share_streams), c_best = fit == "best"
    cdef int status
    with nogil:
        status = _place(s, a, e, k, c_period, c_share, by, c_best, flo, fhi, ffirst, fend, pin,
                        offsets, c_nb, c_limit, c_budget, &work)
    return out, int(work), status

