# BlockOwner: the interface of what a DeviceBuffer holds memory from and gives its block back
# to (a Pool).
from libc.stdint cimport uintptr_t
from gpupool.records.block cimport Block
from gpupool.records.streams cimport StreamKey
from gpupool.upstream.base cimport Upstream

cdef class BlockOwner:
    """What a DeviceBuffer's block belongs to and goes back to (a Pool)."""
    cdef readonly Upstream upstream     # serves the buffer's copies, memsets and events
    cdef readonly int device

    cdef void free_block(self, Block* blk, StreamKey stream) noexcept nogil
    cdef void add_stream(self, Block* blk, StreamKey stream, void* holder) noexcept nogil
    cdef StreamKey check_stream(self, uintptr_t handle) except *
    cdef bint block_asleep(self, Block* blk) noexcept nogil
