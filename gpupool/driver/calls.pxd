# Checked wrappers over the CUDA driver API (cuda.bindings.cydriver).
#
# Each wrapper returns the CUresult and never raises, so it can run without the GIL on the
# pool's hot path; cydriver raises a Python exception when libcuda or a symbol is missing, and
# the wrappers turn that into GP_NO_DRIVER instead of letting a noexcept caller swallow it
# as CUDA_SUCCESS (the trap in docs/design.md's build notes). check() raises from a result.
from libc.stdint cimport uintptr_t
from cuda.bindings.cydriver cimport (
    CUresult, CUdeviceptr, CUstream, CUevent, CUcontext, CUdevice, CUmemoryPool,
    CUmemGenericAllocationHandle, CUipcMemHandle, CUipcEventHandle,
)

from gpupool.driver.status cimport GP_NO_DRIVER, GP_FORKED

cdef CUresult init() noexcept nogil
cdef CUresult device_count(int* count) noexcept nogil
cdef CUresult device_get(CUdevice* dev, int ordinal) noexcept nogil
cdef CUresult primary_ctx_retain(CUcontext* ctx, CUdevice dev) noexcept nogil
cdef CUresult primary_ctx_release(CUdevice dev) noexcept nogil
cdef CUresult ctx_get_current(CUcontext* ctx) noexcept nogil
cdef CUresult ctx_set_current(CUcontext ctx) noexcept nogil
cdef CUresult ctx_get_device(CUdevice* dev) noexcept nogil
cdef CUresult ctx_synchronize() noexcept nogil
cdef CUresult mem_alloc(CUdeviceptr* ptr, size_t nbytes) noexcept nogil
cdef CUresult mem_free(CUdeviceptr ptr) noexcept nogil
cdef CUresult mem_get_info(size_t* free, size_t* total) noexcept nogil
cdef CUresult memcpy_htod(CUdeviceptr dst, const void* src, size_t n, CUstream s) noexcept nogil
cdef CUresult memcpy_dtoh(void* dst, CUdeviceptr src, size_t n, CUstream s) noexcept nogil
cdef CUresult mem_host_alloc(void** ptr, size_t nbytes) noexcept nogil
cdef CUresult mem_free_host(void* ptr) noexcept nogil
cdef CUresult memcpy_dtod(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) noexcept nogil
cdef CUresult memset_d8(CUdeviceptr dst, unsigned char value, size_t n, CUstream s) noexcept nogil
cdef CUresult stream_synchronize(CUstream s) noexcept nogil
cdef CUresult stream_wait_event(CUstream s, CUevent e) noexcept nogil
cdef CUresult event_create(CUevent* e) noexcept nogil
cdef CUresult event_destroy(CUevent e) noexcept nogil
cdef CUresult event_record(CUevent e, CUstream s) noexcept nogil
cdef CUresult event_query(CUevent e) noexcept nogil
cdef CUresult stream_get_id(CUstream s, unsigned long long* stream_id) noexcept nogil
cdef CUresult stream_is_capturing(CUstream s, bint* capturing) noexcept nogil
# The calling thread's stream capture mode made relaxed (relaxed=True: the mode it had goes to
# saved) or put back (relaxed=False: saved's), as PyTorch's allocator does around cudaMalloc in
# a capture: its calls are then no "potentially unsafe" calls that invalidate one.
cdef CUresult relaxed_capture(bint relaxed, int* saved) noexcept nogil
cdef CUresult mem_pool_create(CUmemoryPool* pool, int device) noexcept nogil
cdef CUresult mem_pool_destroy(CUmemoryPool pool) noexcept nogil
cdef CUresult mem_pool_set_release_threshold(CUmemoryPool pool, size_t nbytes) noexcept nogil
cdef CUresult mem_pool_trim_to(CUmemoryPool pool, size_t keep) noexcept nogil
cdef CUresult mem_alloc_from_pool(CUdeviceptr* ptr, size_t nbytes, CUmemoryPool pool,
                                  CUstream s) noexcept nogil
cdef CUresult mem_free_async(CUdeviceptr ptr, CUstream s) noexcept nogil
cdef CUresult device_total_mem(size_t* nbytes, CUdevice dev) noexcept nogil
cdef CUresult device_attribute(int* value, int attribute, CUdevice dev) noexcept nogil
cdef CUresult device_uuid(unsigned char* uuid16, CUdevice dev) noexcept nogil
# The virtual memory API. Memory made shareable is requested with the POSIX file descriptor
# handle type (cuMemCreate), so it can be exported for IPC (cuMemExportToShareableHandle).
cdef CUresult vmm_granularity(size_t* nbytes, int device, bint shareable) noexcept nogil
cdef CUresult vmm_reserve(CUdeviceptr* va, size_t nbytes) noexcept nogil
cdef CUresult vmm_free_range(CUdeviceptr va, size_t nbytes) noexcept nogil
cdef CUresult vmm_create(CUmemGenericAllocationHandle* handle, size_t nbytes, int device,
                         bint shareable) noexcept nogil
cdef CUresult vmm_export_fd(int* fd, CUmemGenericAllocationHandle handle) noexcept nogil
cdef CUresult vmm_import_fd(CUmemGenericAllocationHandle* handle, int fd) noexcept nogil
cdef CUresult vmm_release(CUmemGenericAllocationHandle handle) noexcept nogil
cdef CUresult vmm_map(CUdeviceptr va, size_t nbytes,
                      CUmemGenericAllocationHandle handle) noexcept nogil
cdef CUresult vmm_unmap(CUdeviceptr va, size_t nbytes) noexcept nogil
cdef CUresult vmm_set_access(CUdeviceptr va, size_t nbytes, int device) noexcept nogil
# CUDA IPC: memory handles of cuMemAlloc allocations and events made for IPC.
cdef CUresult mem_address_range(CUdeviceptr* base, size_t* size, CUdeviceptr ptr) noexcept nogil
cdef CUresult ipc_get_mem_handle(CUipcMemHandle* handle, CUdeviceptr base) noexcept nogil
cdef CUresult ipc_open_mem_handle(CUdeviceptr* ptr, CUipcMemHandle handle) noexcept nogil
cdef CUresult ipc_close_mem_handle(CUdeviceptr ptr) noexcept nogil
cdef CUresult ipc_event_create(CUevent* e) noexcept nogil
cdef CUresult ipc_get_event_handle(CUipcEventHandle* handle, CUevent e) noexcept nogil
cdef CUresult ipc_open_event_handle(CUevent* e, CUipcEventHandle handle) noexcept nogil

cdef int check(CUresult result, str what) except -1

# Whether this process is a child of a fork() made after its parent used gpupool (made a pool
# or initialized the driver: mark_used()): CUDA state does not cross fork(), so nothing
# inherited may touch the driver and no pool may be made; init() returns GP_FORKED and check()
# raises GpupoolError with the fork message. fork_flag() is the flag itself (nonzero once
# forked), for modules that read it on their hot path (FORKED = fork_flag()).
cdef bint forked() noexcept nogil
cdef const int* fork_flag() noexcept nogil
cdef void mark_used() noexcept nogil
