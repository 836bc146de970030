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
search a placement).

The placed requests are kept in chunks of up to 2 * GP_CHUNK entries by (offset, index), each
entry holding the request's end, lifetime and stream: an insertion moves the entries of one
chunk, the scan reads the entries in order without looking the requests up, and it takes the
entries in the way in one loop up to the next fixed range in the way (Note [Step time of
planned regions]). The core stops past ``work_limit`` of it, or past
``budget_ns`` of wall-clock time (steady clock, checked every 64 placements), and says which.
The core runs without the GIL. Measurements: Note [Compiled greedy placement] in docs/design.md.
"""
from libc.stdint cimport INT64_MAX, int64_t
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
    /* A placed request with what the scan reads of it (its bytes' end, lifetime and stream), so
       that the scan reads the run in order without looking the request up; trivially
       copyable, so that an insertion moves the entries after it by memmove. */
    struct gp_placed { int64_t offset; int64_t index; int64_t hi; int64_t start; int64_t end;
                       int64_t stream; };
    static inline bool gp_placed_less(const gp_placed& a, const gp_placed& b) {
        return a.offset < b.offset || (a.offset == b.offset && a.index < b.index);
    }
    /* Placed requests by (offset, index), in chunks of GP_CHUNK to 2 * GP_CHUNK - 1 entries
       (the last chunks fewer until they fill): an insertion moves the entries of one chunk,
       not of the whole run, and the scan still reads them in order. */
    static const size_t GP_CHUNK = 64;
    struct gp_run { std::vector<std::vector<gp_placed> > chunks; size_t count = 0; };
    /* The chunk that holds x or would: the first whose last entry is not below x, else the
       last. The run is not empty. */
    static inline size_t gp_run_chunk(const gp_run& run, const gp_placed& x) {
        size_t lo = 0, hi = run.chunks.size() - 1;
        while (lo < hi) {
            size_t mid = (lo + hi) / 2;
            if (gp_placed_less(run.chunks[mid].back(), x)) lo = mid + 1; else hi = mid;
        }
        return lo;
    }
    static inline void gp_run_insert(gp_run& run, const gp_placed& x) {
        if (run.chunks.empty()) {
            run.chunks.emplace_back();
            run.chunks.back().reserve(2 * GP_CHUNK);
        }
        size_t c = gp_run_chunk(run, x);
        std::vector<gp_placed>& chunk = run.chunks[c];
        chunk.insert(std::lower_bound(chunk.begin(), chunk.end(), x, gp_placed_less), x);
        run.count += 1;
        if (chunk.size() >= 2 * GP_CHUNK) {         /* split in two halves */
            std::vector<gp_placed> upper;
            upper.reserve(2 * GP_CHUNK);
            upper.assign(chunk.begin() + GP_CHUNK, chunk.end());
            chunk.resize(GP_CHUNK);
            run.chunks.insert(run.chunks.begin() + c + 1, std::move(upper));
        }
    }
    /* The position of a placed request in a run that holds it. */
    static inline Py_ssize_t gp_run_rank(const gp_run& run, const gp_placed& x) {
        size_t c = gp_run_chunk(run, x), rank = 0;
        for (size_t k = 0; k < c; ++k) rank += run.chunks[k].size();
        const std::vector<gp_placed>& chunk = run.chunks[c];
        return rank + (std::lower_bound(chunk.begin(), chunk.end(), x, gp_placed_less) -
                       chunk.begin());
    }
    /* The scan for one request: of a run in order (chunk c, its entry k next; ``passed``
       the entries read), the last entry read that is in the way (``last``; ``pending``: not
       taken yet), and the gaps between the ranges taken so far, in address order
       (``reach``: the highest end, once ``any_seen``; the gap kept: ``found`` at ``at``, of
       ``best_gap`` bytes). */
    struct gp_scan {
        const gp_run* run; size_t c; size_t k; Py_ssize_t passed;
        const gp_placed* last; bool pending;
        bool any_seen; bool found; int64_t reach; int64_t at; int64_t best_gap;
    };
    /* Whether [sa, ea) and [sb, eb) share an event, in one entry or across the boundary
       (placement.overlaps with a period). */
    static inline bool gp_busy(int64_t sa, int64_t ea, int64_t sb, int64_t eb, int64_t period) {
        return (sa < eb && sb < ea) || (sa < eb - period && sb - period < ea) ||
               (sa - period < eb && sb < ea - period);
    }
    /* Takes the range [lo, hi) as in the way: the gap below it is kept when ``size`` bytes
       fit in it (first fit: the first such; best fit: the narrowest, the lowest of equals),
       then its end raises the reach. True when first fit has found its gap (the scan stops). */
    static inline bool gp_take(gp_scan& s, int64_t lo, int64_t hi, int64_t size, bool best) {
        int64_t before = s.any_seen ? s.reach : 0, gap = lo - before;
        if (gap >= size && (!s.found || gap < s.best_gap)) {
            s.found = true; s.at = before; s.best_gap = gap;
            if (!best) return true;
        }
        s.reach = (!s.any_seen || hi > s.reach) ? hi : s.reach;
        s.any_seen = true;
        return false;
    }
    enum { GP_STOPPED = 0, GP_PENDING = 1, GP_END = 2 };
    /* Takes the run's entries in the way of a request of lifetime [sa, ea) on ``stream``
       (of another stream, unless streams share; or live at one of its events) in order, up
       to those at offsets past ``limit`` (the next fixed range's, which an entry at its
       offset goes before). Returns GP_STOPPED (first fit found its gap at ``s.last``),
       GP_PENDING (``s.last`` lies past ``limit``, read and not taken) or GP_END (the run
       read to its end). */
    static inline int gp_take_run(gp_scan& s, int64_t limit, int64_t size, bool best,
                                  int64_t sa, int64_t ea, int64_t stream, int64_t period,
                                  bool share) {
        if (s.pending) {
            if (s.last->offset > limit) return GP_PENDING;
            s.pending = false;
            if (gp_take(s, s.last->offset, s.last->hi, size, best)) return GP_STOPPED;
        }
        /* The entries not in the way are skipped in a loop on locals (the state is kept in
           memory across the calls: written back when an entry is read in the way). */
        const std::vector<std::vector<gp_placed> >& chunks = s.run->chunks;
        const size_t nchunks = chunks.size();
        for (; s.c < nchunks; ++s.c, s.k = 0) {
            const gp_placed* data = chunks[s.c].data();
            const size_t n = chunks[s.c].size();
            size_t k = s.k;
            for (; k < n; ++k) {
                const gp_placed& e = data[k];
                if ((share || e.stream == stream) && !gp_busy(sa, ea, e.start, e.end, period))
                    continue;
                s.passed += k + 1 - s.k;
                s.k = k + 1;
                s.last = &e;
                if (e.offset > limit) {
                    s.pending = true;
                    return GP_PENDING;
                }
                if (gp_take(s, e.offset, e.hi, size, best)) return GP_STOPPED;
            }
            s.passed += n - s.k;
        }
        return GP_END;
    }
    """
    cdef struct gp_placed:
        int64_t offset
        int64_t index
        int64_t hi
        int64_t start
        int64_t end
        int64_t stream
    cdef cppclass gp_run:
        size_t count
    cdef struct gp_scan:
        const gp_run* run
        size_t c
        size_t k
        Py_ssize_t passed
        const gp_placed* last
        bint pending
        bint any_seen
        bint found
        int64_t reach
        int64_t at
        int64_t best_gap
    enum:
        GP_STOPPED
        GP_PENDING
        GP_END
    void gp_run_insert(gp_run& run, const gp_placed& x) nogil
    Py_ssize_t gp_run_rank(const gp_run& run, const gp_placed& x) nogil
    bint gp_take(gp_scan& s, int64_t lo, int64_t hi, int64_t size, bint best) nogil
    int gp_take_run(gp_scan& s, int64_t limit, int64_t size, bint best, int64_t sa,
                    int64_t ea, int64_t stream, int64_t period, bint share) nogil

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


cdef inline int64_t _round_period(int64_t t, int64_t period) noexcept nogil:
    """``t % period`` for ``t`` in ``(-period, period)``, without a division."""
    return t + period if t < 0 else t


cdef inline bint _meets(int64_t s, int64_t e, int64_t c, int64_t length, int64_t period) \
        noexcept nogil:
    """Whether lifetime [s, e) and the window of ``length`` events from event ``c`` meet,
    both taken round the period (an end past it goes on from event 0 of the next entry);
    ``s`` and ``c`` in ``[0, period)`` (``place`` indexes no other lifetime)."""
    return e - s >= period or _round_period(s - c, period) < length or \
        _round_period(c - s, period) < e - s


cdef int _place(const int64_t[::1] sizes, const int64_t[::1] starts, const int64_t[::1] ends,
                const int64_t[::1] streams, int64_t period, bint share_streams,
                const int64_t[::1] order, bint best,
                const int64_t[::1] fixed_lo, const int64_t[::1] fixed_hi,
                const int64_t[::1] fixed_first, const int64_t[::1] fixed_end,
                const int64_t[::1] pinned, int64_t[::1] offsets, Py_ssize_t nb,
                int64_t work_limit, int64_t budget_ns, int64_t* work) noexcept nogil:
    cdef Py_ssize_t n = sizes.shape[0], m = fixed_lo.shape[0]
    cdef Py_ssize_t count = 0, o, f, b, q
    cdef int64_t i, j, size, sa, ea, w
    cdef int taken
    cdef bint f_busy, p_end
    cdef long long deadline = gp_greedy_now_ns() + budget_ns if budget_ns >= 0 else 0
    # Levels of windows, finest first: level q's start every stride[q] events and span two
    # strides (round the period); each holds the placed requests that meet it.
    cdef vector[int64_t] stride
    cdef vector[Py_ssize_t] windows, base
    cdef vector[gp_run] runs
    cdef gp_run placed                      # every placed request
    cdef gp_run* run
    cdef gp_scan scan
    cdef gp_placed entry
    while nb >= 4:
        w = (period + nb - 1) // nb
        stride.push_back(w)
        windows.push_back((period + w - 1) // w)
        base.push_back(0 if base.empty() else base.back() + windows[windows.size() - 2])
        nb //= 4
    runs.resize(base.back() + windows.back() if not base.empty() else 0)
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
            scan.run, scan.c, scan.k, scan.passed = run, 0, 0, 0
            scan.last = NULL
            scan.pending = scan.any_seen = scan.found = False
            scan.reach = scan.at = scan.best_gap = 0
            f = 0                           # the fixed ranges passed
            f_busy = False                  # fixed f: known to be in the way
            p_end = False                   # the run scanned to its end
            while True:
                # The ranges taken while i lives, by (offset, placed before fixed): the fixed
                # range next in the way, then the run's entries up to its offset, then it.
                while not f_busy and f < m:
                    done += 1
                    f_busy = fixed_first[f] < ea and sa < fixed_end[f]
                    if not f_busy:
                        f += 1
                if not p_end:
                    taken = gp_take_run(scan, fixed_lo[f] if f_busy else INT64_MAX, size,
                                        best, sa, ea, streams[i], period, share_streams)
                    if taken == GP_STOPPED:
                        break
                    p_end = taken == GP_END
                if not f_busy:
                    break
                f_busy = False
                f += 1
                if gp_take(scan, fixed_lo[f - 1], fixed_hi[f - 1], size, best):
                    break
            offsets[i] = scan.at if scan.found else scan.reach
            # The work counts the placed requests the scan of every placed request compares:
            # all of them when the run is scanned to its end (no request busy with i is left
            # in it), else those up to the last one in the way, the last the run compares.
            if p_end:
                done += <int64_t>placed.count
            elif run == &placed:
                done += scan.passed
            else:
                done += gp_run_rank(placed, scan.last[0]) + 1
        entry.offset, entry.index, entry.hi = offsets[i], i, offsets[i] + size
        entry.start, entry.end, entry.stream = sa, ea, streams[i]
        gp_run_insert(placed, entry)
        for q in range(<Py_ssize_t>stride.size()):
            for b in range(windows[q]):
                if _meets(sa, ea, b * stride[q], min(2 * stride[q], period), period):
                    gp_run_insert(runs[base[q] + b], entry)
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

