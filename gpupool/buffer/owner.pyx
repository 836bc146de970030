# cython: language_level=3, boundscheck=False, wraparound=False
"""BlockOwner: the interface of what a DeviceBuffer holds memory from (``gpupool.Pool``
implements it, ``core/pool.pyx``)."""
from libc.stdint cimport uintptr_t
from gpupool.records.block cimport Block
from gpupool.driver.calls cimport fork_flag, mark_used
from gpupool.records.streams cimport StreamKey, BY_HANDLE, stream_key

from gpupool.errors import FORK_MESSAGE, GpupoolError

cdef const int* FORKED = fork_flag()


cdef class BlockOwner:
    """The interface of what a DeviceBuffer holds memory from; ``gpupool.Pool`` implements it.

    Attributes
    ----------
    upstream : Upstream
        Serves the buffer's copies, memsets and events.
    device : int
        Device ordinal of the memory.

    Raises
    ------
    GpupoolError
        Made in a fork() child of a process that used gpupool (no pool can be made there).
    """

    def __cinit__(self, *args, **kwargs):
        # Every pool is made here first: the process now holds memory that a fork() child
        # must leave alone (fork detection, driver/calls.pxd).
        if FORKED[0]:
            raise GpupoolError(FORK_MESSAGE)
        mark_used()

    cdef void free_block(self, Block* blk, StreamKey stream) noexcept nogil:
        """Take back a live block, last used on stream."""
        pass

    cdef void add_stream(self, Block* blk, StreamKey stream, void* holder) noexcept nogil:
        """Mark a live block as used on another stream too (``record_stream``), if it is
        still holder's (NULL: no check)."""
        pass

    cdef StreamKey check_stream(self, uintptr_t handle) except *:
        """The key of a stream handle, raising for one the driver refuses."""
        return stream_key(handle, BY_HANDLE)

    cdef bint block_asleep(self, Block* blk) noexcept nogil:
        """Whether a live block's memory sleeps (``Pool.sleep``): its bytes may not be used."""
        return False
