/* gpupool's status codes: the one place they are defined.
 *
 * The public codes are what the C API (gpupool.h) returns; any other value it returns is a
 * CUresult from the driver. The internal codes travel between the core's layers (driver
 * wrappers, upstreams, pool) and are turned into Python exceptions or public codes before
 * they leave gpupool. Values above 100000 are clear of every CUresult.
 */
#ifndef GPUPOOL_STATUS_H
#define GPUPOOL_STATUS_H

enum {
    GPUPOOL_OK = 0,
    GPUPOOL_ERROR_INVALID_VALUE = 1,     /* bad size, or a pointer this API did not allocate */
    GPUPOOL_ERROR_OUT_OF_MEMORY = 2,     /* after the pool's out-of-memory ladder
                                            (the value of CUDA_ERROR_OUT_OF_MEMORY) */
    GPUPOOL_ERROR_NO_DEVICE = 100,       /* no driver, or no such device */
    GPUPOOL_ERROR_FORKED = 100003,       /* the pool was inherited through fork() */
    GPUPOOL_ERROR_INTERNAL = 100004,     /* anything else */
    GPUPOOL_ERROR_ASLEEP = 100005        /* the calling thread's tag (gpupool.tag) sleeps
                                            (Pool.sleep): wake it before allocating with it */
};

/* Internal: never returned by the C API (GP_FORKED is GPUPOOL_ERROR_FORKED, GP_ASLEEP is
 * GPUPOOL_ERROR_ASLEEP). */
enum {
    GP_NO_DRIVER = 100000,               /* libcuda or a driver symbol could not be loaded */
    GP_PY_ERROR = 100001,                /* a Python upstream raised; the exception is kept */
    GP_REENTRANT = 100002,               /* the pool was entered again by its lock's holder */
    GP_RECORDED = 100006,                /* a C API request that starts a planned region's
                                            record step, handed back undone: the C API makes
                                            it again and runs the region's slow path */
    GP_ASLEEP = GPUPOOL_ERROR_ASLEEP,    /* a request with a tag whose memory sleeps */
    GP_FORKED = GPUPOOL_ERROR_FORKED
};

#endif /* GPUPOOL_STATUS_H */
