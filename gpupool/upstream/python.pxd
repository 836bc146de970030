# The Python upstream: every operation a Python method of a subclass.
from libc.stdint cimport uintptr_t

from gpupool.upstream.base cimport Upstream

cdef class PythonUpstream(Upstream):
    cdef int _call(self, str name, tuple args, uintptr_t* out, size_t* out2) noexcept
    cdef void clear_error(self) noexcept nogil
