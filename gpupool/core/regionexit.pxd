# A region's exit, as the pool runs it under its lock (Pool.region_exit): what becomes of the
# region's buffers still alive (core/regioncache.pxd keeps the region's blocks).
from libc.stdint cimport uintptr_t
from libcpp.pair cimport pair
from libcpp.vector cimport vector
from gpupool.records.block cimport Block
from gpupool.records.streams cimport BY_HANDLE, stream_key
from gpupool.buffer.device_buffer cimport DeviceBuffer
from gpupool.core.regioncache cimport RegionCache, rc_detach, rc_escape, rc_live_blocks
from gpupool.core.free cimport ps_free_locked
from gpupool.core.state cimport PoolState
from gpupool.upstream.base cimport Upstream


cdef inline size_t rg_exit(PoolState* st, Upstream up, RegionCache* rc, set kept, bint detach,
                           int poison, list escaping, int* status):
    """The exit of region rc, under the pool's lock: its live blocks that escaped an
    earlier exit stay escaped; those in kept (block addresses), or being freed (their
    buffer let go of them and waits for the lock: DeviceBuffer.close), leave the region;
    with detach, or without a buffer, they escape (pointers appended to escaping); the others'
    buffers are invalidated and their blocks freed, on the buffer's stream, or, with
    poison >= 0, filled with that byte on the legacy stream once the device is idle (so
    the block now belongs to that stream; its bytes are read first: a freed block may
    join a neighbour). Returns the bytes of the region's live blocks at exit; the
    poisoning's status goes to status."""
    cdef vector[Block*] live
    cdef vector[pair[uintptr_t, size_t]] poisoned
    cdef Block* b
    cdef DeviceBuffer buf
    cdef size_t i, escaped = 0
    cdef int r = 0
    rc_live_blocks(rc, &live)
    for i in range(live.size()):
        b = live[i]
        if b.region.escaped:
            escaping.append(b.ptr)                  # escaped an earlier exit
        elif <uintptr_t>b in kept:
            rc_detach(b)
        elif b.holder != NULL and (<DeviceBuffer>b.holder)._blk != b:
            rc_detach(b)        # its buffer let it go and waits for this lock to free it
        elif detach or b.holder == NULL:
            escaping.append(b.ptr)
            rc_escape(b)
        else:
            escaped += b.size
            buf = <DeviceBuffer>b.holder
            buf.invalidate_locked()
            if poison >= 0:
                poisoned.push_back(pair[uintptr_t, size_t](b.ptr, b.size))
                ps_free_locked(st, up, b, stream_key(0, BY_HANDLE))
            else:
                ps_free_locked(st, up, b, buf._stream)
    escaped += rc.escaped_bytes
    if not poisoned.empty():
        r = up.synchronize()
        for i in range(poisoned.size()):
            if r == 0:
                r = up.memset(poisoned[i].first, poison, poisoned[i].second, 0)
    status[0] = r
    return escaped
