# cython: language_level=3, boundscheck=False, wraparound=False
"""DeviceBuffer: one block of device memory, readable by any array library without a copy.

It exports the CUDA Array Interface (version 3) and DLPack (``buffer/dlpack.pyx``), and copies
to and from host memory on a stream. Its block goes back to what it was allocated from (its
``BlockOwner``: a pool, or the region in front of it) when its last reference goes or at close.
"""
from cpython.ref cimport PyObject
from libc.stdint cimport uintptr_t
from gpupool.records.block cimport Block
from gpupool.buffer.dlpack cimport make_capsule, KDL_CPU, KDL_CUDA, KDL_UINT, DLPACK_MAJOR
from gpupool.driver.calls cimport fork_flag
from gpupool.buffer.owner cimport BlockOwner
from gpupool.buffer.handoff cimport one_stream, order_after
from gpupool.records.ipcslot cimport gp_ipc_retire
from gpupool.records.streams cimport (
    StreamKey, STREAM_PER_THREAD, BY_HANDLE, current_thread, same_stream, stream_key, stream_handle,
)
from gpupool.upstream.base cimport HOST_TO_DEVICE, DEVICE_TO_HOST, DEVICE_TO_DEVICE

cimport cython

import numpy as np

from gpupool.errors import FORK_MESSAGE, GpupoolError, InvalidBufferError
from gpupool.buffer.hooks import ipc_exporter
from gpupool.buffer.host import host_bytes
from gpupool.buffer.interface import read_cai
from gpupool.buffer.pickling import reduce_buffer
from gpupool.buffer.view import BufferView, no_implicit_array

cdef const int* FORKED = fork_flag()


cdef DeviceBuffer new_buffer(BlockOwner pool, Block* blk, size_t nbytes, StreamKey stream):
    """A buffer holding blk (NULL: an empty buffer, pointer 0) of nbytes requested, for work
    on stream."""
    cdef DeviceBuffer buf = DeviceBuffer.__new__(DeviceBuffer)
    buf.pool = pool
    buf._blk = blk
    buf._nbytes = nbytes
    buf._stream = stream
    if blk != NULL:
        buf._ptr = blk.ptr
        blk.holder = <PyObject*>buf
    return buf


cdef inline object _cai_stream(uintptr_t handle):
    # CAI v3: 1 is the legacy default stream, 2 the per-thread default stream; 0 is not allowed.
    return 1 if handle == 0 else handle


# Not tracked by the garbage collector: a buffer refers only to its pool, which never refers
# back, and the collector's tp_clear would otherwise drop the pool before __dealloc__ runs.
@cython.no_gc
cdef class DeviceBuffer:
    """Device memory owned by a pool; made by ``Pool.allocate`` or ``gpupool.allocate``.

    Attributes
    ----------
    ptr : int
        Device pointer (256-byte aligned; 0 for an empty buffer).
    nbytes : int
        Size requested, in bytes (``len(buf)`` too).
    device : int
        Device ordinal.
    stream : int
        Handle of the stream the buffer is used on (0: legacy default stream). Assign a new
        handle or stream object when the buffer moves to another stream: its block is then
        reused on that stream without a wait, and on others only after that stream's work.
    pool : Pool
        The pool that owns the memory.

    ``ptr``, ``nbytes``, ``len(buf)`` and ``stream`` describe the memory: once the buffer is
    closed or invalidated they raise ``InvalidBufferError``; ``closed``, ``device``, ``pool``
    and ``bool(buf)`` still answer. ``bool(buf)``: whether it holds memory, never raising (as
    a truth value should): False for an empty buffer (as RMM's ``DeviceBuffer``, whose
    ``len`` is its size) and for a closed or invalidated one (or a wrapper of one).

    Notes
    -----
    A consumer's stream counts as a use of the memory, as if ``record_stream`` had been called
    with it: the stream of a DLPack export (``__dlpack__(stream=s)``, of the buffer or of a
    view), of a device-to-device copy reading the buffer (``copy_from_host``, ``copy``), and
    every stream an ``as_buffer`` wrapper of the buffer (or of a view) is used on (its stream,
    its exports, copies and memsets). Its block is then reused only after the consumer's work
    submitted before the free. The buffer's own copies and memsets on another stream are the
    caller's to order (``record_stream``), as in PyTorch.

    Pickling copies the bytes to host memory and back into a new buffer of
    ``gpupool.get_pool()`` (see ``__reduce_ex__``); ``copy.copy`` and ``copy.deepcopy`` give
    a device-to-device copy in the same pool (``copy()``).
    """

    def __init__(self, *args, **kwargs):
        raise TypeError("DeviceBuffer is made by Pool.allocate() or gpupool.allocate()")

    def __dealloc__(self):
        self._give_back()

    cdef void _give_back(self) noexcept:
        """The block back to its pool or region, once (never raises; not after fork())."""
        cdef Block* b = self._blk
        self._blk = NULL        # first: the free may wait for the lock without the GIL (rg_exit)
        if b != NULL and not FORKED[0]:
            self._ipc_retired()
            self.pool.free_block(b, self._stream)

    cdef void _ipc_retired(self) noexcept nogil:
        """The block goes back: a CUDA IPC handle of this buffer can no longer be opened (its
        export slot, in memory shared with the importers, says so)."""
        if self._ipc_slot != NULL:
            gp_ipc_retire(self._ipc_slot)
            self._ipc_slot = NULL

    cdef uintptr_t _live_ptr(self) except? 0:
        if FORKED[0]:
            raise GpupoolError(FORK_MESSAGE)    # the memory is the parent's: not mapped here
        if self._state == OPEN:
            if self._base is not None and self._base._state != OPEN:
                return self._base._live_ptr()       # a wrapper of memory given back: raises
            return self._ptr
        if self._state == CLOSED:
            raise InvalidBufferError("the buffer was closed; its memory went back to the pool")
        raise InvalidBufferError(
            "the buffer was invalidated when its region exited (on_exit='invalidate'); keep it "
            "with region.keep(buf), or allocate it under gpupool.uncached() to outlive the step")

    cdef void invalidate_locked(self) noexcept:
        """Mark the buffer invalid; the caller holds the pool's lock and frees the block."""
        self._state = INVALIDATED
        self._ipc_retired()
        self._blk = NULL

    @property
    def ptr(self):
        """Device pointer (``CUdeviceptr``) as an int; raises if closed or invalidated."""
        return self._live_ptr()

    @property
    def device(self):
        """Device ordinal of the memory."""
        return self.pool.device

    @property
    def closed(self):
        """True once the buffer was closed or invalidated."""
        return self._state != OPEN

    @property
    def nbytes(self):
        """Size requested, in bytes; raises ``InvalidBufferError`` if closed or invalidated."""
        self._live_ptr()
        return self._nbytes

    @property
    def stream(self):
        """Handle of the stream the buffer is used on (0: the legacy default stream); raises
        ``InvalidBufferError`` if closed or invalidated. For a wrapper (``as_buffer``) of a
        gpupool buffer, a new stream is a use of that buffer (``record_stream``)."""
        self._live_ptr()
        return self._stream.handle

    @stream.setter
    def stream(self, stream):
        cdef uintptr_t handle = stream_handle(stream)
        self._live_ptr()
        self._stream = self.pool.check_stream(handle)
        if self._blk == NULL:
            self._used_on(handle)

    @property
    def __cuda_array_interface__(self):
        """CUDA Array Interface v3: a 1-D ``|u1`` array of ``nbytes`` over the memory.

        ``stream`` is the buffer's stream (1 for the legacy default stream, 2 for the
        per-thread one), so consumers order their work after the producer's. Read on another
        thread than the one whose per-thread stream the buffer is on, 2 names the reader's
        own: that stream is first made to follow the buffer's (a GPU-side wait).
        """
        cdef uintptr_t ptr = awake_ptr(self)
        return {"shape": (self._nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                "strides": None, "stream": _cai_stream(self._work_stream(None))}

    def __dlpack_device__(self):
        """``(device_type, device_id)`` per the DLPack spec: ``(2, ordinal)`` (kDLCUDA), or
        ``(1, 0)`` (kDLCPU) for an upstream whose memory is host memory (the simulated
        device)."""
        if self.pool.upstream.host_accessible:
            return (KDL_CPU, 0)
        return (KDL_CUDA, self.pool.device)

    def __array__(self, dtype=None, copy=None):
        """Refused (TypeError): see ``gpupool.buffer.view.no_implicit_array``."""
        no_implicit_array(self, "buf.copy_to_host()")

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """Export the bytes as a DLPack capsule: a 1-D ``uint8`` tensor of ``nbytes``.

        Parameters
        ----------
        stream : int or None
            The consumer's stream (DLPack's convention for CUDA: 1 the legacy default stream,
            2 the per-thread one, -1 no synchronization, None the legacy default stream). The
            pool makes it wait on the buffer's stream (an event and ``cuStreamWaitEvent``), so
            the consumer's work runs after the producer's; the host does not wait (unless no
            event can be made: then the device is synchronized). The consumer's stream also
            counts as a use of the memory (``record_stream``): the block is reused only after
            the consumer's work submitted before the buffer's free. A buffer on another
            thread's per-thread stream is reached through the legacy default stream, which
            CUDA synchronizes with every per-thread stream.
        max_version : tuple of int, optional
            The highest DLPack version the consumer reads: ``(1, x)`` or later gives a
            versioned capsule ("dltensor_versioned"); None gives the legacy "dltensor".
        dl_device : tuple, optional
            Must be this buffer's ``__dlpack_device__()``.
        copy : bool, optional
            ``True`` is refused (gpupool exports without copying).

        Returns
        -------
        PyCapsule
            Keeps the buffer alive until the consumer's deleter runs; a capsule nobody
            consumed deletes itself when it dies. Follows the DLPack Python specification.

        Raises
        ------
        BufferError
            ``copy=True``, or another ``dl_device``.
        InvalidBufferError
            The buffer was closed or invalidated.
        """
        return self._export(self, KDL_UINT, 8, (self._nbytes,), None, stream=stream,
                            max_version=max_version, dl_device=dl_device, copy=copy)

    def _export(self, keeper, int code, int bits, tuple shape, tuple strides, *, stream,
                max_version, dl_device, copy):
        """The DLPack capsule of ``__dlpack__`` for this memory seen as ``shape`` elements of
        (DLPack type ``code``, ``bits``), strides in elements or None; ``keeper`` (this
        buffer or a view of it) stays alive until the deleter runs. No elements: pointer 0."""
        cdef uintptr_t ptr = awake_ptr(self)
        cdef uintptr_t handle
        device = self.__dlpack_device__()
        if copy:
            raise BufferError("gpupool exports DLPack without copying (copy=True refused)")
        if dl_device is not None and tuple(dl_device) != device:
            raise BufferError(f"the buffer is on DLPack device {device}, not {dl_device}")
        if max_version is not None and not (
                isinstance(max_version, tuple) and len(max_version) == 2
                and all(type(v) is int for v in max_version)):
            raise TypeError(f"max_version must be None or a (major, minor) tuple of ints, "
                            f"got {max_version!r}")
        consumer = 1 if stream is None else stream
        if consumer != -1:
            handle = 0 if consumer == 1 else stream_handle(consumer)
            self._order_before(handle)
            self._used_on(handle)
        return make_capsule(keeper, 0 if 0 in shape else ptr, device[0], device[1], code, bits,
                            shape, strides,
                            max_version is not None and max_version[0] >= DLPACK_MAJOR)

    def view(self, dtype, shape, strides=None):
        """This memory as an array of ``dtype`` and ``shape`` (no copy): a
        :class:`gpupool.buffer.view.BufferView` exporting the CUDA Array Interface and DLPack, which
        keeps the buffer alive. ``strides`` in bytes; default C-contiguous.

        Raises
        ------
        TypeError, ValueError
            As ``BufferView``: an unsupported dtype, a shape or strides that are not ints,
            or a view past ``nbytes``.
        InvalidBufferError
            The buffer was closed or invalidated.
        """
        self._live_ptr()
        return BufferView(self, dtype, shape, strides)

    cdef int _order_before(self, uintptr_t consumer) except -1:
        """Make stream handle consumer wait for the work queued so far on the buffer's stream
        (buffer/handoff.pxd); nothing for an empty buffer or for its own stream."""
        if self._nbytes and not one_stream(stream_key(consumer, BY_HANDLE), self._stream):
            order_after(self.pool.upstream, self._stream, consumer)
        return 0

    cdef uintptr_t _work_stream(self, object stream) except? 0xFFFFFFFFFFFFFFFF:
        """The handle of stream for work on the memory from the calling thread; None: the
        buffer's stream. Handle 2 for another thread's per-thread stream names this thread's
        here, so that one is first ordered after it."""
        if stream is not None:
            return stream_handle(stream)
        if self._stream.handle == STREAM_PER_THREAD and self._stream.tag != current_thread():
            self._order_before(STREAM_PER_THREAD)
        return self._stream.handle

    cdef int _used_on(self, uintptr_t handle) except -1:
        """Count work submitted to stream handle as a use of the memory (``record_stream``),
        once per stream; a wrapper passes it to the gpupool buffer it wraps, and foreign
        memory has no block to tell. Raises for a handle the driver refuses."""
        cdef DeviceBuffer base = self if self._blk != NULL else self._base
        cdef StreamKey key
        if base is None or base._blk == NULL:
            return 0
        key = base.pool.check_stream(handle)
        if not same_stream(key, base._stream):
            base.pool.add_stream(base._blk, key, <void*>base)   # once per stream (Pool.add_stream)
        return 0

    def record_stream(self, stream):
        """Mark the memory as used on another stream too.

        The block is then reused only once the work submitted to ``stream`` before the
        buffer's free has completed or is ordered before its next user (as
        ``torch.Tensor.record_stream``). An event is recorded on ``stream`` at the free, so
        ``stream`` must still exist then. A per-thread default stream is recorded as the
        legacy default stream, whose event covers it from any thread (the block may be freed
        on another). A wrapper (``as_buffer``) records it on the gpupool buffer it wraps.

        Parameters
        ----------
        stream : int, stream object or None
            See ``Pool.allocate``.

        Raises
        ------
        InvalidBufferError
            The buffer was closed or invalidated.
        CudaError
            A handle the driver refuses (not a stream, or destroyed).
        """
        cdef uintptr_t handle = stream_handle(stream)
        self._live_ptr()
        self._used_on(handle)

    def copy(self, stream=None):
        """A new buffer of the same pool holding a copy of these bytes, copied device to
        device (``cuMemcpyDtoDAsync``; ``copy.copy`` and ``copy.deepcopy`` call it).

        Parameters
        ----------
        stream : int, stream object or None
            The new buffer's stream, on which the copy runs (ordered after the work queued so
            far on this buffer's stream, which the copy counts as a use); default: this
            buffer's stream. The call does not wait for the copy.

        Returns
        -------
        DeviceBuffer
            Of ``nbytes``, owned by ``pool`` (the current region's, if one is entered).

        Raises
        ------
        InvalidBufferError
            The buffer was closed or invalidated.
        OutOfMemoryError
            As ``Pool.allocate``.
        """
        cdef uintptr_t handle = self._work_stream(stream)
        awake_ptr(self)
        out = self.pool.allocate(self._nbytes, stream=handle)
        out.copy_from_host(self)
        return out

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()

    def __reduce_ex__(self, protocol):
        """Pickle the bytes, never the device address: they are copied to host memory (on the
        buffer's stream, which is waited for), as an out-of-band ``pickle.PickleBuffer`` with
        protocol 5 or later, as ``bytes`` before. ``pickle.loads`` copies them into a new
        buffer of ``gpupool.get_pool()`` (the current device's default pool) on the legacy
        default stream.

        Raises
        ------
        InvalidBufferError
            The buffer was closed or invalidated.
        """
        awake_ptr(self)
        return reduce_buffer(self, protocol)

    def ipc_handle(self, stream=None):
        """A handle another process opens with ``gpupool.open_ipc`` to use this memory
        without a copy (CUDA IPC).

        Parameters
        ----------
        stream : int, stream object or None
            The stream whose work so far the importer waits for (an IPC event recorded on it:
            ``cuEventCreate`` with ``CU_EVENT_INTERPROCESS``, ``cuEventRecord``,
            ``cuIpcGetEventHandle``); default: the buffer's stream.

        Returns
        -------
        gpupool.IpcHandle
            Small and picklable: the driver's handle of the upstream allocation holding the
            block (``cuIpcGetMemHandle`` on upstream "driver"; on "vmm" one
            ``cuMemExportToShareableHandle`` file descriptor per page, which pass to the
            other process through ``multiprocessing`` queues and pipes), the block's offset
            in it, ``nbytes``, the device's ordinal and UUID and the event.

        Raises
        ------
        IpcError
            The memory cannot be exported: the pool's upstream has no IPC ("async", a
            simulated device made without ``shareable=True``; the message names the
            alternative), the buffer wraps memory that no block of its pool holds
            (``as_buffer`` of another library's memory), or it was itself opened from another
            process. (An ``as_buffer`` wrapper of gpupool memory, such as an array of the CuPy
            or PyTorch adapter, is exported while the wrapped array lives.)
        ValueError
            The buffer is empty.
        InvalidBufferError
            The buffer was closed or invalidated.

        Notes
        -----
        The exporter's rule, as in CUDA IPC and ``torch.multiprocessing``: keep this buffer
        alive, and do not write it, until every importer is done with the memory. The pool
        reuses the block once the buffer is given back; a handle opened after that raises
        ``IpcError`` (reason "released"). An upstream allocation that an importer holds open
        is not returned to the driver (``Pool.trim``, the out-of-memory ladder) until the
        importer closes it.
        """
        awake_ptr(self)
        return ipc_exporter()(self, stream)

    def close(self):
        """Give the memory back now (to the pool or its region). Later use raises
        ``InvalidBufferError``; closing again does nothing."""
        self._give_back()
        self._exporter = self._base = None
        if self._state == OPEN:
            self._state = CLOSED

    def __enter__(self):
        self._live_ptr()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __len__(self):
        self._live_ptr()
        return self._nbytes

    def __bool__(self):
        return self._nbytes != 0 and not (self.closed or self._base is not None
                                          and self._base.closed)

    def copy_from_host(self, src, stream=None):
        """Copy host memory (or another device buffer) into the start of this buffer.

        Parameters
        ----------
        src : numpy.ndarray, bytes-like, DeviceBuffer or CUDA Array Interface object
            Source of at most ``nbytes`` bytes: any object with the buffer protocol (a
            non-contiguous host array is first made contiguous), or a C-contiguous device
            array, copied device to device.
        stream : int, stream object or None
            Stream for the copy; default: the buffer's stream. The copy is ordered after
            earlier work on that stream, and a device source is read after the work queued so
            far on its own stream (a gpupool buffer's, or its CUDA Array Interface ``stream``):
            the copy counts as a use of a gpupool source (``record_stream``). Host sources can
            be reused when this returns (``cuMemcpyHtoDAsync`` with pageable memory,
            ``cuMemcpyDtoDAsync``). For a wrapper (``as_buffer``) of a gpupool buffer, the
            stream is a use of that buffer, whose pool cannot see it; a buffer's own copies on
            another stream are the caller's to order (``record_stream``), as in PyTorch.

        Raises
        ------
        TypeError
            The source has no buffer protocol (a list, a str, None) or holds Python objects.
        ValueError
            The source is larger than the buffer, or a non-contiguous device array.
        InvalidBufferError
            The buffer (or a gpupool source) was closed or invalidated.
        """
        cdef uintptr_t dst = awake_ptr(self)
        cdef uintptr_t s = self._work_stream(stream)
        cdef size_t n
        cai = read_cai(src)
        if cai is not None:
            if not cai.c_contiguous:
                raise ValueError("the device source must be C-contiguous")
            n = cai.nbytes
            kind, src_ptr = DEVICE_TO_DEVICE, cai.ptr
        else:
            keep = host_bytes(src)
            n = keep.nbytes
            kind, src_ptr = HOST_TO_DEVICE, keep.ctypes.data
        if n > self._nbytes:
            raise ValueError(f"source has {n} bytes, the buffer {self._nbytes}")
        if n:
            if self._blk == NULL:
                self._used_on(s)
            if cai is not None:
                hand_over(self.pool, src, cai.stream, s)
            self.pool.upstream.raise_error(
                self.pool.upstream.copy(kind, dst, src_ptr, n, s), "copy_from_host")

    def copy_to_host(self, out=None, stream=None):
        """Copy the buffer's bytes to host memory.

        Parameters
        ----------
        out : numpy.ndarray, optional
            Writable C-contiguous array of exactly ``nbytes`` bytes (any dtype); default: a
            new ``uint8`` array of shape ``(nbytes,)``.
        stream : int, stream object or None
            Stream for the copy; default: the buffer's stream. The call returns once the
            copy (and earlier work on that stream) has completed (``cuMemcpyDtoHAsync``
            followed by ``cuStreamSynchronize``).

        Returns
        -------
        numpy.ndarray
            ``out``, filled.
        """
        cdef uintptr_t src = awake_ptr(self)
        cdef uintptr_t s = self._work_stream(stream)
        if out is None:
            out = np.empty(self._nbytes, dtype=np.uint8)
        elif not isinstance(out, np.ndarray) or not out.flags.c_contiguous \
                or not out.flags.writeable:
            raise ValueError("out must be a writable C-contiguous numpy array")
        if out.nbytes != self._nbytes:
            raise ValueError(f"out has {out.nbytes} bytes, the buffer {self._nbytes}")
        if self._nbytes:
            self.pool.upstream.raise_error(
                self.pool.upstream.copy(DEVICE_TO_HOST, out.ctypes.data, src, self._nbytes, s),
                "copy_to_host")
        return out

    def memset(self, int value, stream=None):
        """Set every byte to ``value`` (0-255) on ``stream`` (default: the buffer's), ordered
        after earlier work on that stream (``cuMemsetD8Async``); does not wait for it. A
        wrapper's stream is a use of the gpupool buffer it wraps (as in ``copy_from_host``)."""
        cdef uintptr_t dst = awake_ptr(self)
        cdef uintptr_t s = self._work_stream(stream)
        if not 0 <= value <= 255:
            raise ValueError(f"value must be a byte (0-255), got {value}")
        if self._nbytes:
            if self._blk == NULL:
                self._used_on(s)
            self.pool.upstream.raise_error(
                self.pool.upstream.memset(dst, <unsigned char>value, self._nbytes, s), "memset")

    def __repr__(self):
        state = ("", " closed", " invalidated")[<int>self._state]
        return (f"<gpupool.DeviceBuffer ptr={self._ptr:#x} nbytes={self._nbytes} "
                f"device={self.pool.device} stream={self._stream.handle:#x}{state}>")


cdef DeviceBuffer _buffer_of(object obj):
    """The gpupool buffer behind obj (a DeviceBuffer, or a view's buffer), or None."""
    if isinstance(obj, BufferView):
        obj = obj.buffer
    return obj if isinstance(obj, DeviceBuffer) else None


cdef int hand_over(BlockOwner pool, object src, object producer,
                   uintptr_t consumer) except -1:
    """Order stream handle consumer after the work queued so far on the producer of src's
    memory, and count consumer's work as a use of it: for a gpupool buffer (or a view, or a
    wrapper), its own stream and block; for foreign memory, producer (its CUDA Array
    Interface's stream; None: nothing to order), through pool's upstream."""
    cdef DeviceBuffer buf = _buffer_of(src)
    cdef StreamKey key
    if buf is not None:
        buf._order_before(consumer)
        buf._used_on(consumer)
    elif producer is not None:
        key = stream_key(<uintptr_t>producer, BY_HANDLE)    # 1, the legacy stream, folds into 0
        if not one_stream(key, stream_key(consumer, BY_HANDLE)):
            order_after(pool.upstream, key, consumer)
    return 0


def wrap(BlockOwner pool, uintptr_t ptr, size_t nbytes, producer, consumer, exporter):
    """A non-owning DeviceBuffer over ``nbytes`` of ``exporter``'s memory at ``ptr``, for use
    on stream ``consumer`` (a stream argument), ordered after ``producer`` (the stream its
    CUDA Array Interface gives, or None) and, for memory of a gpupool buffer, counted as a use
    of it (as are the wrapper's later streams and exports); ``exporter`` is kept alive by it.
    For ``gpupool.as_buffer``."""
    cdef uintptr_t handle = stream_handle(consumer)
    cdef DeviceBuffer source = _buffer_of(exporter)
    cdef DeviceBuffer buf = new_buffer(pool, NULL, nbytes, pool.check_stream(handle))
    buf._ptr = ptr
    buf._exporter = exporter
    if source is not None:
        buf._base = source if source._blk != NULL else source._base
    if nbytes:
        hand_over(pool, exporter, producer, handle)
    return buf
