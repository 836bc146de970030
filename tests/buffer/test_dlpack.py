"""DLPack export on the simulated device (host memory, so NumPy consumes it as kDLCPU)."""

import ctypes
import re
import sys

import numpy as np
import pytest

import gpupool

_name = ctypes.pythonapi.PyCapsule_GetName
_name.restype = ctypes.c_char_p
_name.argtypes = [ctypes.py_object]


def test_numpy_reads_a_buffer_without_copying(pool):
    buf = pool.allocate(256)
    buf.copy_from_host(np.arange(256, dtype=np.uint8))
    view = np.from_dlpack(buf)
    assert view.ctypes.data == buf.ptr and view.dtype == np.uint8 and view.shape == (256,)
    assert np.array_equal(view, np.arange(256, dtype=np.uint8))
    view[:4] = 9                                   # the same memory
    assert list(buf.copy_to_host()[:4]) == [9] * 4
    assert buf.__dlpack_device__() == (1, 0)


def test_legacy_and_versioned_capsules(pool):
    buf = pool.allocate(64)
    assert _name(buf.__dlpack__()) == b"dltensor"
    assert _name(buf.__dlpack__(max_version=(0, 8))) == b"dltensor"
    assert _name(buf.__dlpack__(max_version=(1, 0))) == b"dltensor_versioned"


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_the_deleter_runs_once_taken_or_not(pool, max_version):
    buf = pool.allocate(64)
    base = sys.getrefcount(buf)
    capsule = buf.__dlpack__(max_version=max_version)
    assert sys.getrefcount(buf) == base + 1        # the capsule keeps the buffer alive
    del capsule                                    # never consumed: it deletes itself
    assert sys.getrefcount(buf) == base

    class Exporter:
        def __dlpack__(self, **kwargs):
            return buf.__dlpack__(max_version=max_version)

        def __dlpack_device__(self):
            return buf.__dlpack_device__()

    view = np.from_dlpack(Exporter())              # consumed: NumPy calls the deleter later
    assert sys.getrefcount(buf) == base + 1
    del view
    assert sys.getrefcount(buf) == base


def test_a_capsule_consumed_twice_is_refused(pool):
    buf = pool.allocate(64)
    capsule = buf.__dlpack__()

    class Same:
        def __dlpack__(self, **kwargs):
            return capsule

        def __dlpack_device__(self):
            return buf.__dlpack_device__()

    np.from_dlpack(Same())
    with pytest.raises((ValueError, RuntimeError, BufferError, TypeError)):
        np.from_dlpack(Same())


def test_the_consumer_stream_waits_for_the_buffer_stream(pool, sim):
    a, b = sim.create_stream(), sim.create_stream()
    buf = pool.allocate(64, stream=a)
    sim.launch(a)
    queued = sim._queued[a]
    buf.__dlpack__(stream=b)
    assert sim.ordered(b, a, queued) and sim.pending(a)
    calls = len(sim.calls)
    buf.__dlpack__(stream=-1)                      # no synchronization asked
    buf.__dlpack__(stream=a)                       # the buffer's own stream
    assert len(sim.calls) == calls


def test_refusals(pool):
    buf = pool.allocate(64)
    with pytest.raises(BufferError):
        buf.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        buf.__dlpack__(dl_device=(2, 0))
    buf.close()
    with pytest.raises(gpupool.InvalidBufferError):
        buf.__dlpack__()


def test_empty_buffer(pool):
    view = np.from_dlpack(pool.allocate(0))
    assert view.shape == (0,)


@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.uint64, np.complex64, np.bool_])
def test_typed_views_export_dtype_and_shape(pool, dtype):
    data = (np.arange(24) % 2 == 1) if dtype is np.bool_ else np.arange(24).astype(dtype)
    buf = pool.allocate(data.nbytes + 100)
    buf.copy_from_host(data)
    view = buf.view(dtype, (4, 6))
    assert np.array_equal(np.from_dlpack(view), data.reshape(4, 6))
    cai = view.__cuda_array_interface__
    assert cai["shape"] == (4, 6) and cai["typestr"] == np.dtype(dtype).str
    assert cai["data"] == (buf.ptr, False) and cai["strides"] is None


def test_strided_view(pool):
    data = np.arange(12, dtype=np.float64)
    buf = pool.allocate(data.nbytes)
    buf.copy_from_host(data)
    view = buf.view(np.float64, (3, 2), strides=(32, 8))       # every other row pair
    assert np.array_equal(np.from_dlpack(view), data.reshape(3, 4)[:, :2])
    assert view.__cuda_array_interface__["strides"] == (32, 8)


def test_view_keeps_the_buffer_alive(pool):
    buf = pool.allocate(64)
    view = buf.view(np.uint32, 16)
    del buf
    assert pool.stats().in_use_bytes == 512
    array = np.from_dlpack(view)
    del view
    assert pool.stats().in_use_bytes == 512                   # the array holds it now
    del array
    assert pool.stats().in_use_bytes == 0


@pytest.mark.parametrize(
    "dtype, shape, strides, error",
    [(np.float32, (100,), None, ValueError), (np.float32, (-1,), None, ValueError),
     (np.float32, (4,), (6,), ValueError), (np.object_, (1,), None, TypeError),
     (">f4", (4,), None, TypeError), (np.float32, (4, 4), (4,), ValueError),
     (np.float32, "abc", None, TypeError), (np.float32, 2.5, None, TypeError),
     (np.float32, (2.0,), None, TypeError), (np.float32, (4,), "4", TypeError)])
def test_bad_views(pool, dtype, shape, strides, error):
    with pytest.raises(error, match="shape" if shape == "abc" else None):
        pool.allocate(64).view(dtype, shape, strides)


@pytest.mark.parametrize("value", ["x", b"4"])
@pytest.mark.parametrize("what", ["shape", "strides"])
def test_a_string_shape_or_strides_is_named_in_the_error(pool, what, value):
    # The message said "got None" (trial 29).
    arguments = {"shape": (4,), what: value}
    with pytest.raises(TypeError, match=rf"^{what} must be an int or a sequence of ints, "
                                        rf"got {re.escape(repr(value))}$"):
        pool.allocate(64).view("float32", **arguments)


def test_no_view_of_a_closed_buffer(pool):
    buf = pool.allocate(64)
    buf.close()
    with pytest.raises(gpupool.InvalidBufferError):
        buf.view(np.float32, 4)


def test_empty_views(pool):
    assert np.from_dlpack(pool.allocate(0).view(np.float32, (0, 3))).shape == (0, 3)


@pytest.mark.usefixtures("default_pools")
def test_as_buffer_wraps_foreign_memory_without_owning_it(pool, sim):
    gpupool.set_pool(pool)
    base = pool.allocate(64)
    base.copy_from_host(np.arange(64, dtype=np.uint8))
    view = base.view(np.float32, (4, 4))
    s = sim.create_stream()
    foreign = type("Foreign", (), {"__cuda_array_interface__": dict(
        view.__cuda_array_interface__, stream=s)})()
    wrapped = gpupool.as_buffer(foreign)          # used on the legacy stream, after s's work
    assert wrapped.ptr == base.ptr and wrapped.nbytes == 64 and wrapped.stream == 0
    assert np.array_equal(wrapped.copy_to_host(), np.arange(64, dtype=np.uint8))
    in_use = pool.stats().in_use_bytes
    del wrapped                                   # not ours: nothing goes back to the pool
    assert pool.stats().in_use_bytes == in_use and not base.closed
    with pytest.raises(TypeError):
        gpupool.as_buffer(object())
    strided = type("S", (), {"__cuda_array_interface__": dict(
        view.__cuda_array_interface__, strides=(32, 4))})()
    with pytest.raises(ValueError):
        gpupool.as_buffer(strided)


def test_as_buffer_of_a_gpupool_view_uses_its_pool(pool):
    buf = pool.allocate(64)
    buf.copy_from_host(np.arange(64, dtype=np.uint8))
    wrapped = gpupool.as_buffer(buf.view("float32", (4, 4)))    # no driver, no set_pool
    assert wrapped.pool is pool and wrapped.ptr == buf.ptr
    assert np.array_equal(wrapped.copy_to_host(), np.arange(64, dtype=np.uint8))


@pytest.mark.parametrize("through", ["buffer", "view"])
@pytest.mark.parametrize("consumer", [None, 1, 2, "created"])
def test_a_consumer_stream_counts_as_a_use_of_the_block(pool, sim, consumer, through):
    # DLPack's stream values: None and 1 the legacy default stream, 2 the per-thread one.
    a = sim.create_stream()
    stream = sim.create_stream() if consumer == "created" else consumer
    works_on = 0 if stream in (None, 1) else stream       # where the consumer's work runs
    buf = pool.allocate(64 << 10, stream=a)
    ptr = buf.ptr
    exporter = buf if through == "buffer" else buf.view(np.float32, (16 << 10,))
    capsule = exporter.__dlpack__(stream=stream)
    sim.launch(works_on)                  # the consumer's kernel, still reading the memory
    queued = sim.queued(works_on)
    del capsule, exporter, buf
    again = pool.allocate(64 << 10, stream=a)
    assert again.ptr == ptr                           # the same block, on its own stream...
    assert sim.ordered(a, works_on, queued)           # ...only behind the consumer's work


def test_a_use_is_recorded_once_per_consumer_and_not_for_the_buffers_own_stream(pool, sim):
    a, b = sim.create_stream(), sim.create_stream()
    buf = pool.allocate(64 << 10, stream=a)
    for _ in range(3):
        buf.__dlpack__(stream=b)
    buf.__dlpack__(stream=a)
    buf.__dlpack__(stream=-1)
    sim.calls.clear()
    del buf
    assert [args[1] for args in sim.calls_named("event_record")] == [b]    # at the free


def test_a_use_on_the_stream_a_buffer_was_allocated_on_counts_after_the_buffer_moved(pool, sim):
    a, b = sim.create_stream(), sim.create_stream()
    buf = pool.allocate(64 << 10, stream=a)
    ptr = buf.ptr
    buf.stream = b                      # moved: a is now another stream's work on it
    buf.record_stream(a)
    sim.launch(a)                       # still reading the block
    sim.calls.clear()
    buf.close()                         # freed on b
    assert [args[1] for args in sim.calls_named("event_record")] == [a]
    again = pool.allocate(64 << 10, stream=b)
    assert again.ptr != ptr or sim.calls_named("stream_wait_event")   # not before a's work


def test_views_of_no_elements_export_pointer_0(pool):
    buf = pool.allocate(64)
    for view in (buf.view(np.float32, (0, 4)), buf.view(np.int8, (4, 0), strides=(1, 1))):
        assert view.__cuda_array_interface__["data"] == (0, False)
        for max_version in (None, (1, 0)):
            assert capsule_data_pointer(view.__dlpack__(max_version=max_version)) == 0
        assert np.from_dlpack(view).size == 0
    full = buf.view(np.float32, (4,))
    assert capsule_data_pointer(full.__dlpack__()) == full.__cuda_array_interface__["data"][0] \
        == buf.ptr
    buf.close()
    with pytest.raises(gpupool.InvalidBufferError):
        _ = view.__cuda_array_interface__


def capsule_data_pointer(capsule):
    """The data pointer of an unconsumed DLPack capsule (legacy or versioned)."""
    name = _name(capsule)
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    tensor = get(capsule, name)
    # DLManagedTensorVersioned starts with its version, manager_ctx, deleter and flags.
    offset = 0 if name == b"dltensor" else 8 + 3 * ctypes.sizeof(ctypes.c_void_p)
    return ctypes.c_void_p.from_address(tensor + offset).value or 0
