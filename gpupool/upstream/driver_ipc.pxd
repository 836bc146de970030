# CUDA IPC on a device (mapping other processes' memory, interprocess events): the base of the
# driver upstreams, between the device's work and their memory source.
from gpupool.upstream.device cimport DriverDevice

cdef class DriverIpc(DriverDevice):
    pass
