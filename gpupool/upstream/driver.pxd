# The driver upstream: device memory from cuMemAlloc / cuMemFree on one device's primary
# context; the base of the other driver upstreams (mempool, vmm).
from gpupool.upstream.driver_ipc cimport DriverIpc

cdef class DriverUpstream(DriverIpc):
    pass
