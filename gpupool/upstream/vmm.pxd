# The virtual-memory upstream: pages mapped into ranges of address space (expandable segments).
from libc.stdint cimport uintptr_t
from libcpp.unordered_map cimport unordered_map

from gpupool.upstream.driver cimport DriverUpstream

cdef class VmmUpstream(DriverUpstream):
    cdef unordered_map[uintptr_t, unsigned long long] pages     # mapped page -> its handle
    cdef readonly bint shareable        # pages are made exportable (POSIX file descriptors)
    cdef int share_refused              # the CUresult that turned shareable off; 0: none

    cdef void _release_pages(self, uintptr_t va, size_t nbytes) noexcept nogil
