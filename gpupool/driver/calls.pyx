# cython: language_level=3, boundscheck=False, wraparound=False
"""Checked wrappers over the CUDA driver API, through ``cuda.bindings.cydriver``.

Nothing links against libcuda: cydriver loads it on the first call and raises a Python
``RuntimeError`` when it cannot. The wrappers call cydriver through a function pointer typed
``noexcept`` and look for that pending exception only when the result is cydriver's error
sentinel (CUDA_ERROR_NOT_FOUND), so the common path costs one indirect call and no GIL.
"""
from cpython.exc cimport PyErr_Occurred, PyErr_Clear
from libc.string cimport memset
from cuda.bindings cimport cydriver
from cuda.bindings.cydriver cimport CUDA_SUCCESS, CUDA_ERROR_NOT_FOUND

from gpupool.errors import FORK_MESSAGE, CudaError, GpupoolError, NoDeviceError

cdef extern from "<pthread.h>" nogil:
    int pthread_atfork(void (*prepare)() noexcept, void (*parent)() noexcept,
                       void (*child)() noexcept)

# Fork detection. A process that made a pool or initialized the driver is "used"; a fork()
# child of a used process is "forked": CUDA state does not cross fork(), so nothing it
# inherited may touch the driver, and no pool may be made there. A child of a process that
# only imported gpupool is neither, and uses gpupool as any process does.
cdef extern from *:
    """
    static int gp_used = 0;
    static int gp_forked = 0;
    static int gp_fork_child = 0;
    static void gp_on_fork_child(void) {
        gp_fork_child = 1;
        if (gp_used) gp_forked = 1;
    }
    """
    int gp_used
    int gp_forked
    int gp_fork_child
    void gp_on_fork_child() noexcept nogil

pthread_atfork(NULL, NULL, gp_on_fork_child)


cdef bint forked() noexcept nogil:
    return gp_forked != 0


cdef const int* fork_flag() noexcept nogil:
    return &gp_forked


cdef void mark_used() noexcept nogil:
    global gp_used
    gp_used = 1

ctypedef CUresult (*fn_u)(unsigned int) noexcept nogil
ctypedef CUresult (*fn_pi)(int*) noexcept nogil
ctypedef CUresult (*fn_dev_get)(CUdevice*, int) noexcept nogil
ctypedef CUresult (*fn_ctx_retain)(CUcontext*, CUdevice) noexcept nogil
ctypedef CUresult (*fn_dev)(CUdevice) noexcept nogil
ctypedef CUresult (*fn_pctx)(CUcontext*) noexcept nogil
ctypedef CUresult (*fn_ctx)(CUcontext) noexcept nogil
ctypedef CUresult (*fn_pdev)(CUdevice*) noexcept nogil
ctypedef CUresult (*fn_void)() noexcept nogil
ctypedef CUresult (*fn_alloc)(CUdeviceptr*, size_t) noexcept nogil
ctypedef CUresult (*fn_free)(CUdeviceptr) noexcept nogil
ctypedef CUresult (*fn_info)(size_t*, size_t*) noexcept nogil
ctypedef CUresult (*fn_htod)(CUdeviceptr, const void*, size_t, CUstream) noexcept nogil
ctypedef CUresult (*fn_dtoh)(void*, CUdeviceptr, size_t, CUstream) noexcept nogil
ctypedef CUresult (*fn_dtod)(CUdeviceptr, CUdeviceptr, size_t, CUstream) noexcept nogil
ctypedef CUresult (*fn_host_alloc)(void**, size_t, unsigned int) noexcept nogil
ctypedef CUresult (*fn_host_free)(void*) noexcept nogil
ctypedef CUresult (*fn_memset)(CUdeviceptr, unsigned char, size_t, CUstream) noexcept nogil
ctypedef CUresult (*fn_stream)(CUstream) noexcept nogil
ctypedef CUresult (*fn_wait)(CUstream, CUevent, unsigned int) noexcept nogil
ctypedef CUresult (*fn_event_create)(CUevent*, unsigned int) noexcept nogil
ctypedef CUresult (*fn_event)(CUevent) noexcept nogil
ctypedef CUresult (*fn_record)(CUevent, CUstream) noexcept nogil
ctypedef CUresult (*fn_name)(CUresult, const char**) noexcept nogil
ctypedef CUresult (*fn_stream_id)(CUstream, unsigned long long*) noexcept nogil
ctypedef CUresult (*fn_capturing)(CUstream, cydriver.CUstreamCaptureStatus*) noexcept nogil
ctypedef CUresult (*fn_mode)(cydriver.CUstreamCaptureMode*) noexcept nogil
ctypedef CUresult (*fn_pool_create)(CUmemoryPool*, const cydriver.CUmemPoolProps*) noexcept nogil
ctypedef CUresult (*fn_pool)(CUmemoryPool) noexcept nogil
ctypedef CUresult (*fn_pool_set)(CUmemoryPool, cydriver.CUmemPool_attribute, void*) noexcept nogil
ctypedef CUresult (*fn_pool_trim)(CUmemoryPool, size_t) noexcept nogil
ctypedef CUresult (*fn_pool_alloc)(CUdeviceptr*, size_t, CUmemoryPool, CUstream) noexcept nogil
ctypedef CUresult (*fn_free_async)(CUdeviceptr, CUstream) noexcept nogil
ctypedef CUresult (*fn_total_mem)(size_t*, CUdevice) noexcept nogil
ctypedef CUresult (*fn_granularity)(size_t*, const cydriver.CUmemAllocationProp*,
                                    cydriver.CUmemAllocationGranularity_flags) noexcept nogil
ctypedef CUresult (*fn_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                                unsigned long long) noexcept nogil
ctypedef CUresult (*fn_range)(CUdeviceptr, size_t) noexcept nogil
ctypedef CUresult (*fn_create)(CUmemGenericAllocationHandle*, size_t,
                               const cydriver.CUmemAllocationProp*,
                               unsigned long long) noexcept nogil
ctypedef CUresult (*fn_release)(CUmemGenericAllocationHandle) noexcept nogil
ctypedef CUresult (*fn_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                            unsigned long long) noexcept nogil
ctypedef CUresult (*fn_access)(CUdeviceptr, size_t, const cydriver.CUmemAccessDesc*,
                               size_t) noexcept nogil
ctypedef CUresult (*fn_attribute)(int*, cydriver.CUdevice_attribute, CUdevice) noexcept nogil
ctypedef CUresult (*fn_uuid)(cydriver.CUuuid*, CUdevice) noexcept nogil
ctypedef CUresult (*fn_export)(void*, CUmemGenericAllocationHandle,
                               cydriver.CUmemAllocationHandleType,
                               unsigned long long) noexcept nogil
ctypedef CUresult (*fn_import)(CUmemGenericAllocationHandle*, void*,
                               cydriver.CUmemAllocationHandleType) noexcept nogil
ctypedef CUresult (*fn_address_range)(CUdeviceptr*, size_t*, CUdeviceptr) noexcept nogil
ctypedef CUresult (*fn_ipc_get_mem)(cydriver.CUipcMemHandle*, CUdeviceptr) noexcept nogil
ctypedef CUresult (*fn_ipc_open_mem)(CUdeviceptr*, cydriver.CUipcMemHandle,
                                     unsigned int) noexcept nogil
ctypedef CUresult (*fn_ipc_get_event)(cydriver.CUipcEventHandle*, CUevent) noexcept nogil
ctypedef CUresult (*fn_ipc_open_event)(CUevent*, cydriver.CUipcEventHandle) noexcept nogil


cdef inline CUresult _result(CUresult r) noexcept nogil:
    # cydriver returns CUDA_ERROR_NOT_FOUND with a Python exception set when libcuda or the
    # symbol is missing; a real CUDA_ERROR_NOT_FOUND from the driver has none.
    if r == CUDA_ERROR_NOT_FOUND:
        with gil:
            if PyErr_Occurred() != NULL:
                PyErr_Clear()
                return <CUresult>GP_NO_DRIVER
    return r


cdef CUresult init() noexcept nogil:
    # A forked child never calls cuInit (GP_FORKED, which check() raises with the fork
    # message); in a fork child whose parent initialized CUDA through another library,
    # cuInit's CUDA_ERROR_NOT_INITIALIZED means the same.
    cdef CUresult r
    if gp_forked:
        return <CUresult>GP_FORKED
    r = _result((<fn_u>cydriver.cuInit)(0))
    if r == CUDA_SUCCESS:
        mark_used()
    elif r == cydriver.CUDA_ERROR_NOT_INITIALIZED and gp_fork_child:
        return <CUresult>GP_FORKED
    return r

cdef CUresult device_count(int* count) noexcept nogil:
    return _result((<fn_pi>cydriver.cuDeviceGetCount)(count))

cdef CUresult device_get(CUdevice* dev, int ordinal) noexcept nogil:
    return _result((<fn_dev_get>cydriver.cuDeviceGet)(dev, ordinal))

cdef CUresult primary_ctx_retain(CUcontext* ctx, CUdevice dev) noexcept nogil:
    return _result((<fn_ctx_retain>cydriver.cuDevicePrimaryCtxRetain)(ctx, dev))

cdef CUresult primary_ctx_release(CUdevice dev) noexcept nogil:
    # An upstream inherited through fork() dies without a driver call (at the child's exit).
    if gp_forked:
        return <CUresult>GP_FORKED
    return _result((<fn_dev>cydriver.cuDevicePrimaryCtxRelease)(dev))

cdef CUresult ctx_get_current(CUcontext* ctx) noexcept nogil:
    return _result((<fn_pctx>cydriver.cuCtxGetCurrent)(ctx))

cdef CUresult ctx_set_current(CUcontext ctx) noexcept nogil:
    return _result((<fn_ctx>cydriver.cuCtxSetCurrent)(ctx))

cdef CUresult ctx_get_device(CUdevice* dev) noexcept nogil:
    return _result((<fn_pdev>cydriver.cuCtxGetDevice)(dev))

cdef CUresult ctx_synchronize() noexcept nogil:
    return _result((<fn_void>cydriver.cuCtxSynchronize)())

cdef CUresult mem_alloc(CUdeviceptr* ptr, size_t nbytes) noexcept nogil:
    return _result((<fn_alloc>cydriver.cuMemAlloc)(ptr, nbytes))

cdef CUresult mem_free(CUdeviceptr ptr) noexcept nogil:
    return _result((<fn_free>cydriver.cuMemFree)(ptr))

cdef CUresult mem_get_info(size_t* free, size_t* total) noexcept nogil:
    return _result((<fn_info>cydriver.cuMemGetInfo)(free, total))

cdef CUresult memcpy_htod(CUdeviceptr dst, const void* src, size_t n, CUstream s) noexcept nogil:
    return _result((<fn_htod>cydriver.cuMemcpyHtoDAsync)(dst, src, n, s))

cdef CUresult memcpy_dtoh(void* dst, CUdeviceptr src, size_t n, CUstream s) noexcept nogil:
    return _result((<fn_dtoh>cydriver.cuMemcpyDtoHAsync)(dst, src, n, s))

cdef CUresult mem_host_alloc(void** ptr, size_t nbytes) noexcept nogil:
    """Page-locked host memory of the current context (cuMemHostAlloc, no flags)."""
    return _result((<fn_host_alloc>cydriver.cuMemHostAlloc)(ptr, nbytes, 0))

cdef CUresult mem_free_host(void* ptr) noexcept nogil:
    return _result((<fn_host_free>cydriver.cuMemFreeHost)(ptr))

cdef CUresult memcpy_dtod(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) noexcept nogil:
    return _result((<fn_dtod>cydriver.cuMemcpyDtoDAsync)(dst, src, n, s))

cdef CUresult memset_d8(CUdeviceptr dst, unsigned char value, size_t n, CUstream s) noexcept nogil:
    return _result((<fn_memset>cydriver.cuMemsetD8Async)(dst, value, n, s))

cdef CUresult stream_synchronize(CUstream s) noexcept nogil:
    return _result((<fn_stream>cydriver.cuStreamSynchronize)(s))

cdef CUresult stream_wait_event(CUstream s, CUevent e) noexcept nogil:
    return _result((<fn_wait>cydriver.cuStreamWaitEvent)(s, e, 0))

cdef CUresult event_create(CUevent* e) noexcept nogil:
    return _result((<fn_event_create>cydriver.cuEventCreate)(e, cydriver.CU_EVENT_DISABLE_TIMING))

cdef CUresult event_destroy(CUevent e) noexcept nogil:
    return _result((<fn_event>cydriver.cuEventDestroy)(e))

cdef CUresult event_record(CUevent e, CUstream s) noexcept nogil:
    return _result((<fn_record>cydriver.cuEventRecord)(e, s))

cdef CUresult event_query(CUevent e) noexcept nogil:
    return _result((<fn_event>cydriver.cuEventQuery)(e))

cdef CUresult stream_get_id(CUstream s, unsigned long long* stream_id) noexcept nogil:
    return _result((<fn_stream_id>cydriver.cuStreamGetId)(s, stream_id))

cdef CUresult stream_is_capturing(CUstream s, bint* capturing) noexcept nogil:
    cdef cydriver.CUstreamCaptureStatus status = cydriver.CU_STREAM_CAPTURE_STATUS_NONE
    cdef CUresult r = _result((<fn_capturing>cydriver.cuStreamIsCapturing)(s, &status))
    capturing[0] = status != cydriver.CU_STREAM_CAPTURE_STATUS_NONE
    return r

cdef CUresult relaxed_capture(bint relaxed, int* saved) noexcept nogil:
    cdef cydriver.CUstreamCaptureMode mode = (
        cydriver.CU_STREAM_CAPTURE_MODE_RELAXED if relaxed
        else <cydriver.CUstreamCaptureMode>saved[0])
    cdef CUresult r = _result((<fn_mode>cydriver.cuThreadExchangeStreamCaptureMode)(&mode))
    if relaxed:
        saved[0] = <int>mode
    return r

cdef CUresult mem_pool_create(CUmemoryPool* pool, int device) noexcept nogil:
    # A device-local pool of ordinary (pinned, non-exportable) device memory.
    cdef cydriver.CUmemPoolProps props
    memset(&props, 0, sizeof(props))
    props.allocType = cydriver.CU_MEM_ALLOCATION_TYPE_PINNED
    props.handleTypes = cydriver.CU_MEM_HANDLE_TYPE_NONE
    props.location.type = cydriver.CU_MEM_LOCATION_TYPE_DEVICE
    props.location.id = device
    return _result((<fn_pool_create>cydriver.cuMemPoolCreate)(pool, &props))

cdef CUresult mem_pool_destroy(CUmemoryPool pool) noexcept nogil:
    if gp_forked:
        return <CUresult>GP_FORKED
    return _result((<fn_pool>cydriver.cuMemPoolDestroy)(pool))

cdef CUresult mem_pool_set_release_threshold(CUmemoryPool pool, size_t nbytes) noexcept nogil:
    cdef cydriver.cuuint64_t value = nbytes
    return _result((<fn_pool_set>cydriver.cuMemPoolSetAttribute)(
        pool, cydriver.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &value))

cdef CUresult mem_pool_trim_to(CUmemoryPool pool, size_t keep) noexcept nogil:
    return _result((<fn_pool_trim>cydriver.cuMemPoolTrimTo)(pool, keep))

cdef CUresult mem_alloc_from_pool(CUdeviceptr* ptr, size_t nbytes, CUmemoryPool pool,
                                  CUstream s) noexcept nogil:
    return _result((<fn_pool_alloc>cydriver.cuMemAllocFromPoolAsync)(ptr, nbytes, pool, s))

cdef CUresult mem_free_async(CUdeviceptr ptr, CUstream s) noexcept nogil:
    return _result((<fn_free_async>cydriver.cuMemFreeAsync)(ptr, s))


cdef CUresult device_total_mem(size_t* nbytes, CUdevice dev) noexcept nogil:
    return _result((<fn_total_mem>cydriver.cuDeviceTotalMem)(nbytes, dev))


cdef CUresult device_attribute(int* value, int attribute, CUdevice dev) noexcept nogil:
    return _result((<fn_attribute>cydriver.cuDeviceGetAttribute)(
        value, <cydriver.CUdevice_attribute>attribute, dev))


cdef CUresult device_uuid(unsigned char* uuid16, CUdevice dev) noexcept nogil:
    cdef cydriver.CUuuid uuid
    cdef int i
    cdef CUresult r = _result((<fn_uuid>cydriver.cuDeviceGetUuid)(&uuid, dev))
    for i in range(16):
        uuid16[i] = <unsigned char>uuid.bytes[i] if r == CUDA_SUCCESS else 0
    return r


cdef void _vmm_prop(cydriver.CUmemAllocationProp* prop, int device, bint shareable) noexcept nogil:
    # Pinned device memory of `device`; shareable: exportable as a POSIX file descriptor.
    memset(prop, 0, sizeof(prop[0]))
    prop.type = cydriver.CU_MEM_ALLOCATION_TYPE_PINNED
    if shareable:
        prop.requestedHandleTypes = cydriver.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    else:
        prop.requestedHandleTypes = cydriver.CU_MEM_HANDLE_TYPE_NONE
    prop.location.type = cydriver.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device


cdef CUresult vmm_granularity(size_t* nbytes, int device, bint shareable) noexcept nogil:
    cdef cydriver.CUmemAllocationProp prop
    _vmm_prop(&prop, device, shareable)
    return _result((<fn_granularity>cydriver.cuMemGetAllocationGranularity)(
        nbytes, &prop, cydriver.CU_MEM_ALLOC_GRANULARITY_MINIMUM))

cdef CUresult vmm_reserve(CUdeviceptr* va, size_t nbytes) noexcept nogil:
    return _result((<fn_reserve>cydriver.cuMemAddressReserve)(va, nbytes, 0, 0, 0))

cdef CUresult vmm_free_range(CUdeviceptr va, size_t nbytes) noexcept nogil:
    return _result((<fn_range>cydriver.cuMemAddressFree)(va, nbytes))

cdef CUresult vmm_create(CUmemGenericAllocationHandle* handle, size_t nbytes, int device,
                         bint shareable) noexcept nogil:
    cdef cydriver.CUmemAllocationProp prop
    _vmm_prop(&prop, device, shareable)
    return _result((<fn_create>cydriver.cuMemCreate)(handle, nbytes, &prop, 0))

cdef CUresult vmm_export_fd(int* fd, CUmemGenericAllocationHandle handle) noexcept nogil:
    return _result((<fn_export>cydriver.cuMemExportToShareableHandle)(
        <void*>fd, handle, cydriver.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0))

cdef CUresult vmm_import_fd(CUmemGenericAllocationHandle* handle, int fd) noexcept nogil:
    # For a POSIX file descriptor the driver takes the descriptor's value as the pointer.
    return _result((<fn_import>cydriver.cuMemImportFromShareableHandle)(
        handle, <void*><uintptr_t>fd, cydriver.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))

cdef CUresult vmm_release(CUmemGenericAllocationHandle handle) noexcept nogil:
    return _result((<fn_release>cydriver.cuMemRelease)(handle))

cdef CUresult vmm_map(CUdeviceptr va, size_t nbytes,
                      CUmemGenericAllocationHandle handle) noexcept nogil:
    return _result((<fn_map>cydriver.cuMemMap)(va, nbytes, 0, handle, 0))

cdef CUresult vmm_unmap(CUdeviceptr va, size_t nbytes) noexcept nogil:
    return _result((<fn_range>cydriver.cuMemUnmap)(va, nbytes))

cdef CUresult vmm_set_access(CUdeviceptr va, size_t nbytes, int device) noexcept nogil:
    cdef cydriver.CUmemAccessDesc desc
    desc.location.type = cydriver.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    desc.flags = cydriver.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return _result((<fn_access>cydriver.cuMemSetAccess)(va, nbytes, &desc, 1))


cdef CUresult mem_address_range(CUdeviceptr* base, size_t* size, CUdeviceptr ptr) noexcept nogil:
    return _result((<fn_address_range>cydriver.cuMemGetAddressRange)(base, size, ptr))

cdef CUresult ipc_get_mem_handle(CUipcMemHandle* handle, CUdeviceptr base) noexcept nogil:
    return _result((<fn_ipc_get_mem>cydriver.cuIpcGetMemHandle)(handle, base))

cdef CUresult ipc_open_mem_handle(CUdeviceptr* ptr, CUipcMemHandle handle) noexcept nogil:
    # Lazy peer access: the mapping works from any device that can reach this one.
    return _result((<fn_ipc_open_mem>cydriver.cuIpcOpenMemHandle)(
        ptr, handle, cydriver.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))

cdef CUresult ipc_close_mem_handle(CUdeviceptr ptr) noexcept nogil:
    if gp_forked:
        return <CUresult>GP_FORKED
    return _result((<fn_free>cydriver.cuIpcCloseMemHandle)(ptr))

cdef CUresult ipc_event_create(CUevent* e) noexcept nogil:
    # An event another process can wait on (cuIpcGetEventHandle needs both flags).
    return _result((<fn_event_create>cydriver.cuEventCreate)(
        e, cydriver.CU_EVENT_INTERPROCESS | cydriver.CU_EVENT_DISABLE_TIMING))

cdef CUresult ipc_get_event_handle(CUipcEventHandle* handle, CUevent e) noexcept nogil:
    return _result((<fn_ipc_get_event>cydriver.cuIpcGetEventHandle)(handle, e))

cdef CUresult ipc_open_event_handle(CUevent* e, CUipcEventHandle handle) noexcept nogil:
    return _result((<fn_ipc_open_event>cydriver.cuIpcOpenEventHandle)(e, handle))


cdef str _name(CUresult result):
    cdef const char* text = NULL
    if _result((<fn_name>cydriver.cuGetErrorName)(result, &text)) == CUDA_SUCCESS and text:
        return text.decode()
    return f"CUresult {<int>result}"


cdef str _description(CUresult result):
    cdef const char* text = NULL
    if _result((<fn_name>cydriver.cuGetErrorString)(result, &text)) == CUDA_SUCCESS and text:
        return text.decode()
    return "unknown error"


def error_name(int code):
    """Name of a ``CUresult`` code (``cuGetErrorName``), for messages."""
    if code == GP_NO_DRIVER:
        return "NO_DRIVER"
    return _name(<CUresult>code)


_SIMULATED = (
    "Without a GPU, use gpupool.testing.SimulatedDevice as the upstream: "
    "pool = gpupool.Pool(upstream=gpupool.testing.SimulatedDevice()), and "
    "gpupool.set_pool(pool) to make it the default pool (of gpupool.get_pool, "
    "gpupool.allocate, regions made without a pool, the adapters and the C API)")


cdef int check(CUresult result, str what) except -1:
    """Raise the exception for a driver result: nothing for CUDA_SUCCESS.

    Raises
    ------
    NoDeviceError
        libcuda could not be loaded, or there is no CUDA device.
    GpupoolError
        GP_FORKED: this process is a fork() child of one that used gpupool or CUDA.
    CudaError
        Any other failure, with the code, its name and ``what`` (the call that failed).
    """
    if result == CUDA_SUCCESS:
        return 0
    if result == GP_FORKED:
        raise GpupoolError(FORK_MESSAGE)
    if result == GP_NO_DRIVER:
        raise NoDeviceError(
            f"no CUDA driver: libcuda could not be loaded ({what}); gpupool needs an NVIDIA "
            f"driver. {_SIMULATED}")
    if result == cydriver.CUDA_ERROR_NO_DEVICE:
        raise NoDeviceError(f"{_name(result)}: {_description(result)} ({what}). {_SIMULATED}")
    if result == cydriver.CUDA_ERROR_INVALID_DEVICE:
        raise NoDeviceError(f"{_name(result)}: {_description(result)} ({what})")
    raise CudaError(<int>result, _name(result), f"{_description(result)} (in {what})")


def device_uuids():
    """The UUID (``cuDeviceGetUuid``, 16 bytes) of every device this process sees, by ordinal.

    Raises
    ------
    NoDeviceError
        No driver or no device.
    """
    cdef int count = 0, i
    cdef CUdevice dev = 0
    cdef unsigned char uuid[16]
    check(init(), "cuInit")
    check(device_count(&count), "cuDeviceGetCount")
    found = []
    for i in range(count):
        check(device_get(&dev, i), "cuDeviceGet")
        check(device_uuid(uuid, dev), "cuDeviceGetUuid")
        found.append(bytes(uuid[:16]))
    return found


def current_device():
    """Ordinal of the device of the calling thread's current context; 0 when there is none.

    Raises
    ------
    NoDeviceError
        No driver.
    """
    cdef CUcontext ctx = NULL
    cdef CUdevice dev = 0
    check(init(), "cuInit")
    check(ctx_get_current(&ctx), "cuCtxGetCurrent")
    if ctx == NULL:
        return 0
    check(ctx_get_device(&dev), "cuCtxGetDevice")
    return <int>dev
