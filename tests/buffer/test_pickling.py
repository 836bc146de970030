"""Pickling and copying (CPU, simulated device): a buffer's bytes go through host memory into a
fresh block of the default pool, never its address; views keep their dtype, shape and strides;
copy.copy and copy.deepcopy copy on the device; pools and regions refuse with a clear message."""

import copy
import pickle

import numpy as np
import pytest

import gpupool
from gpupool.buffer.view import BufferView

pytestmark = pytest.mark.usefixtures("default_pools")

DATA = np.random.default_rng(5).integers(0, 256, 3000, dtype=np.uint8)


@pytest.fixture
def default(pool):
    """The simulated pool, made device 0's default pool (pickle.loads allocates from it)."""
    gpupool.set_pool(pool)
    return pool


def filled(pool, data=DATA, stream=None):
    buf = pool.allocate(data.nbytes, stream=stream)
    buf.copy_from_host(data)
    return buf


def address_in(payload, ptr):
    """Whether ptr appears in a pickle: as binary ints of any width, or as decimal text."""
    packed = ptr.to_bytes(8, "little").rstrip(b"\0")
    return packed in payload or str(ptr).encode() in payload or hex(ptr).encode() in payload


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_buffer_pickles_its_bytes_and_loads_into_a_fresh_block(default, sim, protocol):
    s = sim.create_stream()
    buf = filled(default, stream=s)
    payload = pickle.dumps(buf, protocol=protocol)
    assert not address_in(payload, buf.ptr)
    again = pickle.loads(payload)
    assert isinstance(again, gpupool.DeviceBuffer) and again.pool is default
    assert again.ptr != buf.ptr and again.nbytes == buf.nbytes and again.stream == 0
    assert np.array_equal(again.copy_to_host(), DATA)
    assert np.array_equal(pickle.loads(pickle.dumps(default.allocate(0))).copy_to_host(),
                          np.empty(0, np.uint8))


def test_protocol_5_sends_the_bytes_out_of_band_and_earlier_ones_in_band(default):
    buf = filled(default)
    buffers = []
    payload = pickle.dumps(buf, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and buffers[0].raw().tobytes() == DATA.tobytes()
    assert DATA.tobytes() not in payload and len(payload) < 200
    assert np.array_equal(pickle.loads(payload, buffers=buffers).copy_to_host(), DATA)
    for protocol in (4, 5):                           # 5 without a callback: in the pickle
        assert DATA.tobytes() in pickle.dumps(buf, protocol=protocol)


def test_a_view_pickles_with_its_dtype_shape_and_strides(default):
    values = np.arange(12, dtype=np.float64)
    buf = filled(default, values.view(np.uint8))
    view = buf.view(np.float64, (3, 2), strides=(32, 8))
    flat = buf.view(np.float64, (12,))
    again, again_flat = pickle.loads(pickle.dumps((view, flat)))
    assert isinstance(again, BufferView) and again.buffer is again_flat.buffer   # one buffer
    assert again.buffer.ptr != buf.ptr
    assert (again.dtype, again.shape, again.strides) == (np.dtype(np.float64), (3, 2), (32, 8))
    assert again_flat.strides is None
    assert np.array_equal(np.from_dlpack(again), values.reshape(3, 4)[:, :2])


def test_closed_and_invalidated_buffers_refuse_pickling_and_copies(default):
    buf = filled(default)
    buf.close()
    region = gpupool.Region(pool=default, on_exit="invalidate")
    with region:
        stale = default.allocate(100)
    for dead in (buf, stale):
        for use in (pickle.dumps, copy.copy, copy.deepcopy, lambda b: b.copy()):
            with pytest.raises(gpupool.InvalidBufferError):
                use(dead)


def test_copies_are_device_side_copies_in_the_same_pool(pool, sim):
    buf = filled(pool)
    sim.calls.clear()
    twins = [buf.copy(), copy.copy(buf), copy.deepcopy(buf)]
    assert [args[0] for args in sim.calls_named("copy")] == [3, 3, 3]   # device to device
    for twin in twins:
        assert twin.pool is pool and twin.ptr != buf.ptr and twin.stream == buf.stream
        assert np.array_equal(twin.copy_to_host(), DATA)
    view = buf.view(np.uint8, (10, 300))
    for twin in (copy.copy(view), copy.deepcopy(view)):
        assert twin.buffer.ptr != buf.ptr and twin.shape == (10, 300)
        assert np.array_equal(np.from_dlpack(twin), DATA.reshape(10, 300))
    both = copy.deepcopy([buf, view])
    assert both[1].buffer is both[0]                  # deepcopy's memo: one copied buffer


def test_a_copy_on_another_stream_follows_the_buffers_work_and_counts_as_a_use(pool, sim):
    a, c = sim.create_stream(), sim.create_stream()
    buf = filled(pool, stream=a)
    ptr = buf.ptr
    sim.launch(a)
    produced = sim.queued(a)
    twin = buf.copy(stream=c)
    assert twin.stream == c and sim.ordered(c, a, produced)
    sim.launch(c)                                     # the copy, still reading on c
    consumed = sim.queued(c)
    del buf
    again = pool.allocate(DATA.nbytes, stream=a)
    assert again.ptr == ptr and sim.ordered(a, c, consumed)


def test_pools_and_regions_refuse_pickling_and_copies_with_a_clear_message(pool):
    for obj, name in ((pool, "gpupool.Pool"), (gpupool.Region(pool=pool), "gpupool.Region")):
        for use in (pickle.dumps, copy.copy, copy.deepcopy):
            with pytest.raises(TypeError, match=f"a {name} cannot be pickled or copied"):
                use(obj)
