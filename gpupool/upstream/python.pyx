# cython: language_level=3, boundscheck=False, wraparound=False
"""The Python upstream: every operation a Python method of a subclass, called with the GIL
(``gpupool.testing.SimulatedDevice`` is one).
"""
from libc.stdint cimport uintptr_t
from cuda.bindings.cydriver cimport (
    CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_NOT_READY, CUDA_ERROR_NOT_SUPPORTED,
)
from gpupool.driver.status cimport GP_PY_ERROR
from gpupool.upstream.base cimport CopyKind


cdef object _returned(Upstream upstream, str name, object value):
    """``value``, a PythonUpstream method's integer result, checked (a clear error instead of
    a float truncated to an address or a bare conversion error)."""
    if isinstance(value, bool) and name not in ("_event_query", "_stream_capturing") or \
            not hasattr(value, "__index__"):
        raise TypeError(f"{type(upstream).__name__}.{name} must return an int, got {value!r}")
    value = value.__index__()
    if not 0 <= value < 2**64:
        raise ValueError(f"{type(upstream).__name__}.{name} returned {value}, not an unsigned "
                         f"64-bit integer")
    return value


# The docstring opens with its signature, for inspect.signature (Note [Class signatures]).
cdef class PythonUpstream(Upstream):
    """PythonUpstream()
--

    An upstream whose operations are Python methods; subclass it to simulate a device.

    A subclass defines ``_alloc(nbytes) -> int`` (raise ``MemoryError`` when out of memory;
    ``_alloc(nbytes, stream)`` once ``_set_stream_ordered(True)``),
    ``_free(ptr)``, ``_event_create() -> int``, ``_event_destroy(event)``,
    ``_event_record(event, stream)``, ``_event_query(event) -> bool``,
    ``_stream_wait_event(stream, event)``, ``_synchronize()``,
    ``_copy(kind, dst, src, nbytes, stream)`` (kind: 1 host to device, 2 device to host,
    3 device to device, 4 device to ``_host_alloc``'s memory), ``_memset(dst, value, nbytes, stream)`` and
    ``_mem_info() -> (free, total)``, ``_stream_id(stream) -> int``, ``_trim()`` and
    ``_stream_capturing(stream) -> bool`` (optional: without it, never),
    ``_host_alloc(nbytes) -> int`` and ``_host_free(ptr)`` (optional: page-locked host memory
    for ``Pool.sleep``'s offload, kind 4 of ``_copy`` copies into it; without them the pool
    uses its own); an
    expandable one (``_set_expandable``) also ``_reserve() -> int``, ``_unreserve(va)``,
    ``_map(va, nbytes)`` (raise ``MemoryError`` when out of memory), ``_unmap(va,
    nbytes)`` and optionally ``_map_chunk(va, nbytes)`` (one physical allocation, unmapped
    only whole; without it ``_map``) and ``_chunks(va, nbytes) -> [(start, bytes)]`` (the
    chunks mapped in a range, for the pool's consistency check). Exceptions other than
    ``MemoryError`` reach the caller of the pool operation that made the call. An optional
    ``total_bytes`` attribute (int) declares the device's total memory: a pool reads it at
    creation, without calling ``_mem_info``, for its out-of-memory errors (a request above it
    can never fit).
    """

    def _set_device(self, device):
        """Set the device ordinal this upstream reports (for subclasses' ``__init__``); an
        impossible one raises as ``Pool(device=)`` does (``gpupool.driver.ordinals``)."""
        from gpupool.driver.ordinals import check_ordinal

        self.device = check_ordinal(device)

    def _set_stream_ordered(self, bint ordered):
        """Declare that ``_alloc(nbytes, stream)`` is ordered on ``stream`` (for subclasses)."""
        self.stream_ordered = ordered

    def _set_expandable(self, size_t granularity, size_t va_bytes):
        """Declare that memory comes as pages of ``granularity`` bytes mapped into ranges of
        ``va_bytes`` (``_reserve``, ``_map``, ``_unmap``, ``_unreserve``), for subclasses."""
        if granularity == 0 or granularity % 512 or va_bytes < granularity:
            raise ValueError("granularity must be a positive multiple of 512 B, no larger "
                             "than va_bytes")
        self.expandable = True
        self.granularity = granularity
        self.va_bytes = va_bytes

    def _set_host_accessible(self, bint accessible):
        """Declare that the memory ``_alloc`` returns is host memory (for subclasses): buffers
        then export DLPack as kDLCPU, so NumPy can read them."""
        self.host_accessible = accessible

    # Calls into the subclass's methods -------------------------------------------------

    cdef int _call(self, str name, tuple args, uintptr_t* out, size_t* out2) noexcept:
        # Runs with the GIL. out/out2 receive the method's integer result(s) when given.
        try:
            result = getattr(self, name)(*args)
            if out2 != NULL:
                first, second = result
                out[0] = _returned(self, name, first)
                out2[0] = _returned(self, name, second)
            elif out != NULL:
                out[0] = _returned(self, name, result)
                if out[0] == 0 and name in ("_alloc", "_reserve"):
                    raise ValueError(f"{type(self).__name__}.{name} returned address 0")
        except BaseException as exc:
            if isinstance(exc, MemoryError):
                return CUDA_ERROR_OUT_OF_MEMORY
            self.pending_error = exc
            return GP_PY_ERROR
        return 0

    cdef void clear_error(self) noexcept nogil:
        with gil:
            self.pending_error = None

    # The memory source ----------------------------------------------------------------

    cdef int alloc(self, size_t nbytes, uintptr_t stream, uintptr_t* ptr) noexcept nogil:
        with gil:
            if self.stream_ordered:
                return self._call("_alloc", (nbytes, stream), ptr, NULL)
            return self._call("_alloc", (nbytes,), ptr, NULL)

    cdef int free(self, uintptr_t ptr) noexcept nogil:
        with gil:
            return self._call("_free", (ptr,), NULL, NULL)

    cdef int trim(self) noexcept nogil:
        with gil:
            if not hasattr(self, "_trim"):
                return 0
            return self._call("_trim", (), NULL, NULL)

    cdef int reserve(self, uintptr_t* va) noexcept nogil:
        with gil:
            return self._call("_reserve", (), va, NULL)

    cdef int unreserve(self, uintptr_t va) noexcept nogil:
        with gil:
            return self._call("_unreserve", (va,), NULL, NULL)

    cdef int map(self, uintptr_t va, size_t nbytes) noexcept nogil:
        with gil:
            return self._call("_map", (va, nbytes), NULL, NULL)

    cdef int map_chunk(self, uintptr_t va, size_t nbytes) noexcept nogil:
        with gil:
            if not hasattr(self, "_map_chunk"):
                return self._call("_map", (va, nbytes), NULL, NULL)
            return self._call("_map_chunk", (va, nbytes), NULL, NULL)

    cdef int unmap(self, uintptr_t va, size_t nbytes) noexcept nogil:
        with gil:
            return self._call("_unmap", (va, nbytes), NULL, NULL)

    # Device work: events, stream waits, copies, device queries -----------------------

    cdef int event_create(self, uintptr_t* event) noexcept nogil:
        with gil:
            return self._call("_event_create", (), event, NULL)

    cdef int event_destroy(self, uintptr_t event) noexcept nogil:
        with gil:
            return self._call("_event_destroy", (event,), NULL, NULL)

    cdef int event_record(self, uintptr_t event, uintptr_t stream) noexcept nogil:
        with gil:
            return self._call("_event_record", (event, stream), NULL, NULL)

    cdef int event_query(self, uintptr_t event) noexcept nogil:
        cdef uintptr_t done = 0
        cdef int r
        with gil:
            r = self._call("_event_query", (event,), &done, NULL)
        if r == 0 and not done:
            return CUDA_ERROR_NOT_READY
        return r

    cdef int stream_wait(self, uintptr_t stream, uintptr_t event) noexcept nogil:
        with gil:
            return self._call("_stream_wait_event", (stream, event), NULL, NULL)

    cdef int synchronize(self) noexcept nogil:
        with gil:
            return self._call("_synchronize", (), NULL, NULL)

    cdef int copy(self, CopyKind kind, uintptr_t dst, uintptr_t src, size_t nbytes,
                  uintptr_t stream) noexcept nogil:
        with gil:
            return self._call("_copy", (<int>kind, dst, src, nbytes, stream), NULL, NULL)

    cdef int memset(self, uintptr_t dst, unsigned char value, size_t nbytes,
                    uintptr_t stream) noexcept nogil:
        with gil:
            return self._call("_memset", (dst, value, nbytes, stream), NULL, NULL)

    cdef int host_alloc(self, size_t nbytes, uintptr_t* ptr) noexcept nogil:
        with gil:
            if not hasattr(self, "_host_alloc"):
                return CUDA_ERROR_NOT_SUPPORTED
            return self._call("_host_alloc", (nbytes,), ptr, NULL)

    cdef int host_free(self, uintptr_t ptr) noexcept nogil:
        with gil:
            if not hasattr(self, "_host_free"):
                return CUDA_ERROR_NOT_SUPPORTED
            return self._call("_host_free", (ptr,), NULL, NULL)

    cdef int mem_info(self, size_t* free, size_t* total) noexcept nogil:
        cdef uintptr_t f = 0
        with gil:
            r = self._call("_mem_info", (), &f, total)
        free[0] = f
        return r

    cdef int stream_id(self, uintptr_t stream, unsigned long long* out) noexcept nogil:
        cdef uintptr_t sid = 0
        cdef int r = 0
        with gil:
            if hasattr(self, "_stream_id"):
                # On failure the exception stays pending: an allocation raises it
                # (Pool.check_stream); a free keys the stream by its handle alone and
                # clears it (resolve_free).
                r = self._call("_stream_id", (stream,), &sid, NULL)
        out[0] = sid if r == 0 else 0
        return r

    cdef int stream_capturing(self, uintptr_t stream, bint* out) noexcept nogil:
        cdef uintptr_t answer = 0
        cdef int r = 0
        with gil:
            if hasattr(self, "_stream_capturing"):
                r = self._call("_stream_capturing", (stream,), &answer, NULL)
        out[0] = r != 0 or answer != 0
        return r
