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
#define GPUPOOL_API_VERSION 1      /* the ABI this header describes */
#endif
#define GPUPOOL_CAPSULE "gpupool._capi._C_API"

#include "gpupool_status.h"      /* GPUPOOL_OK and the error codes */

typedef struct gpupool_stats {
    size_t in_use_bytes, peak_in_use_bytes, reserved_bytes, peak_reserved_bytes, cached_bytes;
    size_t num_allocs, num_frees, cache_hits, cache_misses, upstream_allocs, upstream_frees;
    size_t oom_retries;
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
