# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""A plan's anchors, compiled (``of_plan``, exported as ``planned.anchors``): for each planned
request k, the request placed just below it (the largest end at or below k's offset, the
lowest index among equal ends) among those allocated before k and still live when k is
allocated; -1 if none.

One sweep over the requests in the order of their allocation, with the live ones as bits by
the rank of their key (end, -index) among the planned requests' keys: a request freed at or
before k's allocation leaves first (frees come before an allocation at one event), then the
highest live rank among the keys of ends at or below k's offset (a binary search) is k's
anchor. A bit a word and a summary bit a word: each step reads a word or two (a set of nodes
took about a fifth more time a plan: Note [Step time of planned regions]). O(n log n), for
the sorts and the searches; the GIL is released for the sweep.
"""
from libc.stdint cimport int64_t

import numpy as np

cdef extern from *:
    """
    #include <cstdint>
    #include <vector>
    /* The live requests as bits by the rank of their key (end, -index): a word of 64 bits,
       and a summary bit a word that has any set, so that the last live key below a rank is
       found in a word or two rather than in a tree of nodes. */
    struct gp_live {
        std::vector<uint64_t> words, summary;
        explicit gp_live(size_t n) : words(n / 64 + 1), summary(n / 4096 + 1) {}
        void set(size_t r) {
            words[r >> 6] |= uint64_t(1) << (r & 63);
            summary[r >> 12] |= uint64_t(1) << ((r >> 6) & 63);
        }
        void clear(size_t r) {
            uint64_t& w = words[r >> 6];
            w &= ~(uint64_t(1) << (r & 63));
            if (!w) summary[r >> 12] &= ~(uint64_t(1) << ((r >> 6) & 63));
        }
        /* The highest set rank below r, or -1. */
        int64_t below(size_t r) const {
            size_t w = r >> 6;
            uint64_t bits = words[w] & ((uint64_t(1) << (r & 63)) - 1);
            if (bits) return int64_t(w * 64 + 63 - __builtin_clzll(bits));
            /* the highest word below w with a bit set */
            size_t s = w >> 6;
            uint64_t sum = summary[s] & ((uint64_t(1) << (w & 63)) - 1);
            while (!sum) {
                if (s == 0) return -1;
                sum = summary[--s];
            }
            size_t v = s * 64 + 63 - __builtin_clzll(sum);
            return int64_t(v * 64 + 63 - __builtin_clzll(words[v]));
        }
    };
    """
    cdef cppclass gp_live:
        gp_live(size_t n) nogil
        void set(size_t r) nogil
        void clear(size_t r) nogil
        int64_t below(size_t r) nogil


cdef void _sweep(const int64_t[::1] offsets, const int64_t[::1] ends,
                 const int64_t[::1] alloc, const int64_t[::1] free,
                 const int64_t[::1] planned, const int64_t[::1] by_free,
                 const int64_t[::1] by_key, const int64_t[::1] rank,
                 int64_t[::1] out) noexcept nogil:
    cdef gp_live* live = new gp_live(by_key.shape[0])
    cdef Py_ssize_t r = 0, n_free = by_free.shape[0], lo, hi, mid
    cdef int64_t k, j, at
    for k in range(offsets.shape[0]):
        out[k] = -1
        if not planned[k]:
            continue
        while r < n_free and free[by_free[r]] <= alloc[k]:
            live.clear(rank[by_free[r]])
            r += 1
        # the keys of ends at or below k's offset: by_key[:lo]
        lo, hi = 0, by_key.shape[0]
        while lo < hi:
            mid = (lo + hi) // 2
            if ends[by_key[mid]] <= offsets[k]:
                lo = mid + 1
            else:
                hi = mid
        at = live.below(lo)
        if at >= 0:
            out[k] = by_key[at]
        live.set(rank[k])
    del live


def anchors(offsets, nbytes, alloc, free, planned):
    """Each planned request's anchor: the request j < k with ``free[j] > alloc[k]`` and
    ``offsets[j] + nbytes[j] <= offsets[k]`` of the largest end (the lowest j of equal ends);
    -1 where there is none or k is not planned.

    Parameters
    ----------
    offsets, nbytes : array-like of int
        Each request's place and size in bytes.
    alloc, free : array-like of int
        Each request's events (``alloc`` increasing; ``free > alloc`` where planned).
    planned : array-like of bool
        The requests placed.

    Returns
    -------
    numpy.ndarray of int64

    Raises
    ------
    ValueError
        The arrays differ in length.
    """
    off, size, a, f = (np.ascontiguousarray(x, dtype=np.int64)
                       for x in (offsets, nbytes, alloc, free))
    keep = np.ascontiguousarray(planned, dtype=bool)
    n = len(off)
    if not (len(size) == len(a) == len(f) == len(keep) == n):
        raise ValueError("offsets, nbytes, alloc, free and planned must have the same length")
    idx = np.flatnonzero(keep)
    cdef const int64_t[::1] c_off = off
    cdef const int64_t[::1] c_ends = off + size
    cdef const int64_t[::1] c_alloc = a
    cdef const int64_t[::1] c_free = f
    cdef const int64_t[::1] c_planned = keep.astype(np.int64)
    cdef const int64_t[::1] c_by_free = np.ascontiguousarray(idx[np.argsort(f[idx],
                                                                            kind="stable")])
    # The planned requests by their key (end, -index): ends ascending, equal ends the highest
    # index first; each one's rank in that order.
    down = idx[::-1]
    by_key = np.ascontiguousarray(down[np.argsort((off + size)[down], kind="stable")])
    ranks = np.zeros(n, np.int64)
    ranks[by_key] = np.arange(len(by_key))
    cdef const int64_t[::1] c_by_key = by_key
    cdef const int64_t[::1] c_rank = ranks
    out = np.empty(n, np.int64)
    cdef int64_t[::1] c_out = out
    with nogil:
        _sweep(c_off, c_ends, c_alloc, c_free, c_planned, c_by_free, c_by_key, c_rank, c_out)
    return out


def of_plan(plan):
    """For each planned request k of ``plan`` (a ``placement.Plan``), a request placed just
    below it (the largest end at or below k's offset, the lowest index of equal ends) among
    those allocated before k in the entry and still live when k is allocated; -1 if none.
    The core finds k's place by walking the pool's blocks from that one's, usually its
    neighbour. int64 array, one entry per request (:func:`anchors`' sweep)."""
    step = plan.step
    return anchors(plan.offsets, step.nbytes, step.alloc, step.free, step.planned)
