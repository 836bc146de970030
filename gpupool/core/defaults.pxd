# The default pool of each device: the one registry, for Python (get_pool, set_pool) and for C
# code without the GIL (pool_of).
from cpython.ref cimport PyObject

cdef enum:
    MAX_DEVICES = 64            # device ordinals the C-level table covers

cdef PyObject* pool_of(int device) noexcept nogil
cdef PyObject** pool_table() noexcept nogil


cdef inline PyObject* default_pool(PyObject** table, int device) noexcept nogil:
    """pool_of(device), read from table (pool_table(), kept by the caller) when the pool is
    made already: no call on the hot path."""
    if 0 <= device < MAX_DEVICES and table[device] != NULL:
        return table[device]
    return pool_of(device)
cdef PyObject* registered_pool(int device) noexcept
