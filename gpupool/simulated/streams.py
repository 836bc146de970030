"""Simulated streams, events and pending work: the stream side of the simulated device (see
the Notes of ``gpupool.testing.SimulatedDevice`` for the driver's rules it follows)."""

import itertools
import threading

from gpupool.simulated.base import SimulatedBase
from gpupool.simulated.failures import CUDA_ERROR_INVALID_HANDLE

LEGACY_STREAM = 0
PER_THREAD_STREAM = 2


class SimulatedStreams(SimulatedBase):
    """Streams, events and work of a ``SimulatedDevice``: its test-facing side
    (``create_stream``, ``launch``, ``complete``, ...) and the upstream's event and stream
    calls."""

    def _init_streams(self):
        self.capturing = set()
        self._captured = set()          # events last recorded on a stream being captured
        self._handles = itertools.count(0x1000, 0x10)
        # Work on a stream is numbered; `done` is the last finished number, `queued` the last.
        # Streams are keyed by handle; a thread's per-thread stream by (2, thread ident), made
        # on first use (_key).
        self._queued = {LEGACY_STREAM: 0}
        self._done = {LEGACY_STREAM: 0}
        self._events = {}               # event -> list of (stream, work number) it waits for
        self._waits = {}                # stream -> events its later work waits for
        self._ids = itertools.count(1)
        self._stream_ids = {}           # stream -> ID, new for every created stream

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
            handle = self._new_handle()
        self._queued[handle] = self._done[handle] = 0
        self._stream_ids[handle] = next(self._ids)
        return handle

    def destroy_stream(self, stream):
        """Forget a stream; later use of its handle is an error, as on a real device.

        Raises
        ------
        ValueError
            ``stream`` is a default stream (a misuse, in ``errors``).
        CudaError
            CUDA_ERROR_INVALID_HANDLE: ``stream`` is unknown or destroyed (a misuse, in
            ``errors``), as every call given such a handle raises.
        """
        if stream in (LEGACY_STREAM, PER_THREAD_STREAM):
            self._misuse(f"the default stream {stream} cannot be destroyed")
        self._check_stream(stream)
        del self._queued[stream], self._done[stream]

    def per_thread_stream(self, thread=None):
        """The per-thread default stream of ``thread`` (a ``threading.get_ident()``; default:
        the calling thread's), as ``ordered``, ``pending``, ``complete`` and ``queued`` take
        it: handle 2 names it only on its own thread."""
        key = (PER_THREAD_STREAM, threading.get_ident() if thread is None else thread)
        self._queued.setdefault(key, 0)
        self._done.setdefault(key, 0)
        return key

    def launch(self, stream=LEGACY_STREAM):
        """Enqueue simulated work ("a kernel still running") on ``stream``."""
        self._queued[self._check_stream(stream)] += 1

    def complete(self, stream=None):
        """Finish the pending work of ``stream`` (``None``: every stream)."""
        streams = list(self._queued) if stream is None else [stream]
        for s in streams:
            key = self._check_stream(s)
            self._done[key] = self._queued[key]

    def pending(self, stream):
        """Whether ``stream`` has unfinished work."""
        key = self._check_stream(stream)
        return self._done[key] < self._queued[key]

    def queued(self, stream):
        """How many items of work were queued on ``stream`` so far (for ``ordered``)."""
        return self._queued[self._check_stream(stream)]

    def ordered(self, stream, before, work):
        """Whether new work on ``stream`` runs after the first ``work`` items of ``before``:
        they are done, ``stream`` waits for an event that covers them, or the two are the
        legacy stream and a per-thread stream (which synchronize with each other)."""
        stream, before = self._key(stream), self._key(before)
        if self._done.get(before, work) >= work or {_kind(stream), _kind(before)} == _BLOCKING:
            return True
        return any(s == before and n >= work
                   for event in self._waits.get(stream, ()) for s, n in self._events[event])

    def _key(self, stream):
        """The stream a handle names on the calling thread (a per-thread stream's key, made
        on first use, for handle 2); keys from per_thread_stream pass through."""
        if stream == PER_THREAD_STREAM:
            return self.per_thread_stream()
        return stream

    def _check_stream(self, stream):
        """The stream's key; for an unknown or destroyed stream, a misuse that raises the
        driver's error for it, a ``CudaError`` CUDA_ERROR_INVALID_HANDLE (as the driver path
        raises from ``cuStreamGetId``)."""
        key = self._key(stream)
        if key not in self._queued:
            self._misuse(f"unknown or destroyed stream {stream:#x}", CUDA_ERROR_INVALID_HANDLE)
        return key

    def _covered(self, key):
        """(stream, work number) of what an event recorded now on stream ``key`` waits for:
        its work so far, what it waits for, and, between the legacy stream and the per-thread
        streams (blocking streams), each other's work so far."""
        streams = [key] + [s for s in self._queued
                           if s != key and {_kind(key), _kind(s)} == _BLOCKING]
        return [(s, self._queued[s]) for s in streams] + [
            dep for e in self._waits.get(key, ()) for dep in self._events[e]]

    def _new_handle(self):
        """A new handle for a stream or an event."""
        return next(self._handles)

    def _enqueue(self, key):
        """Queue one item of work on stream ``key``; returns its work number."""
        self._queued[key] += 1
        return self._queued[key]

    def _busy_streams(self):
        """The streams with work pending."""
        return [s for s in self._queued if self._done[s] < self._queued[s]]

    # The upstream side (called by the pool) --------------------------------------------

    def _event_create(self):
        event = self._new_handle()
        self._called("event_create", (event,))
        self._events[event] = []
        return event

    def _event_destroy(self, event):
        self._called("event_destroy", (event,))
        del self._events[event]

    def _event_record(self, event, stream):
        self._called("event_record", (event, stream))
        # The event completes when the stream's work so far, and what it waits for, is done.
        self._events[event] = self._covered(self._check_stream(stream))
        if stream in self.capturing:
            self._captured.add(event)
        else:
            self._captured.discard(event)

    def _event_query(self, event):
        self._called("event_query", (event,))
        if self.capturing:
            self._misuse(f"query of event {event:#x} while streams {sorted(self.capturing)} "
                         f"are being captured (the driver refuses it in a capture of the "
                         f"global mode, and the capture is invalidated)")
        elif event in self._captured:
            self._misuse(f"query of event {event:#x}, recorded in a capture (it stands for "
                         f"no work that runs)")
        return all(self._done.get(s, n) >= n for s, n in self._events[event])

    def _stream_wait_event(self, stream, event):
        self._called("stream_wait_event", (stream, event))
        if (stream in self.capturing) != (event in self._captured):
            self._misuse(f"stream {stream:#x} waits for event {event:#x} across a capture's "
                         f"boundary (capture isolation: "
                         f"{'the stream' if stream in self.capturing else 'the event'} is "
                         f"in a capture, the other is not)")
        key = self._check_stream(stream)
        # The wait is on the event as recorded now; a later record of it changes nothing.
        copy = self._new_handle()
        self._events[copy] = list(self._events[event])
        self._waits.setdefault(key, []).append(copy)

    def _synchronize(self):
        self._called("synchronize", ())
        if self.capturing:
            self._misuse(f"synchronize while streams {sorted(self.capturing)} are being "
                         f"captured (the captures would be invalidated)")
        self.complete()

    def _stream_capturing(self, stream):
        self._called("stream_capturing", (stream,))
        self._check_stream(stream)
        return stream in self.capturing

    def _stream_id(self, stream):
        self._fail("stream_id", (stream,))
        self._check_stream(stream)
        return self._stream_ids[stream]

_BLOCKING = {"legacy", "per-thread"}       # a pair of streams that synchronize with each other


def _kind(key):
    """"legacy", "per-thread" or "created": how a stream key synchronizes with others."""
    if key == LEGACY_STREAM:
        return "legacy"
    return "per-thread" if isinstance(key, tuple) else "created"
