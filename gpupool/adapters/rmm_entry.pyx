# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled part of ``gpupool.rmm``: the allocate and deallocate functions an
``rmm.mr.CallbackMemoryResource`` calls, over the C API's pointer-level allocate and free of
one pool (``c_api/table.pxd``).

RMM is neither cimported nor imported here (it is optional). RMM calls ``allocate(nbytes,
stream)`` and ``deallocate(ptr, nbytes, stream)`` with the GIL held and a fresh
``rmm.pylibrmm.stream.Stream`` each time; the stream's handle comes from its
``__cuda_stream__``. The bound methods are what RMM keeps, so a call is a vectorcall into
compiled code with no interpreted Python of gpupool's in between.
"""
from libc.stdint cimport uintptr_t
from cuda.bindings.cydriver cimport CUDA_ERROR_OUT_OF_MEMORY
from gpupool.c_api.table cimport pool_allocate, pool_free, capi_error_string
from gpupool.core.pool cimport Pool, asleep_here
from gpupool.driver.status cimport GPUPOOL_OK, GPUPOOL_ERROR_ASLEEP
from gpupool.records.streams cimport stream_handle

from gpupool.errors import GpupoolError, OutOfMemoryError


cdef class RmmCallbacks:
    """The two functions of an RMM callback resource over ``pool``: blocks handed out by
    pointer, as the C API hands them out, so they count in the pool's statistics, regions
    cache them and snapshots show them.

    Parameters
    ----------
    pool : gpupool.Pool
        The pool every allocation comes from.
    """

    cdef readonly Pool pool

    def __init__(self, Pool pool not None):
        self.pool = pool

    def allocate(self, size_t nbytes, stream):
        """Allocate ``nbytes`` (bytes) for use on ``stream``.

        Parameters
        ----------
        nbytes : int
            Bytes, >= 0. Zero gives the null pointer without touching the pool.
        stream : rmm.pylibrmm.stream.Stream, int or stream object
            The stream the memory is used on (anything ``Pool.allocate`` takes as a stream);
            the block is ready for work submitted to it.

        Returns
        -------
        int
            The pointer, aligned to 256 bytes at least (RMM's ``CUDA_ALLOCATION_ALIGNMENT``).

        Raises
        ------
        gpupool.OutOfMemoryError
            No memory after the pool's out-of-memory ladder and ``on_oom`` callbacks (a
            ``MemoryError``: RMM turns it into ``rmm::out_of_memory``, which Python sees as a
            ``MemoryError`` with this message); counted in the pool's ``num_ooms``.
        gpupool.SleepingMemoryError
            The calling thread's tag (``gpupool.tag``) sleeps (``Pool.sleep``).
        gpupool.GpupoolError
            Any other failure: an absurd size, a stream the driver refuses, a driver error, a
            pool inherited through ``fork()``.
        TypeError, ValueError
            ``stream`` is not a stream (``Pool.allocate``'s rules).
        """
        cdef void* ptr = NULL
        cdef uintptr_t handle = stream_handle(stream)
        cdef int status
        if nbytes == 0:
            return 0
        status = pool_allocate(self.pool, nbytes, handle, &ptr)
        if status != GPUPOOL_OK:
            raise self._failure(status, nbytes)
        return <uintptr_t>ptr

    def deallocate(self, uintptr_t ptr, size_t nbytes, stream):
        """Free the block at ``ptr`` (from :meth:`allocate`) as last used on ``stream``: it is
        taken again on ``stream`` at once, on another stream once ``stream``'s work so far is
        done.

        Parameters
        ----------
        ptr : int
            The pointer :meth:`allocate` returned; 0 does nothing.
        nbytes : int
            The size asked for (unused: the pool knows the block's size).
        stream : rmm.pylibrmm.stream.Stream, int or stream object
            The stream the memory was last used on.

        Notes
        -----
        Never raises: RMM calls this from C++ that cannot pass an exception on, so a failure
        (``ptr`` not a live block of this pool's handed out by pointer, a pool inherited
        through ``fork()``, ``stream`` not a stream) goes to ``sys.unraisablehook`` as a
        ``gpupool.GpupoolError`` (or the stream's ``TypeError``/``ValueError``).
        """
        cdef int status
        try:
            status = pool_free(self.pool, <void*>ptr, stream_handle(stream))
            if status != GPUPOOL_OK:
                raise GpupoolError(
                    f"gpupool: freeing {nbytes} B at {ptr:#x} for RMM failed: "
                    f"{capi_error_string(status).decode()} (status {status})")
        except Exception as e:
            _unraisable(e)

    cdef object _failure(self, int status, size_t nbytes):
        if status == CUDA_ERROR_OUT_OF_MEMORY:
            return OutOfMemoryError(self.pool.oom_failure(nbytes))
        if status == GPUPOOL_ERROR_ASLEEP:
            return asleep_here()                # names the calling thread's tag
        return GpupoolError(
            f"gpupool: allocating {nbytes} B for RMM on device {self.pool.device} failed: "
            f"{capi_error_string(status).decode()} (status {status})")

    def __repr__(self):
        return f"<gpupool.rmm callbacks over {self.pool!r}>"


cdef void _unraisable(object error) noexcept:
    """Hand error to ``sys.unraisablehook`` (Cython writes what a noexcept function raises)."""
    raise error
