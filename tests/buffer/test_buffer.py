"""DeviceBuffer on the simulated device: the CUDA Array Interface, copies (NumPy's implicit
conversion refused), lifetime."""

import numpy as np
import pytest

import gpupool


def test_cuda_array_interface_v3(pool, sim):
    buf = pool.allocate(1000)
    cai = buf.__cuda_array_interface__
    assert cai == {
        "shape": (1000,), "typestr": "|u1", "data": (buf.ptr, False), "version": 3,
        "strides": None, "stream": 1,
    }
    s = sim.create_stream()
    assert pool.allocate(10, stream=s).__cuda_array_interface__["stream"] == s
    assert pool.allocate(10, stream=2).__cuda_array_interface__["stream"] == 2


def test_host_round_trip(pool):
    data = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8)
    buf = pool.allocate(data.nbytes)
    buf.copy_from_host(data)
    assert np.array_equal(buf.copy_to_host(), data)
    out = np.empty(data.nbytes // 4 + 0, dtype=np.uint32)[: data.nbytes // 4]
    buf2 = pool.allocate(out.nbytes)
    buf2.copy_from_host(data[: out.nbytes])
    assert buf2.copy_to_host(out=out) is out
    assert out.tobytes() == data[: out.nbytes].tobytes()


def test_copy_from_bytes_and_from_a_device_buffer(pool, sim):
    src = pool.allocate(8)
    src.copy_from_host(b"abcdefgh")
    dst = pool.allocate(16)
    dst.memset(0)
    dst.copy_from_host(src)
    assert dst.copy_to_host()[:8].tobytes() == b"abcdefgh"
    assert sim.calls_named("copy")[-2][0] == 3            # device to device


def test_copies_run_on_the_given_stream(pool, sim):
    s = sim.create_stream()
    buf = pool.allocate(16)
    buf.copy_from_host(np.zeros(16, np.uint8), stream=s)
    buf.memset(7, stream=s)
    assert buf.copy_to_host(stream=s)[0] == 7
    assert [args[-1] for args in sim.calls_named("copy")] == [s, s]
    assert sim.calls_named("memset")[0][-1] == s


@pytest.mark.parametrize("convert", [np.asarray, np.array])
def test_implicit_conversion_to_numpy_is_refused_with_the_explicit_ways(pool, convert):
    """As CuPy refuses it: NumPy would otherwise make a 0-d array of one Python object."""
    buf = pool.allocate(1024)
    with pytest.raises(TypeError, match=r"^Implicit conversion of a gpupool.DeviceBuffer to a "
                       r"NumPy array is not allowed: copy its bytes to the host with "
                       r"buf.copy_to_host\(\), or read its host memory \(the simulated "
                       r"device's\) with np.from_dlpack"):
        convert(buf)
    with pytest.raises(TypeError, match=r"gpupool.BufferView .* view.buffer.copy_to_host\(\)"):
        convert(buf.view("float32", 256))
    assert np.from_dlpack(buf.view("float32", 256)).shape == (256,)    # the explicit way


def test_implicit_conversion_of_device_memory_names_only_the_copy():
    from gpupool.buffer.view import no_implicit_array

    class OnTheDevice:
        def __dlpack_device__(self):
            return (2, 0)                   # kDLCUDA

    with pytest.raises(TypeError) as info:
        no_implicit_array(OnTheDevice(), "buf.copy_to_host()")
    assert str(info.value).endswith("copy its bytes to the host with buf.copy_to_host()")


def test_copy_size_checks(pool):
    buf = pool.allocate(10)
    with pytest.raises(ValueError):
        buf.copy_from_host(np.zeros(11, np.uint8))
    with pytest.raises(ValueError):
        buf.copy_to_host(out=np.zeros(9, np.uint8))
    with pytest.raises(ValueError):
        buf.copy_to_host(out=np.zeros(20, np.uint8)[::2])
    with pytest.raises(ValueError):
        buf.memset(256)


def test_close_returns_memory_and_later_use_raises(pool):
    buf = pool.allocate(1000)
    ptr = buf.ptr
    buf.close()
    assert buf.closed
    assert pool.stats().in_use_bytes == 0
    for use in (lambda: buf.ptr, lambda: buf.nbytes, lambda: len(buf), lambda: buf.stream,
                lambda: buf.__cuda_array_interface__,
                lambda: buf.copy_to_host(), lambda: buf.copy_from_host(b"x"),
                lambda: buf.record_stream(0), lambda: setattr(buf, "stream", 0)):
        with pytest.raises(gpupool.InvalidBufferError):
            use()
    assert buf.device == 0 and buf.pool is pool   # what it belonged to still answers
    assert "nbytes=1000" in repr(buf)
    buf.close()                                  # closing twice does nothing
    assert pool.allocate(1000).ptr == ptr


def test_an_invalidated_buffer_describes_no_memory_either(pool):
    region = gpupool.Region(pool=pool, on_exit="invalidate")
    with region:
        buf = pool.allocate(1000)
        wrapped = gpupool.as_buffer(buf)
    for use in (lambda: buf.nbytes, lambda: len(buf), lambda: buf.stream,
                lambda: wrapped.ptr, lambda: wrapped.nbytes):     # a wrapper of it as well
        with pytest.raises(gpupool.InvalidBufferError, match="invalidated"):
            use()
    assert not wrapped.closed


def test_with_block_closes(pool):
    with pool.allocate(100) as buf:
        assert buf.ptr
    assert buf.closed
    assert pool.stats().in_use_bytes == 0


def test_buffers_keep_their_pool_alive(sim):
    buf = gpupool.Pool(upstream=sim).allocate(100)
    assert buf.pool.stats().in_use_bytes == 512
    del buf
    assert sim.used == 0                         # the pool went with its last buffer


def test_direct_construction_is_refused():
    with pytest.raises(TypeError):
        gpupool.DeviceBuffer()


def test_repr_and_len(pool):
    buf = pool.allocate(300)
    assert len(buf) == 300
    assert "nbytes=300" in repr(buf)
    buf.close()
    assert "closed" in repr(buf)


def test_truth_says_whether_it_holds_memory_and_never_raises(pool):
    # bool() of a closed buffer raised InvalidBufferError, as len() does (trial 29). As RMM's
    # DeviceBuffer (len its size): an empty buffer is false; so is a closed or invalidated
    # one, and a wrapper of one.
    buf, empty = pool.allocate(300), pool.allocate(0)
    wrapped = gpupool.as_buffer(buf)
    assert buf and wrapped and not empty
    buf.close()
    empty.close()
    assert not buf and not wrapped and not empty
    region = gpupool.Region(pool=pool, on_exit="invalidate")
    with region:
        kept = pool.allocate(300)
    assert not kept


@pytest.mark.parametrize("src", [None, "abc", [1, 2, 3], 12345, np.array([object()])])
def test_copy_from_host_rejects_non_buffers(pool, src):
    buf = pool.allocate(64)
    with pytest.raises(TypeError):
        buf.copy_from_host(src)


def test_copy_from_host_makes_strided_sources_contiguous(pool):
    data = np.arange(32, dtype=np.uint8)
    buf = pool.allocate(16)
    buf.copy_from_host(data[::2])
    assert np.array_equal(buf.copy_to_host(), data[::2])
    buf.copy_from_host(memoryview(data.tobytes())[::2])
    assert np.array_equal(buf.copy_to_host(), data[::2])
