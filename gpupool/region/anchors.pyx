# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""A plan's anchors, compiled (``planned.anchors`` calls it): for each planned request k, the
request placed just below it (the largest end at or below k's offset, the lowest index among
equal ends) among those allocated before k and still live when k is allocated; -1 if none.

One sweep over the requests in the order of their allocation, with the live ones in an
ordered set by (end, -index): a request freed at or before k's allocation leaves it first
(frees come before an allocation at one event), then the set's last element at or below k's
offset is k's anchor. O(n log n); the GIL is released for the sweep.
"""
from cython.operator cimport dereference as deref, predecrement as dec
from libc.stdint cimport int64_t, INT64_MAX
from libcpp.pair cimport pair
from libcpp.set cimport set as cset

import numpy as np

ctypedef pair[int64_t, int64_t] key_t          # (end, -index) of a live request


cdef void _sweep(const int64_t[::1] offsets, const int64_t[::1] ends,
                 const int64_t[::1] alloc, const int64_t[::1] free,
                 const int64_t[::1] planned, const int64_t[::1] by_free,
                 int64_t[::1] out) noexcept nogil:
    cdef cset[key_t] live
    cdef cset[key_t].iterator at
    cdef Py_ssize_t r = 0, n_free = by_free.shape[0]
    cdef int64_t k, j
    for k in range(offsets.shape[0]):
        out[k] = -1
        if not planned[k]:
            continue
        while r < n_free and free[by_free[r]] <= alloc[k]:
            j = by_free[r]
            live.erase(key_t(ends[j], -j))
            r += 1
        at = live.upper_bound(key_t(offsets[k], INT64_MAX))
        if at != live.begin():
            out[k] = -deref(dec(at)).second
        live.insert(key_t(ends[k], -k))


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
    out = np.empty(n, np.int64)
    cdef int64_t[::1] c_out = out
    with nogil:
        _sweep(c_off, c_ends, c_alloc, c_free, c_planned, c_by_free, c_out)
    return out
