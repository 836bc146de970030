# gpupool's status codes, declared from their one definition (include/gpupool_status.h).
cdef extern from "gpupool_status.h" nogil:
    enum:
        GPUPOOL_OK
        GPUPOOL_ERROR_INVALID_VALUE
        GPUPOOL_ERROR_OUT_OF_MEMORY
        GPUPOOL_ERROR_NO_DEVICE
        GPUPOOL_ERROR_FORKED
        GPUPOOL_ERROR_INTERNAL
        GPUPOOL_ERROR_ASLEEP
        GP_NO_DRIVER
        GP_PY_ERROR
        GP_REENTRANT
        GP_RECORDED
        GP_ASLEEP
        GP_FORKED
