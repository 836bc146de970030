# DeviceBuffer: the framework-neutral owner of one block of device memory.
from libc.stdint cimport uintptr_t
from gpupool._block cimport Block, StreamKey
from gpupool._pool cimport Pool

cdef enum BufferState:
    OPEN = 0
    CLOSED = 1
    INVALIDATED = 2

cdef class DeviceBuffer:
    cdef Block* _blk
    cdef readonly Pool pool
    cdef uintptr_t _ptr
    cdef readonly size_t nbytes
    cdef StreamKey _stream
    cdef BufferState _state
    cdef object _owner              # the exporter of wrapped memory (as_buffer); None if ours
    cdef object __weakref__

    cdef uintptr_t _live_ptr(self) except? 0
    cdef void invalidate_locked(self) noexcept
