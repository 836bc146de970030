# The virtual-memory upstream: chunks (a page each, or a tagged segment's one physical allocation
# of many pages) mapped into ranges of address space (expandable segments).
from libc.stdint cimport uintptr_t
from libcpp.unordered_map cimport unordered_map
from cuda.bindings.cydriver cimport CUmemGenericAllocationHandle

from gpupool.upstream.driver cimport DriverUpstream

cdef struct Chunk:
    unsigned long long handle           # its cuMemCreate handle
    size_t nbytes                       # whole pages

cdef class VmmUpstream(DriverUpstream):
    cdef unordered_map[uintptr_t, Chunk] chunks     # mapped chunk's start -> its allocation
    cdef size_t mapped                  # bytes of all chunks
    cdef readonly bint shareable        # pages are made exportable (POSIX file descriptors)
    cdef int share_refused              # the CUresult that turned shareable off; 0: none
    cdef readonly int release_refused   # the CUresult of the last cuMemRelease refused; 0: none

    cdef int _create(self, CUmemGenericAllocationHandle* handle, size_t nbytes) noexcept nogil
    cdef int _map_one(self, uintptr_t va, size_t nbytes) noexcept nogil
    cdef void _undo(self, uintptr_t va, size_t nbytes) noexcept nogil
    cdef bint _whole_chunks(self, uintptr_t va, size_t nbytes) noexcept nogil
    cdef void _release_chunks(self, uintptr_t va, size_t nbytes) noexcept nogil
    cdef void _release(self, CUmemGenericAllocationHandle handle) noexcept nogil
