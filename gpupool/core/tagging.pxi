# gpupool.tag: it sets the calling thread's current tag (the tag field of its state,
# src/gp_thread.h, which only this module may touch: core/thread.pxd), which the pool's
# requests read (core/fastpath.pxd, core/acquire.pxd; core/tagged.pxd serves them).
# Included into core/pool.pyx.
from gpupool.core.tags import asleep_error, tag_id


class tag:
    """Mark the blocks allocated inside it, in the calling thread, with a tag.

    ``with gpupool.tag("weights"): ...``

    Every allocation that reaches a pool with an expandable upstream (``upstream="vmm"``)
    in the block (``Pool.allocate``, the C API the PyTorch, CuPy and Numba adapters use) is
    served from pages that hold only this tag's blocks, so that ``Pool.sleep(tags=...)`` can
    give those pages back and ``Pool.wake`` map them again at the same addresses. On a plain
    upstream the tag marks nothing (``sleep`` raises there). Tags nest (the innermost
    counts) and are per thread; freed tagged blocks serve only later requests of the same
    tag, on the stream they were last used on (or never used).

    Parameters
    ----------
    name : str
        The tag; at most 255 names in a process.

    Raises
    ------
    TypeError, ValueError
        ``name`` not a non-empty str, or too many tags.
    """

    __slots__ = ("name", "_id", "_prev")

    def __init__(self, name):
        self.name = name
        self._id = tag_id(name)
        self._prev = []

    def __enter__(self):
        cdef gp_thread* t = gp_this_thread()
        self._prev.append(t.tag)
        t.tag = self._id
        return self

    def __exit__(self, *exc):
        gp_this_thread().tag = self._prev.pop()
        return False

    def __repr__(self):
        return f"gpupool.tag({self.name!r})"


cdef object asleep_here():
    """The SleepingMemoryError of a request the calling thread made with its current tag while
    that tag sleeps (GP_ASLEEP), naming the tag: for the pool's own requests and the PyTorch
    adapter's, which reaches the pool through the C API (GPUPOOL_ERROR_ASLEEP)."""
    return asleep_error(gp_this_thread().tag)
