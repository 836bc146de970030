# cython: language_level=3, boundscheck=False, wraparound=False
"""Region: a ``with`` block whose allocations are cached and handed back, at the same
addresses, the next time the block runs, with a step's peak equal to its working set.

What a region covers: allocations from its pool made by the thread that entered it, while
it is entered (the innermost region of that pool is current). Its blocks go back to its own
free lists whenever their buffers die, during the step or later. At exit, if some of its
buffers are still alive, a young-generation garbage collection runs (temporaries held in
reference cycles die there), and the survivors are detached (they return to the pool when
they die) or invalidated, by the ``on_exit`` policy.
"""
from libc.stdint cimport uintptr_t
from gpupool._block cimport Block, RegionCache
from gpupool._pool cimport Pool, region_push, region_pop
from gpupool._buffer cimport DeviceBuffer

cimport cython

import gc
import threading
import time

from gpupool.errors import GpupoolError
from gpupool.stats import RegionStats

_COLLECT = {"young": 1, "full": 2, None: None}
_POLICIES = ("detach", "invalidate")


@cython.no_gc_clear      # __dealloc__ needs the pool to unregister from it
cdef class Region:
    """A cached scope of allocations.

    ``Region(pool=None, on_exit="detach", collect="young", max_cached_bytes=None)``

    Parameters
    ----------
    pool : Pool, optional
        The pool it draws from; default: ``gpupool.get_pool()`` (the current device's).
    on_exit : {"detach", "invalidate"}
        What happens at exit to the region's buffers still alive after the collection:
        ``"detach"`` (they leave the region and return to the pool when they die) or
        ``"invalidate"`` (their blocks are recycled now and any later use raises
        ``InvalidBufferError``). Buffers passed to ``keep`` are always detached.
    collect : {"young", "full", None}
        Garbage collection run at exit when some of the region's buffers are still alive:
        ``gc.collect(1)`` (default), ``gc.collect()`` or none.
    max_cached_bytes : int, optional
        Cap on the bytes the region caches; blocks beyond it go back to the pool.

    Raises
    ------
    ValueError
        Unknown ``on_exit`` or ``collect``.
    GpupoolError
        On entry, if this Region object is already entered (re-entered inside itself, or
        entered on another thread); distinct Region objects nest freely.

    Notes
    -----
    Entering makes the region current for the calling thread only; allocations made by
    other threads (for example a framework's worker threads) are served by the pool.
    """

    cdef RegionCache* rc
    cdef readonly Pool pool
    cdef readonly str on_exit
    cdef object _collect
    cdef object _active_thread
    cdef set _kept
    cdef size_t entries, live_at_exit_bytes, collections
    cdef double collect_seconds
    cdef object __weakref__

    def __cinit__(self, pool=None, on_exit="detach", collect="young", max_cached_bytes=None):
        if on_exit not in _POLICIES:
            raise ValueError(f"on_exit must be one of {_POLICIES}, got {on_exit!r}")
        if collect not in _COLLECT:
            raise ValueError(f"collect must be 'young', 'full' or None, got {collect!r}")
        if pool is None:
            from gpupool import get_pool
            pool = get_pool()
        if not isinstance(pool, Pool):
            raise TypeError(f"pool must be a gpupool.Pool, got {type(pool).__name__}")
        if max_cached_bytes is not None and max_cached_bytes < 0:
            raise ValueError("max_cached_bytes must be >= 0")
        self.pool = pool
        self.on_exit = on_exit
        self._collect = _COLLECT[collect]
        self._kept = set()
        self.rc = new RegionCache()
        self.rc.max_cached_bytes = max_cached_bytes or 0
        self.pool.region_register(self.rc)

    def __dealloc__(self):
        if self.rc != NULL:
            if self.pool is not None:
                self.pool.region_unregister(self.rc)
            del self.rc
            self.rc = NULL

    def __enter__(self):
        if self._active_thread is not None:
            raise GpupoolError(
                "this Region is already entered (nested, or on another thread); use one "
                "Region object per scope and per thread")
        self._active_thread = threading.get_ident()
        self.entries += 1
        self._kept.clear()
        region_push(self.rc)
        return self

    def __exit__(self, exc_type, exc, tb):
        region_pop(self.rc)
        try:
            if self.rc.live_count and self._collect is not None:
                # The traceback of an exception raised in the block holds its frames, and so
                # the step's temporaries: drop our references before collecting.
                exc = tb = None
                start = time.perf_counter()
                if self._collect == 1:
                    gc.collect(1)
                else:
                    gc.collect()
                self.collect_seconds += time.perf_counter() - start
                self.collections += 1
            self._settle()
        finally:
            self._active_thread = None
        return False

    cdef void _settle(self):
        """Apply on_exit to the region's buffers still alive."""
        cdef Block* b
        cdef Block* nxt
        cdef DeviceBuffer buf
        cdef size_t escaped = 0
        self.pool.lock()
        b = self.rc.live_head
        while b != NULL:
            nxt = b.live_next
            if <uintptr_t>b in self._kept or self.on_exit == "detach" or b.buffer == NULL:
                if <uintptr_t>b not in self._kept:
                    escaped += b.size
                self.pool.region_detach(b)
            else:
                escaped += b.size
                buf = <DeviceBuffer>b.buffer
                buf.invalidate_locked()
                self.pool.release_locked(b, buf._stream)
            b = nxt
        self.pool.unlock()
        self.live_at_exit_bytes = escaped
        self._kept.clear()

    def keep(self, obj):
        """Exempt one buffer from the exit policy: it stays valid and leaves the region.

        Parameters
        ----------
        obj : DeviceBuffer or object with ``__cuda_array_interface__`` / ``__dlpack__``
            A buffer allocated in this region, or an array whose data pointer lies inside
            one of the region's live blocks.

        Returns
        -------
        obj

        Raises
        ------
        ValueError
            ``obj`` is not memory of one of this region's live buffers.
        """
        cdef Block* b
        cdef uintptr_t ptr
        if isinstance(obj, DeviceBuffer):
            ptr = (<DeviceBuffer>obj)._live_ptr()
        else:
            ptr = _data_pointer(obj)
        self.pool.lock()
        b = self.rc.live_head
        while b != NULL and not (b.ptr <= ptr < b.ptr + b.size):
            b = b.live_next
        self.pool.unlock()
        if b == NULL:
            raise ValueError(f"{obj!r} is not memory of a live buffer of this region")
        self._kept.add(<uintptr_t>b)
        return obj

    def release(self):
        """Give the region's cached blocks back to the pool (buffers alive are untouched)."""
        self.pool.lock()
        self.pool.region_drain(self.rc)
        self.pool.unlock()

    def stats(self):
        """The region's counters as a :class:`gpupool.RegionStats`."""
        self.pool.lock()
        stats = RegionStats(
            entries=self.entries, cache_hits=self.rc.hits, cache_misses=self.rc.misses,
            cached_bytes=self.rc.cached_bytes, live_at_exit_bytes=self.live_at_exit_bytes,
            peak_in_use_bytes=self.rc.peak_in_use_bytes, collections=self.collections,
            collect_seconds=self.collect_seconds)
        self.pool.unlock()
        return stats

    def reset_peak_stats(self):
        """Set the region's peak bytes in use to the bytes its live buffers hold now."""
        self.pool.lock()
        self.rc.peak_in_use_bytes = self.rc.live_bytes
        self.pool.unlock()

    def __repr__(self):
        return (f"<gpupool.Region pool={self.pool!r} on_exit={self.on_exit!r} "
                f"entries={self.entries} cached={self.rc.cached_bytes}>")


def _data_pointer(obj):
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return cai["data"][0]
    raise TypeError(
        f"keep() needs a DeviceBuffer or an object with __cuda_array_interface__, "
        f"got {type(obj).__name__}")
