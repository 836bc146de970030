# cython: language_level=3, boundscheck=False, wraparound=False
"""A device's primary context and the driver's device work on it: events, stream waits,
copies, page-locked host memory, memory queries and stream identity. The driver upstreams
derive from it and add a memory source (``gpupool.upstream.driver``, ``mempool``, ``vmm``).

Every call runs with the device's primary context current and restores the caller's, so a
block freed on another thread, or with another device current, goes back with its own context.
"""
from libc.stdint cimport uintptr_t
from cuda.bindings.cydriver cimport (
    CUresult, CUcontext, CUdevice, CUstream, CUevent, CUdeviceptr, CUDA_SUCCESS,
)
from gpupool.driver cimport calls as drv
from gpupool.upstream.base cimport CopyKind, HOST_TO_DEVICE, DEVICE_TO_HOST, DEVICE_TO_PINNED

# Per thread, the stream ID last seen for a few stream handles (see DriverDevice.stream_id).
cdef extern from *:
    """
    #define GP_ID_CACHE 16
    struct gp_id_entry { uintptr_t handle; unsigned long long id; };
    static thread_local gp_id_entry gp_id_cache[GP_ID_CACHE];
    """
    int GP_ID_CACHE
    struct gp_id_entry:
        uintptr_t handle
        unsigned long long id
    gp_id_entry gp_id_cache[]


cdef class DriverDevice(Upstream):
    """One device's primary context, retained, and the driver's events, stream waits and
    copies on it; the base of the driver upstreams (whose docstrings give the parameter and
    what it raises), not used directly."""

    def __cinit__(self, device=0, *args, **kwargs):
        from gpupool.driver.ordinals import check_ordinal

        cdef CUdevice dev
        cdef CUcontext ctx
        cdef int count = 0
        device = check_ordinal(device)      # before cuInit, as Pool(device=) checks it
        drv.check(drv.init(), "cuInit")
        drv.check(drv.device_count(&count), "cuDeviceGetCount")
        if device >= count:
            from gpupool.errors import NoDeviceError
            raise NoDeviceError(f"no CUDA device {device}: this machine has {count}")
        drv.check(drv.device_get(&dev, device), "cuDeviceGet")
        drv.check(drv.primary_ctx_retain(&ctx, dev), "cuDevicePrimaryCtxRetain")
        self.ctx = <void*>ctx
        self.retained = 1
        self.device = device

    def __dealloc__(self):
        # At interpreter shutdown the driver may already be gone: the result is ignored.
        if self.retained:
            drv.primary_ctx_release(<CUdevice>self.device)

    # Each call that needs a context runs with ours current and restores the caller's.
    # A call runs only once ours is current: `r if r else self.restore_current(prev, call)`.
    cdef int make_current(self, void** previous) noexcept nogil:
        cdef CUresult r = drv.ctx_get_current(<CUcontext*>previous)
        if r != CUDA_SUCCESS:
            return r
        if previous[0] != self.ctx:
            return drv.ctx_set_current(<CUcontext>self.ctx)
        return 0

    cdef int restore_current(self, void* previous, int result) noexcept nogil:
        cdef CUresult r = CUDA_SUCCESS
        if previous != self.ctx:
            r = drv.ctx_set_current(<CUcontext>previous)
        return result if result != 0 else r

    # Device work ----------------------------------------------------------------------

    cdef int event_create(self, uintptr_t* event) noexcept nogil:
        cdef void* prev = NULL
        cdef CUevent e = NULL
        cdef int r = self.make_current(&prev)
        r = r if r else self.restore_current(prev, drv.event_create(&e))
        event[0] = <uintptr_t>e
        return r

    cdef int event_destroy(self, uintptr_t event) noexcept nogil:
        return drv.event_destroy(<CUevent>event)

    cdef int event_record(self, uintptr_t event, uintptr_t stream) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self.make_current(&prev)
        return r if r else self.restore_current(prev, drv.event_record(
                <CUevent>event, <CUstream>stream))

    cdef int event_query(self, uintptr_t event) noexcept nogil:
        return drv.event_query(<CUevent>event)

    cdef int stream_wait(self, uintptr_t stream, uintptr_t event) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self.make_current(&prev)
        return r if r else self.restore_current(prev, drv.stream_wait_event(
                <CUstream>stream, <CUevent>event))

    cdef int synchronize(self) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self.make_current(&prev)
        return r if r else self.restore_current(prev, drv.ctx_synchronize())

    cdef int copy(self, CopyKind kind, uintptr_t dst, uintptr_t src, size_t nbytes,
                  uintptr_t stream) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self.make_current(&prev)
        cdef CUstream s = <CUstream>stream
        if r != 0:
            return r
        if kind == HOST_TO_DEVICE:
            r = drv.memcpy_htod(<CUdeviceptr>dst, <const void*>src, nbytes, s)
        elif kind == DEVICE_TO_HOST:
            # Pageable destination: the copy has completed when the call returns, but the
            # stream is synchronized too, so pinned destinations are equally safe to read.
            r = drv.memcpy_dtoh(<void*>dst, <CUdeviceptr>src, nbytes, s)
            if r == 0:
                r = drv.stream_synchronize(s)
        elif kind == DEVICE_TO_PINNED:
            r = drv.memcpy_dtoh(<void*>dst, <CUdeviceptr>src, nbytes, s)     # (the caller waits)
        else:
            r = drv.memcpy_dtod(<CUdeviceptr>dst, <CUdeviceptr>src, nbytes, s)
        return self.restore_current(prev, r)

    cdef int host_alloc(self, size_t nbytes, uintptr_t* ptr) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self.make_current(&prev)
        return r if r else self.restore_current(prev, drv.mem_host_alloc(<void**>ptr, nbytes))

    cdef int host_free(self, uintptr_t ptr) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self.make_current(&prev)
        return r if r else self.restore_current(prev, drv.mem_free_host(<void*>ptr))

    cdef int memset(self, uintptr_t dst, unsigned char value, size_t nbytes,
                    uintptr_t stream) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self.make_current(&prev)
        return r if r else self.restore_current(prev, drv.memset_d8(
                <CUdeviceptr>dst, value, nbytes, <CUstream>stream))

    cdef int mem_info(self, size_t* free, size_t* total) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self.make_current(&prev)
        return r if r else self.restore_current(prev, drv.mem_get_info(free, total))

    cdef int stream_capturing(self, uintptr_t stream, bint* out) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self.make_current(&prev)
        out[0] = True
        return r if r else self.restore_current(prev, drv.stream_is_capturing(
                <CUstream>stream, out))

    cdef int stream_id(self, uintptr_t stream, unsigned long long* out) noexcept nogil:
        # cuStreamGetId on a stream being captured into a graph fails and invalidates the
        # capture; a stream being captured is alive, so the ID this thread last saw for the
        # handle is still its ID (0, unknown, when there is none).
        cdef bint capturing = False
        cdef int r = drv.stream_is_capturing(<CUstream>stream, &capturing)
        cdef int slot = <int>((stream >> 4) % GP_ID_CACHE)
        out[0] = 0
        if r != 0:
            return r
        if capturing:
            if gp_id_cache[slot].handle == stream:
                out[0] = gp_id_cache[slot].id
            return 0
        r = drv.stream_get_id(<CUstream>stream, out)
        if r != 0:
            out[0] = 0
            return r
        gp_id_cache[slot].handle = stream
        gp_id_cache[slot].id = out[0]
        return 0
