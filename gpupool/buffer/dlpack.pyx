# cython: language_level=3, boundscheck=False, wraparound=False
"""DLPack capsules: made for gpupool's buffers and views, read from other libraries' exports.

Follows the DLPack Python specification (``__dlpack__`` / ``__dlpack_device__``, the capsule
names ``"dltensor"`` and ``"dltensor_versioned"``, and the renaming to ``"used_..."`` by a
consumer that takes the tensor).
"""
from cpython.pycapsule cimport PyCapsule_New, PyCapsule_IsValid, PyCapsule_GetPointer
from cpython.ref cimport Py_INCREF, Py_DECREF
from libc.stdlib cimport malloc, free

#: DLPack type codes (``DLDataTypeCode``) by NumPy dtype kind.
TYPE_CODES = {"i": KDL_INT, "u": KDL_UINT, "f": KDL_FLOAT, "c": KDL_COMPLEX, "b": KDL_BOOL}


# The manager context is the keeper (a strong reference) and the shape lives in the same
# allocation as the tensor, so the deleter frees one block and drops one reference. A deleter
# may run without the GIL (a consumer's C code), so it takes it.
cdef void _delete_legacy(DLManagedTensor* tensor) noexcept nogil:
    with gil:
        Py_DECREF(<object>tensor.manager_ctx)
    free(tensor)


cdef void _delete_versioned(DLManagedTensorVersioned* tensor) noexcept nogil:
    with gil:
        Py_DECREF(<object>tensor.manager_ctx)
    free(tensor)


cdef void _capsule_legacy(object capsule) noexcept:
    # Still named "dltensor": no consumer took it, so the producer deletes it.
    if PyCapsule_IsValid(capsule, b"dltensor"):
        tensor = <DLManagedTensor*>PyCapsule_GetPointer(capsule, b"dltensor")
        tensor.deleter(tensor)


cdef void _capsule_versioned(object capsule) noexcept:
    if PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        tensor = <DLManagedTensorVersioned*>PyCapsule_GetPointer(capsule, b"dltensor_versioned")
        tensor.deleter(tensor)


cdef void _fill(DLTensor* t, void* storage, uintptr_t ptr, int device_type, int device_id,
                int code, int bits, tuple shape, tuple strides) noexcept:
    """Describe the memory; shape and strides (in elements, or None) are written to storage,
    the end of the same allocation."""
    cdef int64_t* dims = <int64_t*>storage
    cdef Py_ssize_t i, ndim = len(shape)
    t.data = <void*>ptr
    t.device.device_type = device_type
    t.device.device_id = device_id
    t.ndim = <int32_t>ndim
    t.dtype.code = code
    t.dtype.bits = bits
    t.dtype.lanes = 1
    for i in range(ndim):
        dims[i] = shape[i]
        if strides is not None:
            dims[ndim + i] = strides[i]
    t.shape = dims
    t.strides = dims + ndim if strides is not None else NULL
    t.byte_offset = 0


cdef object make_capsule(object keeper, uintptr_t ptr, int device_type, int device_id, int code,
                         int bits, tuple shape, tuple strides, bint versioned):
    """A DLPack capsule over ``shape`` elements of (type ``code``, ``bits``) at ``ptr``
    (strides in elements, or None: C-contiguous); ``keeper`` stays alive until the consumer's
    deleter runs. ``versioned``: a ``"dltensor_versioned"`` capsule (DLPack 1.x), else the
    legacy ``"dltensor"``. The shape and strides follow the managed tensor in one
    allocation."""
    cdef size_t extra = 2 * len(shape) * sizeof(int64_t)
    cdef DLManagedTensor* legacy = NULL
    cdef DLManagedTensorVersioned* tensor = NULL
    cdef void* memory
    cdef DLTensor* t
    cdef void* storage
    if versioned:
        memory = tensor = <DLManagedTensorVersioned*>malloc(sizeof(tensor[0]) + extra)
    else:
        memory = legacy = <DLManagedTensor*>malloc(sizeof(legacy[0]) + extra)
    if memory == NULL:
        raise MemoryError()
    if versioned:
        tensor.version.major = DLPACK_MAJOR
        tensor.version.minor = DLPACK_MINOR
        tensor.flags = 0
        tensor.manager_ctx = <void*>keeper
        tensor.deleter = _delete_versioned
        t, storage = &tensor.dl_tensor, <void*>(tensor + 1)
    else:
        legacy.manager_ctx = <void*>keeper
        legacy.deleter = _delete_legacy
        t, storage = &legacy.dl_tensor, <void*>(legacy + 1)
    _fill(t, storage, ptr, device_type, device_id, code, bits, shape, strides)
    Py_INCREF(keeper)
    if versioned:
        return PyCapsule_New(memory, b"dltensor_versioned", _capsule_versioned)
    return PyCapsule_New(memory, b"dltensor", _capsule_legacy)


cdef uintptr_t capsule_data(object capsule) except? 0:
    """The data pointer (plus byte offset) of an unconsumed capsule of either name, or 0 for
    a tensor of no elements, whose pointer is not read (DLPack lets it be anything); the
    capsule is left to its own destructor."""
    cdef DLTensor* t
    cdef int32_t i
    if PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        t = &(<DLManagedTensorVersioned*>PyCapsule_GetPointer(
            capsule, b"dltensor_versioned")).dl_tensor
    elif PyCapsule_IsValid(capsule, b"dltensor"):
        t = &(<DLManagedTensor*>PyCapsule_GetPointer(capsule, b"dltensor")).dl_tensor
    else:
        raise TypeError("__dlpack__() did not return a DLPack capsule")
    for i in range(t.ndim):
        if t.shape[i] == 0:
            return 0
    return <uintptr_t>t.data + t.byte_offset
