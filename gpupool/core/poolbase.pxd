# PoolBase: a pool's state and upstream, its construction and end, and the Python API that reads
# or maintains them (core/poolbase.pyx); Pool (core/pool.pxd) serves requests on top of it.
from gpupool.buffer.owner cimport BlockOwner
from gpupool.core.state cimport PoolState
from gpupool.core.offload cimport HostChunk
from gpupool.records.block cimport Block

cdef class PoolBase(BlockOwner):
    cdef PoolState _st                  # everything below the Python API (core/state.pxd)
    cdef dict _offloaded                # sleeping tag id -> (held, copies): core/offload.pxd
    cdef HostChunk _spare               # page-locked chunk kept for the next offload
    cdef object __weakref__

    cdef bint block_asleep(self, Block* blk) noexcept nogil
