"""A simulated device: the pool's upstream on machines without a GPU.

``SimulatedDevice`` serves host memory (256-byte aligned) and simulates streams, events and
pending work, so every policy of the pool (size classes, stream-ordered reuse, limits,
regions) runs and is tested on CPU, in gpupool's CI and in yours::

    from gpupool.testing import SimulatedDevice
    sim = SimulatedDevice(capacity=1 << 30)
    pool = gpupool.Pool(upstream=sim)
    s = sim.create_stream()
    sim.launch(s)          # work still running on s
    sim.complete(s)        # ... now finished

Every simulated driver call is appended to ``sim.calls`` as ``(name, args)``.
"""

import ctypes
import itertools

import numpy as np

from gpupool._upstream import PythonUpstream

__all__ = ["SimulatedDevice"]

ALIGNMENT = 256
LEGACY_STREAM = 0
PER_THREAD_STREAM = 2


class SimulatedDevice(PythonUpstream):
    """Host memory with simulated streams and events, usable as a ``Pool`` upstream.

    Parameters
    ----------
    capacity : int
        Bytes the device holds; an allocation beyond it fails as out of memory.
    device : int
        Ordinal reported as the pool's device.
    stream_ordered : bool
        Simulate a stream-ordered upstream (as ``gpupool.AsyncUpstream``): each allocation
        is work queued on the requesting stream, and memory exists for other streams only
        once that work is done or ordered before theirs.

    Attributes
    ----------
    calls : list of (str, tuple)
        Every simulated driver call, in order: ``alloc``, ``free``, ``event_create``,
        ``event_destroy``, ``event_record``, ``event_query``, ``stream_wait_event``,
        ``synchronize``, ``copy``, ``memset``, ``mem_info``, ``trim``. With
        ``stream_ordered``, ``alloc``'s arguments are ``(nbytes, stream)``.
    used : int
        Bytes currently allocated.
    errors : list of str
        Misuses seen (a call on an unknown or destroyed stream, a free of an unknown pointer):
        each also raises, but a pool freeing from ``__dealloc__`` cannot report it, so tests
        should check that this list is empty.
    """

    def __init__(self, capacity=1 << 30, device=0, stream_ordered=False):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self._set_device(device)
        self._set_stream_ordered(stream_ordered)
        self._set_host_accessible(True)     # buffers export DLPack as kDLCPU: NumPy reads them
        self.capacity = int(capacity)
        self.used = 0
        self.calls = []
        self.errors = []
        self._arrays = {}               # pointer -> (numpy array holding it, nbytes)
        self._handles = itertools.count(0x1000, 0x10)
        # Work on a stream is numbered; `done` is the last finished number, `queued` the last.
        self._queued = {LEGACY_STREAM: 0, PER_THREAD_STREAM: 0}
        self._done = {LEGACY_STREAM: 0, PER_THREAD_STREAM: 0}
        self._events = {}               # event -> list of (stream, work number) it waits for
        self._waits = {}                # stream -> events its later work waits for
        self._ids = itertools.count(1)
        self._stream_ids = {}           # stream -> ID, new for every created stream
        self.allocated_on = {}          # stream-ordered: pointer -> (stream, work number)

    # The test-facing side --------------------------------------------------------------

    def create_stream(self, reuse=None):
        """A new simulated stream handle (an int, as a ``CUstream`` would be).

        ``reuse``: a destroyed stream's handle to give the new stream, as a driver may; the
        new stream still has a new stream ID (``cuStreamGetId``).
        """
        if reuse is not None:
            if reuse in self._queued:
                self._misuse(f"stream {reuse:#x} is not destroyed")
            handle = reuse
        else:
            handle = next(self._handles)
        self._queued[handle] = self._done[handle] = 0
        self._stream_ids[handle] = next(self._ids)
        return handle

    def destroy_stream(self, stream):
        """Forget a stream; later use of its handle is an error, as on a real device."""
        self._check_stream(stream)
        del self._queued[stream], self._done[stream]

    def launch(self, stream=LEGACY_STREAM):
        """Enqueue simulated work ("a kernel still running") on ``stream``."""
        self._check_stream(stream)
        self._queued[stream] += 1

    def complete(self, stream=None):
        """Finish the pending work of ``stream`` (``None``: every stream)."""
        streams = list(self._queued) if stream is None else [stream]
        for s in streams:
            self._check_stream(s)
            self._done[s] = self._queued[s]

    def pending(self, stream):
        """Whether ``stream`` has unfinished work."""
        self._check_stream(stream)
        return self._done[stream] < self._queued[stream]

    def ordered(self, stream, before, work):
        """Whether new work on ``stream`` runs after the first ``work`` items of ``before``:
        they are done, or ``stream`` waits for an event that covers them."""
        if self._done.get(before, work) >= work:
            return True
        return any(s == before and n >= work
                   for event in self._waits.get(stream, ()) for s, n in self._events[event])

    def calls_named(self, name):
        """The arguments of every call named ``name``, in order."""
        return [args for call, args in self.calls if call == name]

    def _check_stream(self, stream):
        if stream not in self._queued:
            self._misuse(f"unknown or destroyed stream {stream:#x}")

    def _misuse(self, what):
        self.errors.append(what)
        raise ValueError(f"simulated device: {what}")

    # The upstream side (called by the pool) --------------------------------------------

    def _alloc(self, nbytes, stream=None):
        self.calls.append(("alloc", (nbytes,) if stream is None else (nbytes, stream)))
        if stream is not None:
            self._check_stream(stream)
        if self.used + nbytes > self.capacity:
            raise MemoryError(f"simulated device out of memory: {nbytes} B requested")
        array = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
        ptr = -array.ctypes.data % ALIGNMENT + array.ctypes.data
        self._arrays[ptr] = (array, nbytes)
        self.used += nbytes
        if stream is not None:
            self._queued[stream] += 1       # the allocation is work in the stream's order
            self.allocated_on[ptr] = (stream, self._queued[stream])
        return ptr

    def _free(self, ptr):
        self.calls.append(("free", (ptr,)))
        if ptr not in self._arrays:
            self._misuse(f"free of unknown pointer {ptr:#x}")
        self.used -= self._arrays.pop(ptr)[1]
        self.allocated_on.pop(ptr, None)

    def _event_create(self):
        event = next(self._handles)
        self.calls.append(("event_create", (event,)))
        self._events[event] = []
        return event

    def _event_destroy(self, event):
        self.calls.append(("event_destroy", (event,)))
        del self._events[event]

    def _event_record(self, event, stream):
        self.calls.append(("event_record", (event, stream)))
        self._check_stream(stream)
        # The event completes when the stream's work so far, and what it waits for, is done.
        self._events[event] = [(stream, self._queued[stream])] + [
            dep for e in self._waits.get(stream, ()) for dep in self._events[e]]

    def _event_query(self, event):
        self.calls.append(("event_query", (event,)))
        return all(self._done.get(s, n) >= n for s, n in self._events[event])

    def _stream_wait_event(self, stream, event):
        self.calls.append(("stream_wait_event", (stream, event)))
        self._check_stream(stream)
        # The wait is on the event as recorded now; a later record of it changes nothing.
        copy = next(self._handles)
        self._events[copy] = list(self._events[event])
        self._waits.setdefault(stream, []).append(copy)

    def _synchronize(self):
        self.calls.append(("synchronize", ()))
        self.complete()

    def _copy(self, kind, dst, src, nbytes, stream):
        self.calls.append(("copy", (kind, dst, src, nbytes, stream)))
        self._check_stream(stream)
        ctypes.memmove(dst, src, nbytes)

    def _memset(self, dst, value, nbytes, stream):
        self.calls.append(("memset", (dst, value, nbytes, stream)))
        self._check_stream(stream)
        ctypes.memset(dst, value, nbytes)

    def _stream_id(self, stream):
        self._check_stream(stream)
        return self._stream_ids[stream]

    def _trim(self):
        self.calls.append(("trim", ()))

    def _mem_info(self):
        self.calls.append(("mem_info", ()))
        return self.capacity - self.used, self.capacity

    def __repr__(self):
        return f"SimulatedDevice(capacity={self.capacity}, used={self.used})"
