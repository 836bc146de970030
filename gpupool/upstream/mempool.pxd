# The stream-ordered upstream: device memory from a driver memory pool of its own.
from gpupool.upstream.driver cimport DriverUpstream

cdef class AsyncUpstream(DriverUpstream):
    cdef void* mempool            # CUmemoryPool of its own, created on the device
    cdef size_t threshold         # its release threshold in bytes
