"""The pool on a real device (marked gpu: skipped where there is no GPU)."""

import copy
import pickle

import numpy as np
import pytest

import gpupool
from gpupool.core import oom

pytestmark = pytest.mark.gpu

MIB = 1 << 20


@pytest.fixture
def pool():
    return gpupool.Pool(device=0)


def test_real_memory_round_trip(pool):
    data = np.random.default_rng(1).integers(0, 256, 3 * MIB + 17, dtype=np.uint8)
    buf = pool.allocate(data.nbytes)
    assert buf.ptr % 256 == 0 and buf.device == 0
    buf.copy_from_host(data)
    assert np.array_equal(buf.copy_to_host(), data)
    other = pool.allocate(data.nbytes)
    other.copy_from_host(buf)
    assert np.array_equal(other.copy_to_host(), data)
    other.memset(0xAB)
    assert (other.copy_to_host() == 0xAB).all()


def test_sizes_from_256_bytes_to_256_mib(pool):
    for nbytes in (1, 256, 4097, 300_000, 16 * MIB, 256 * MIB):
        buf = pool.allocate(nbytes)
        buf.memset(7)
        assert buf.ptr % 256 == 0
        assert (buf.copy_to_host() == 7).all()
    del buf
    stats = pool.stats()
    assert stats.in_use_bytes + stats.cached_bytes == stats.reserved_bytes
    pool.trim()
    assert pool.stats().reserved_bytes == 0


def test_default_pool_and_status(capsys):
    buf = gpupool.allocate(MIB)
    assert gpupool.get_pool(0) is buf.pool
    gpupool.pool_status()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Effective GPU memory usage: ") and "GiB)" in out[0]
    assert out[1].startswith("Memory pool usage: ") and "reserved)" in out[1]


def test_no_such_device():
    with pytest.raises(gpupool.NoDeviceError, match="no CUDA device 999"):
        gpupool.Pool(device=999)


def test_hard_limit_on_the_device():
    pool = gpupool.Pool(device=0, hard_limit="64MiB")
    keep = pool.allocate(MIB)
    with pytest.raises(gpupool.OutOfMemoryError, match="hard limit 64.000 MiB") as info:
        pool.allocate(100 * MIB)
    error = info.value
    assert error.requested_bytes == 100 * MIB and error.limit_bytes == 64 * MIB
    assert error.in_use_bytes == MIB
    assert error.reserved_bytes == pool.stats().reserved_bytes
    assert error.in_use_bytes + error.cached_bytes == error.reserved_bytes
    # Built without a driver call (core/oom.pyx, oom_error): with NVML (pynvml installed and
    # the device matched) its free and total bytes; else no free bytes and the total that
    # cuMemGetInfo gave when the pool was made (a driver upstream), as mem_info() gives it.
    _, total = pool.mem_info()
    nvml = oom.nvml_memory(0)
    if error.device_free_bytes is None:
        assert error.device_total_bytes == total and error.device_used_by_others_bytes is None
    else:
        assert nvml is not None and error.device_total_bytes == nvml[1]
        assert 0 <= error.device_free_bytes <= error.device_total_bytes
        assert error.device_used_by_others_bytes is not None
    # Over the hard limit: a request that can never fit says so (no pool_status() hint).
    assert "can never fit: 104857600 B requested, hard limit 64.000 MiB (67108864 B)" in str(
        error)
    del keep


def test_buffers_pickle_through_the_host_and_copy_on_the_device(pool):
    data = np.random.default_rng(2).integers(0, 256, 3 * MIB + 17, dtype=np.uint8)
    buf = pool.allocate(data.nbytes)
    buf.copy_from_host(data)
    buffers = []
    payload = pickle.dumps(buf, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and len(payload) < 200     # the bytes travel out of band
    again = pickle.loads(payload, buffers=buffers)
    assert again.pool is gpupool.get_pool() and again.device == 0 and again.ptr != buf.ptr
    assert np.array_equal(again.copy_to_host(), data)
    view = pickle.loads(pickle.dumps(buf.view(np.uint8, (data.nbytes,)), protocol=4))
    assert view.shape == (data.nbytes,) and np.array_equal(view.buffer.copy_to_host(), data)
    for twin in (buf.copy(), copy.copy(buf), copy.deepcopy(buf)):
        assert twin.pool is pool and twin.ptr != buf.ptr
        assert np.array_equal(twin.copy_to_host(), data)


def test_region_on_the_device(pool):
    region = gpupool.Region(pool=pool)
    addresses, misses = [], []
    for _ in range(3):
        with region:
            bufs = [pool.allocate(n) for n in (1000, 300_000, 5 * MIB)]
            for buf in bufs:
                buf.memset(1)
            addresses.append([b.ptr for b in bufs])
            del bufs, buf
        misses.append(region.stats().cache_misses)
    assert addresses[0] == addresses[1] == addresses[2]
    assert misses[0] >= 1 and misses[2] == misses[0]     # later entries never grow


def test_several_devices_each_get_their_own_pool():
    from cuda.bindings import driver

    err, count = driver.cuDeviceGetCount()
    if count < 2:
        pytest.skip("needs two GPUs")
    pools = [gpupool.get_pool(d) for d in range(count)]
    bufs = [p.allocate(MIB) for p in pools]
    for d, buf in enumerate(bufs):
        assert buf.device == d
        buf.copy_from_host(np.full(MIB, d, np.uint8))
    for d, buf in enumerate(bufs):
        assert (buf.copy_to_host() == d).all()
    del bufs, buf                 # freed with device 0 current: each goes to its own pool
    for p in pools:
        stats = p.stats()
        assert stats.in_use_bytes == 0 and stats.num_frees >= 1
