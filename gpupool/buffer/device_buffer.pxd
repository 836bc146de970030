# DeviceBuffer: the framework-neutral holder of one block of device memory, from a BlockOwner
# (buffer/owner.pxd: a Pool).
from libc.stdint cimport uintptr_t
from gpupool.records.block cimport Block
from gpupool.records.ipcslot cimport gp_ipc_slot
from gpupool.records.streams cimport StreamKey
from gpupool.buffer.owner cimport BlockOwner

cdef enum BufferState:
    OPEN = 0
    CLOSED = 1
    INVALIDATED = 2

cdef class DeviceBuffer:
    cdef Block* _blk
    cdef readonly BlockOwner pool
    cdef uintptr_t _ptr
    cdef size_t _nbytes
    cdef StreamKey _stream
    cdef BufferState _state
    cdef object _exporter           # the exporter of wrapped memory (as_buffer); None if ours
    cdef DeviceBuffer _base         # a wrapper's: the gpupool buffer holding the memory
    cdef gp_ipc_slot* _ipc_slot     # exported for CUDA IPC (ipc/export.pyx): retired with the block
    cdef object __weakref__

    cdef uintptr_t _live_ptr(self) except? 0
    cdef void invalidate_locked(self) noexcept
    cdef int _order_before(self, uintptr_t consumer) except -1
    cdef uintptr_t _work_stream(self, object stream) except? 0xFFFFFFFFFFFFFFFF
    cdef int _used_on(self, uintptr_t handle) except -1
    cdef void _ipc_retired(self) noexcept nogil
    cdef void _give_back(self) noexcept

cdef DeviceBuffer new_buffer(BlockOwner pool, Block* blk, size_t nbytes, StreamKey stream)


cdef inline uintptr_t awake_ptr(DeviceBuffer buf) except? 0:
    """buf's pointer for a use of its bytes (a copy, a memset, an export): as _live_ptr,
    and SleepingMemoryError while its memory sleeps (Pool.sleep; its pointer stays valid)."""
    cdef uintptr_t ptr = buf._live_ptr()
    cdef DeviceBuffer base = buf if buf._blk != NULL else buf._base
    if base is not None and base._blk != NULL and base.pool.block_asleep(base._blk):
        from gpupool.errors import SleepingMemoryError
        raise SleepingMemoryError(
            f"the buffer's memory ({base._nbytes} B at {ptr:#x}) sleeps (Pool.sleep): call "
            f"pool.wake(...) for its tag before using its contents")
    return ptr
