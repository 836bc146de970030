"""Hand-offs between streams on a GPU (marked gpu), each behind a slow kernel still running:
a DLPack consumer's stream holds the block until its kernel is done; a buffer written on one
thread's per-thread stream is read after that work on another thread; as_buffer orders its
stream after the array's. The CPU twins: test_dlpack.py, records/test_stream_identity.py,
api/test_interop.py."""

import threading

import numpy as np
import pytest
from conftest import SLOW_WRITE

import gpupool

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

MIB = 1 << 20
N = 8 * MIB
SPIN = 400_000_000          # clock cycles, about 0.2 s on an H200: far longer than the calls


@pytest.fixture
def pool():
    return gpupool.Pool(device=0)


@pytest.fixture
def slow_write():
    """``slow_write(ptr, stream)``: after about 0.2 s, 42 in every byte of [ptr, ptr + N), on
    ``stream`` (a CuPy stream)."""
    kernel = cupy.RawKernel(SLOW_WRITE, "slow_write")

    def launch(ptr, stream):
        with stream:
            kernel((64,), (256,), (cupy.uint64(ptr), cupy.int64(N), cupy.int64(SPIN)))

    return launch


def test_a_dlpack_consumers_stream_holds_the_block_until_its_kernel_is_done(pool, slow_write):
    a = cupy.cuda.Stream(non_blocking=True)
    b = cupy.cuda.Stream(non_blocking=True)
    buf = pool.allocate(N, stream=a.ptr)
    ptr = buf.ptr
    capsule = buf.__dlpack__(stream=b.ptr)      # a DLPack consumer working on stream b...
    slow_write(ptr, b)                          # ...whose kernel still writes the memory
    del capsule, buf                            # freed on a while b's kernel runs
    again = pool.allocate(N, stream=a.ptr)
    assert again.ptr == ptr                     # the same block, on its own stream
    again.memset(7, stream=a.ptr)               # must run after b's 42s
    b.synchronize()                             # had it run before, the 42s would show now
    assert (again.copy_to_host(stream=a.ptr) == 7).all()


@pytest.mark.parametrize("consumer", ["per-thread", "created"])
def test_a_buffer_written_on_one_threads_per_thread_stream_is_read_after_it(pool, slow_write,
                                                                           consumer):
    made, done = {}, threading.Event()

    def producer():
        ptds = cupy.cuda.Stream.ptds            # this thread's per-thread default stream
        buf = pool.allocate(N, stream=ptds.ptr)
        buf.memset(0, stream=ptds.ptr)
        slow_write(buf.ptr, ptds)
        made["buf"] = buf
        done.wait(60)                           # alive, its stream too, until read

    t = threading.Thread(target=producer)
    t.start()
    try:
        while "buf" not in made and t.is_alive():
            t.join(0.01)
        buf = made.pop("buf")
        # Here handle 2 names this thread's per-thread stream, not the producer's.
        side = cupy.cuda.Stream(non_blocking=True)      # alive until the buffer is freed
        stream = 2 if consumer == "per-thread" else side.ptr
        capsule = buf.__dlpack__(stream=stream)
        host = buf.copy_to_host(stream=stream)  # on the consumer's stream, then synchronized
        assert (host == 42).all()
        del capsule, buf                        # a use of `stream`: recorded at this free
    finally:
        done.set()
        t.join()


def test_as_buffer_orders_its_stream_after_the_arrays(pool, slow_write):
    s = cupy.cuda.Stream(non_blocking=True)
    c = cupy.cuda.Stream(non_blocking=True)
    with s:
        x = cupy.zeros(N, dtype=cupy.uint8)     # CuPy's own memory, written on s...
    slow_write(x.data.ptr, s)                   # ...by a kernel still running
    with s:                                     # CuPy's interface gives its current stream
        wrapped = gpupool.as_buffer(x, pool=pool, stream=c.ptr)
    assert wrapped.stream == c.ptr
    assert (wrapped.copy_to_host() == 42).all()     # read on c, after s's kernel


def test_a_wrapper_of_a_gpupool_buffer_on_another_stream_holds_its_block(pool, slow_write):
    a = cupy.cuda.Stream(non_blocking=True)
    c = cupy.cuda.Stream(non_blocking=True)
    buf = pool.allocate(N, stream=a.ptr)
    ptr = buf.ptr
    wrapped = gpupool.as_buffer(buf.view(np.uint8, (N,)), stream=c.ptr)
    slow_write(wrapped.ptr, c)                  # the wrapper's user, on c
    del wrapped, buf
    again = pool.allocate(N, stream=a.ptr)
    assert again.ptr == ptr
    again.memset(7, stream=a.ptr)
    c.synchronize()
    assert (again.copy_to_host(stream=a.ptr) == 7).all()
