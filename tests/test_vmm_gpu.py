"""Expandable segments on a real device: gpupool.VmmUpstream (upstream "vmm") over the
driver's virtual memory API. Their policy is tested on CPU in test_vmm.py."""

import numpy as np
import pytest

import gpupool

pytestmark = pytest.mark.gpu

MIB = 1 << 20


@pytest.fixture
def pool():
    pool = gpupool.Pool(device=0, upstream="vmm")
    yield pool
    pool.trim()


def device_used(pool):
    free, total = pool.mem_info()
    return total - free


def test_the_upstream_maps_pages_of_its_granularity(pool):
    upstream = pool.upstream
    assert isinstance(upstream, gpupool.VmmUpstream) and upstream.expandable
    assert upstream.granularity >= 64 << 10 and upstream.granularity % 512 == 0
    assert upstream.va_bytes >= pool.mem_info()[1]
    buf = pool.allocate(3 * MIB + 17)
    pages = -(-(3 * MIB + 17) // upstream.granularity)
    assert upstream.mapped_bytes == pool.stats().reserved_bytes == pages * upstream.granularity
    del buf


def test_memory_of_every_size_holds_data_across_pages(pool):
    rng = np.random.default_rng(0)
    kept = []
    for nbytes in (1, 256, 4097, 300_000, 3 * MIB + 5, 64 * MIB, 256 * MIB + 4096):
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        buf = pool.allocate(nbytes)
        assert buf.ptr % 256 == 0
        buf.copy_from_host(data)
        kept.append((buf, data))
    for buf, data in kept:
        assert np.array_equal(buf.copy_to_host(), data)
    big = pool.allocate(kept[-1][0].nbytes)
    big.copy_from_host(kept[-1][0])                 # device to device, across pages
    assert np.array_equal(big.copy_to_host(), kept[-1][1])


def test_growth_joins_the_free_end_of_the_segment(pool):
    a = pool.allocate(64 * MIB)
    start = a.ptr
    del a                                           # the free end of the segment
    b = pool.allocate(96 * MIB)                     # maps only the 32 MiB more it needs
    assert b.ptr == start and pool.stats().reserved_bytes == 96 * MIB
    b.memset(3)
    assert (b.copy_to_host()[::MIB] == 3).all()


def test_trim_gives_whole_free_pages_back_to_the_device(pool):
    before = device_used(pool)
    keep = pool.allocate(8 * MIB)
    keep.memset(5)
    temp = pool.allocate(512 * MIB)
    temp.memset(9)
    assert device_used(pool) - before >= 520 * MIB
    del temp
    released = pool.trim()                          # synchronizes: the memset is done
    assert released >= 512 * MIB
    assert device_used(pool) - before < 64 * MIB
    assert (keep.copy_to_host() == 5).all()         # a live block's pages stay mapped
    again = pool.allocate(512 * MIB)                # maps pages again
    again.memset(1)
    assert (again.copy_to_host()[::MIB] == 1).all()


def test_growth_moves_cold_free_pages_and_the_live_pages_keep_their_data(pool):
    g = pool.upstream.granularity
    live = [pool.allocate(g)]
    holes = []
    for _ in range(2):                              # two free pieces of 3 pages between
        holes.append(pool.allocate(3 * g))          # live pages: 6 free pages, no 5 in one
        live.append(pool.allocate(g))
    small = pool.allocate(512)
    for i, buf in enumerate(live):
        buf.memset(i + 1)
    del holes
    for _ in range(200):                            # allocations that leave them cold
        del small
        small = pool.allocate(512)
    reserved, used = pool.stats().reserved_bytes, device_used(pool)
    big = pool.allocate(5 * g)                      # the 6 pages move: one fewer mapped
    assert pool.stats().reserved_bytes == reserved - g
    assert pool.stats().peak_reserved_bytes == reserved
    assert device_used(pool) <= used
    big.memset(9)
    assert (big.copy_to_host()[::4096] == 9).all()
    for i, buf in enumerate(live):
        assert (buf.copy_to_host() == i + 1).all()
    del small


def test_a_block_freed_on_a_busy_stream_reaches_another_only_behind_its_work(pool):
    cupy = pytest.importorskip("cupy")
    slow = cupy.RawKernel(r"""
    extern "C" __global__ void slow_fill(unsigned char* p, long long n, long long spins) {
        long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
        for (long long k = 0; k < spins; ++k) __nanosleep(100);
        for (; i < n; i += (long long)gridDim.x * blockDim.x) p[i] = 42;
    }""", "slow_fill")
    a = cupy.cuda.Stream(non_blocking=True)
    b = cupy.cuda.Stream(non_blocking=True)
    n = 8 * MIB
    small = pool.allocate(256, stream=a.ptr)
    buf = pool.allocate(n, stream=a.ptr)
    ptr = buf.ptr
    with a:
        slow((64,), (256,), (cupy.uint64(ptr), cupy.int64(n), cupy.int64(20_000)))
    del buf                                         # the kernel still writes it on a
    first = pool.allocate(n, stream=b.ptr)          # a's block has no event yet: another
    assert first.ptr != ptr
    del small
    kept = pool.allocate(256, stream=a.ptr)         # a allocates: an event marks its work
    second = pool.allocate(n, stream=b.ptr)         # a's block, behind a GPU-side wait
    assert second.ptr == ptr
    second.memset(7, stream=b.ptr)                  # ordered after the kernel's 42s
    assert (second.copy_to_host(stream=b.ptr) == 7).all()
    a.synchronize()
    del kept


def test_cupy_and_torch_read_vmm_memory(pool):
    cupy = pytest.importorskip("cupy")
    buf = pool.allocate(4 * MIB)
    view = cupy.from_dlpack(buf.view("float32", (1 << 20,)))
    view[:] = cupy.arange(1 << 20, dtype=cupy.float32)
    assert float(view.sum()) == float(np.arange(1 << 20, dtype=np.float64).sum())
    torch = pytest.importorskip("torch")
    tensor = torch.from_dlpack(buf.view("float32", (1 << 20,)))
    assert tensor.device.type == "cuda" and int(tensor[12345]) == 12345
