# DLPack (dlpack.h, version 1.1): the structures a consumer reads from a capsule, and the one
# place gpupool builds and reads them (buffer/dlpack.pyx).
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t

cdef struct DLDevice:
    int32_t device_type
    int32_t device_id

cdef struct DLDataType:
    uint8_t code
    uint8_t bits
    uint16_t lanes

cdef struct DLTensor:
    void* data
    DLDevice device
    int32_t ndim
    DLDataType dtype
    int64_t* shape
    int64_t* strides
    uint64_t byte_offset

cdef struct DLManagedTensor:
    DLTensor dl_tensor
    void* manager_ctx
    void (*deleter)(DLManagedTensor*) noexcept nogil

cdef struct DLPackVersion:
    uint32_t major
    uint32_t minor

cdef struct DLManagedTensorVersioned:
    DLPackVersion version
    void* manager_ctx
    void (*deleter)(DLManagedTensorVersioned*) noexcept nogil
    uint64_t flags
    DLTensor dl_tensor

cdef enum:
    DLPACK_MAJOR = 1
    DLPACK_MINOR = 1
    KDL_CPU = 1                 # DLDeviceType
    KDL_CUDA = 2
    KDL_INT = 0                 # DLDataTypeCode
    KDL_UINT = 1
    KDL_FLOAT = 2
    KDL_COMPLEX = 5
    KDL_BOOL = 6

cdef object make_capsule(object keeper, uintptr_t ptr, int device_type, int device_id, int code,
                         int bits, tuple shape, tuple strides, bint versioned)
cdef uintptr_t capsule_data(object capsule) except? 0
