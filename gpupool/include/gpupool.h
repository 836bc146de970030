/* gpupool C API: allocate from gpupool's pools from C, C++ or Cython, without the GIL.
 *
 *   #include <gpupool.h>          (include folder: gpupool.get_include())
 *   const gpupool_api* api = gpupool_import();   // once, with the GIL; NULL + exception on error
 *   void* ptr;
 *   int err = api->allocate(device, nbytes, (uintptr_t)stream, &ptr);   // any thread, no GIL
 *   ...
 *   api->free(device, ptr, (uintptr_t)stream);   // stream of last use
 *
 * Allocations come from the same pool as Python's (gpupool.get_pool(device)); made on a thread
 * inside `with region:`, they are cached by that region. Functions never throw and return
 * GPUPOOL_OK (0) or an error code; error_string(code) describes it. Streams are CUstream
 * handles as integers (0: the legacy default stream). Pointers are 256-byte aligned.
 */
#ifndef GPUPOOL_H
#define GPUPOOL_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#ifndef GPUPOOL_API_VERSION
#define GPUPOOL_API_VERSION 2      /* the ABI this header describes; 2 added the functions
                                      after error_string and the stats after oom_retries */
#endif
#define GPUPOOL_CAPSULE "gpupool._capi._C_API"

#include "gpupool_status.h"      /* GPUPOOL_OK and the error codes */

typedef struct gpupool_stats {
    size_t in_use_bytes, peak_in_use_bytes, reserved_bytes, peak_reserved_bytes, cached_bytes;
    size_t num_allocs, num_frees, cache_hits, cache_misses, upstream_allocs, upstream_frees;
    size_t oom_retries, num_ooms;    /* retries after the pool's ladder; failed allocations */
    size_t allocated_bytes, freed_bytes;   /* cumulative bytes handed out and given back */
} gpupool_stats;

typedef struct gpupool_api {
    unsigned int version;                /* GPUPOOL_API_VERSION of the library */
    unsigned int size;                   /* sizeof(gpupool_api) of the library */
    /* nbytes > 0 on `device` for work on `stream`; *ptr receives the device pointer. */
    int (*allocate)(int device, size_t nbytes, uintptr_t stream, void** ptr);
    /* Give back memory from allocate(); `stream`: the stream it was last used on. */
    int (*free)(int device, void* ptr, uintptr_t stream);
    /* The memory is used on `stream` too: reuse waits for that stream's work. */
    int (*record_stream)(int device, void* ptr, uintptr_t stream);
    int (*get_stats)(int device, gpupool_stats* out);
    const char* (*error_string)(int code);

    /* Version 2. */
    /* free() without the stream: the block is taken back as last used on the stream it was
     * allocated on; looked up in `device`'s pool first, then in the other devices' pools. */
    int (*free_ptr)(int device, void* ptr);
    /* Give the pool's cached memory back to the upstream (Pool.trim()); *released: bytes. */
    int (*trim)(int device, size_t* released);
    /* The peaks of bytes in use and reserved become their current values. */
    int (*reset_peaks)(int device);
    /* *largest: bytes of the largest free block the pool can hand out without growing;
     * *headroom: bytes it may still reserve under its hard limit (SIZE_MAX without one). */
    int (*cache_info)(int device, size_t* largest, size_t* headroom);
    /* The upstream allocation (segment) holding ptr, from allocate(): its base and bytes. */
    int (*base_allocation)(int device, void* ptr, uintptr_t* base, size_t* nbytes);

    /* Private pools: memory held for one user (a CUDA graph's private memory pool). Memory
     * allocated through a private pool comes from the device's pool, and once freed (free()
     * or free_ptr(), as any other) it stays the private pool's: no other request gets it,
     * and neither trims nor the out-of-memory ladder give it back, until private_destroy(),
     * so the addresses a captured graph baked in stay its own. */
    int (*private_new)(int device, void** pool);
    int (*private_allocate)(void* pool, size_t nbytes, uintptr_t stream, void** ptr);
    /* The private pool's live allocations: up to `capacity` pointers and sizes (bytes, as
     * held: nbytes rounded up to 512) in ptrs and sizes; *count: how many there are. */
    int (*private_live)(void* pool, uintptr_t* ptrs, size_t* sizes, size_t capacity,
                        size_t* count);
    /* Allocate exactly [ptr, ptr + nbytes) of the private pool's free memory (a live
     * allocation it held before, given again: PyTorch's checkpointed pool state); nbytes a
     * multiple of 512, as private_live() reports it. */
    int (*private_allocate_at)(void* pool, void* ptr, size_t nbytes, uintptr_t stream);
    /* Its free memory goes back to the device's pool; its live allocations return there when
     * freed. Only once the device's work on that memory is done (after a synchronize). */
    int (*private_destroy)(void* pool);
} gpupool_api;

/* Import the table (with the GIL held). Returns NULL with a Python exception set when gpupool
 * cannot be imported or its ABI version differs from this header's. */
static inline const gpupool_api* gpupool_import(void) {
    const gpupool_api* api = (const gpupool_api*)PyCapsule_Import(GPUPOOL_CAPSULE, 0);
    if (api == NULL)
        return NULL;
    if (api->version != GPUPOOL_API_VERSION || api->size < sizeof(gpupool_api)) {
        PyErr_Format(PyExc_ImportError,
                     "gpupool C API version %u (table of %u bytes) does not match this "
                     "extension's header, version %d (%u bytes): rebuild the extension "
                     "against the installed gpupool", api->version, api->size,
                     GPUPOOL_API_VERSION, (unsigned int)sizeof(gpupool_api));
        return NULL;
    }
    return api;
}

#endif /* GPUPOOL_H */
