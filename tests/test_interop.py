"""as_buffer on the simulated device: the consumer's stream ordered after the CUDA Array
Interface's, wrappers of gpupool buffers counted as uses of their blocks, arrays of no elements
(tests/test_interop_gpu.py runs real consumers on a GPU)."""

import numpy as np
import pytest

import gpupool
from gpupool.testing import SimulatedDevice

SIZE = 64 << 10


class Foreign:
    """Another library's array: nothing but its CUDA Array Interface."""

    def __init__(self, cai):
        self.__cuda_array_interface__ = cai


def foreign(buf, **changes):
    """A foreign array over buf's memory, its interface changed by ``changes``."""
    return Foreign(dict(buf.__cuda_array_interface__, **changes))


def test_the_consumer_is_ordered_after_the_interface_stream_without_a_host_wait(pool, sim):
    owner = pool.allocate(SIZE)
    s, c = sim.create_stream(), sim.create_stream()
    sim.launch(s)                                  # the producer's kernel, still writing
    queued = sim.queued(s)
    wrapped = gpupool.as_buffer(foreign(owner, stream=s), pool=pool)
    assert wrapped.stream == 0 and sim.ordered(0, s, queued)     # the legacy stream, default
    on_c = gpupool.as_buffer(foreign(owner, stream=s), pool=pool, stream=c)
    assert on_c.stream == c and sim.ordered(c, s, queued)
    sim.launch(2)
    queued = sim.queued(2)
    gpupool.as_buffer(foreign(owner, stream=2), pool=pool, stream=c)   # this thread's
    assert sim.ordered(c, 2, queued)
    assert sim.pending(s) and sim.calls_named("synchronize") == []


def test_no_ordering_for_a_stream_of_none_or_the_consumers_own(pool, sim):
    owner = pool.allocate(SIZE)
    c = sim.create_stream()
    sim.launch(c)
    sim.calls.clear()
    gpupool.as_buffer(foreign(owner, stream=None), pool=pool, stream=c)
    gpupool.as_buffer(foreign(owner, stream=c), pool=pool, stream=c)
    gpupool.as_buffer(foreign(owner, stream=1), pool=pool)             # 1 is the legacy stream
    assert sim.calls == []


def test_a_stream_of_0_is_refused(pool):
    owner = pool.allocate(SIZE)
    with pytest.raises(ValueError, match="'stream'.* is 0.*forbids"):
        gpupool.as_buffer(foreign(owner, stream=0), pool=pool)


def test_without_events_the_device_is_synchronized_instead():
    class NoEvents(SimulatedDevice):
        def _event_create(self):
            raise RuntimeError("no more events")

    sim = NoEvents()
    pool = gpupool.Pool(upstream=sim)
    owner = pool.allocate(SIZE)
    s = sim.create_stream()
    sim.launch(s)
    gpupool.as_buffer(foreign(owner, stream=s), pool=pool)
    assert sim.calls_named("synchronize") == [()] and not sim.pending(s)
    assert sim.errors == []


@pytest.mark.parametrize("through", ["buffer", "view"])
def test_a_wrapper_on_another_stream_is_a_use_of_the_gpupool_buffer(pool, sim, through):
    a, c = sim.create_stream(), sim.create_stream()
    buf = pool.allocate(SIZE, stream=a)
    ptr = buf.ptr
    sim.launch(a)
    produced = sim.queued(a)
    source = buf if through == "buffer" else buf.view(np.uint8, (SIZE,))
    wrapped = gpupool.as_buffer(source, stream=c)            # no pool=: the buffer's own
    assert wrapped.pool is pool and wrapped.stream == c and wrapped.ptr == ptr
    assert sim.ordered(c, a, produced)                       # the consumer after the producer
    sim.launch(c)
    consumed = sim.queued(c)
    del wrapped, source, buf
    again = pool.allocate(SIZE, stream=a)
    assert again.ptr == ptr and sim.ordered(a, c, consumed)


@pytest.mark.parametrize("use", ["stream", "record_stream", "dlpack", "copy", "copy_from_host",
                                 "memset"])
def test_a_wrappers_later_streams_are_uses_of_the_gpupool_buffer(pool, sim, use):
    a, d = sim.create_stream(), sim.create_stream()
    buf = pool.allocate(SIZE, stream=a)
    ptr = buf.ptr
    wrapped = gpupool.as_buffer(buf, stream=a)
    if use == "stream":
        wrapped.stream = d
    elif use == "record_stream":
        wrapped.record_stream(d)
    elif use == "dlpack":
        wrapped.__dlpack__(stream=d)
    elif use == "copy":
        pool.allocate(SIZE, stream=d).copy_from_host(wrapped)   # read on d
    elif use == "copy_from_host":
        wrapped.copy_from_host(np.zeros(SIZE, np.uint8), stream=d)
    else:
        wrapped.memset(0, stream=d)
    sim.launch(d)
    queued = sim.queued(d)
    del wrapped, buf
    again = pool.allocate(SIZE, stream=a)
    assert again.ptr == ptr and sim.ordered(a, d, queued)


def test_a_wrapper_of_foreign_memory_records_nothing(pool, sim):
    owner = pool.allocate(SIZE)
    d = sim.create_stream()
    wrapped = gpupool.as_buffer(foreign(owner, stream=None), pool=pool)
    wrapped.record_stream(d)
    wrapped.stream = d
    sim.calls.clear()
    del owner
    assert sim.calls_named("event_record") == []


def test_arrays_of_no_elements_are_imported_without_reading_their_pointer(pool):
    # A pointer no device has: read, it would be refused.
    empty = Foreign({"data": (1 << 70, False), "shape": (0, 4), "typestr": "<f4",
                     "version": 3, "stream": 1})
    wrapped = gpupool.as_buffer(empty, pool=pool)
    assert wrapped.ptr == 0 and wrapped.nbytes == 0
    buf = pool.allocate(SIZE)
    assert gpupool.as_buffer(buf.view(np.float32, (0,))).ptr == 0
    region = gpupool.Region(pool=pool, on_exit="invalidate")
    with region:
        inside = pool.allocate(SIZE)
        view = inside.view(np.float32, (4, 0))
        assert region.keep(empty) is empty                   # no memory: nothing to keep
        assert region.keep(np.empty((0, 3))) is not None     # DLPack, a pointer NumPy made
        assert region.keep(pool.allocate(0)) is not None
        region.keep(view)                                    # a view keeps its buffer
    assert not inside.closed
