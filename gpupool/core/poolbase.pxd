# PoolBase: a pool's state and upstream, its construction and end, and the Python API that reads
# or maintains them (core/poolbase.pyx); Pool (core/pool.pxd) serves requests on top of it.
from gpupool.buffer.owner cimport BlockOwner
from gpupool.core.state cimport PoolState
from libc.stdint cimport uintptr_t
from gpupool.records.block cimport Block, HostChunk
from gpupool.records.counters cimport Counters
from gpupool.records.streams cimport StreamKey
from gpupool.core.regioncache cimport RegionCache

cdef class PoolBase(BlockOwner):
    cdef PoolState _st                  # everything below the Python API (core/state.pxd)
    cdef dict _offloaded                # sleeping tag id -> its copies: core/offload.pxd
    cdef HostChunk _spare               # page-locked chunk kept for the next offload
    cdef object __weakref__

    cdef bint block_asleep(self, Block* blk) noexcept nogil
    cdef int lock_here(self) except -1
    cdef int check_usable(self) except -1
    cdef int keep_host(self, HostChunk* chunk) except -1

    # The interface of the layers above that reads the pool's state (as Pool's, core/pool.pxd:
    # each takes the pool's lock itself).
    cdef Counters read_counters(self) noexcept nogil
    cdef void reset_peaks(self) noexcept nogil
    cdef size_t private_live(self, RegionCache* rc, uintptr_t* ptrs, size_t* sizes,
                             size_t capacity) noexcept nogil
    cdef bint private_allocate_at(self, RegionCache* rc, uintptr_t ptr, size_t nbytes,
                                  StreamKey s) noexcept nogil
    cdef void private_end(self, RegionCache* rc) noexcept nogil
    cdef Block* find_live(self, uintptr_t ptr, size_t nbytes) noexcept nogil
    cdef object holder_at(self, uintptr_t ptr, size_t nbytes, bint* found)
