"""The "async" upstream on a real device: a driver memory pool of the pool's own
(cuMemAllocFromPoolAsync / cuMemFreeAsync), and stream keys from cuStreamGetId (marked gpu)."""

import numpy as np
import pytest

import gpupool

pytestmark = pytest.mark.gpu

MIB = 1 << 20


def _stream():
    """A new non-blocking stream on device 0's primary context (made current here)."""
    from cuda.bindings import driver

    ok = driver.CUresult.CUDA_SUCCESS
    err, dev = driver.cuDeviceGet(0)
    assert err == ok
    err, ctx = driver.cuDevicePrimaryCtxRetain(dev)
    assert err == ok
    (err,) = driver.cuCtxSetCurrent(ctx)
    assert err == ok
    err, stream = driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
    assert err == ok
    return driver, stream


def test_async_upstream_serves_every_size_and_trims():
    pool = gpupool.Pool(device=0, upstream="async", soft_limit="1GiB")
    assert isinstance(pool.upstream, gpupool.AsyncUpstream)
    assert pool.upstream.release_threshold == 1 << 30
    bufs = []
    for i, nbytes in enumerate((1, 1000, 300_000, 16 * MIB)):
        buf = pool.allocate(nbytes)
        buf.memset(i + 1)
        bufs.append(buf)
    for i, buf in enumerate(bufs):
        assert (buf.copy_to_host() == i + 1).all()
    del bufs, buf
    stats = pool.stats()
    assert stats.in_use_bytes == 0 and stats.cached_bytes == stats.reserved_bytes > 0
    assert pool.trim() == stats.reserved_bytes
    assert pool.stats().reserved_bytes == 0


def test_async_upstream_blocks_on_a_created_stream_and_across_streams():
    driver, s = _stream()
    pool = gpupool.Pool(device=0, upstream="async")
    data = np.arange(3 * MIB, dtype=np.uint8)
    small = pool.allocate(1000, stream=int(s))           # a shared segment allocated in s's order
    other = pool.allocate(1000)                          # carved for the legacy stream
    other.memset(5)
    big = pool.allocate(data.nbytes, stream=int(s))
    big.copy_from_host(data)
    assert np.array_equal(big.copy_to_host(), data)
    assert (other.copy_to_host() == 5).all()
    ptr = big.ptr
    del big
    assert pool.allocate(data.nbytes, stream=int(s)).ptr == ptr      # same stream: reused
    del small, other
    driver.cuStreamSynchronize(s)
    driver.cuStreamDestroy(s)


def test_streams_are_keyed_by_their_driver_id():
    # A block freed on a stream goes back to that stream; after the stream is destroyed, a
    # new stream (whatever handle value the driver gives it) does not get it without a wait.
    driver, s = _stream()
    pool = gpupool.Pool(device=0)
    buf = pool.allocate(4 * MIB, stream=int(s))
    ptr = buf.ptr
    del buf
    assert pool.allocate(4 * MIB, stream=int(s)).ptr == ptr
    driver.cuStreamSynchronize(s)
    driver.cuStreamDestroy(s)
    driver2, s2 = _stream()
    fresh = pool.allocate(4 * MIB, stream=int(s2))
    assert fresh.ptr != ptr
    del fresh
    driver.cuStreamSynchronize(s2)
    driver.cuStreamDestroy(s2)
