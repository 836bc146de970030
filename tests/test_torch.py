"""PyTorch allocates from gpupool through the extension's pluggable-allocator entry points
(marked gpu)."""

import pytest

import gpupool

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


@pytest.mark.usefixtures("restore_default_pool")
def test_torch_mempool_allocates_from_gpupool():
    from torch.cuda.memory import CUDAPluggableAllocator

    from gpupool import _capi

    pool = gpupool.Pool(device=0)
    gpupool.set_pool(pool)
    allocator = CUDAPluggableAllocator(_capi.__file__, "gpupool_torch_malloc",
                                       "gpupool_torch_free")
    mempool = torch.cuda.MemPool(allocator.allocator())
    with torch.cuda.use_mem_pool(mempool):
        x = torch.ones(1 << 20, device="cuda")
        y = x * 3
    assert pool.stats().in_use_bytes >= 4 << 20         # its segments come from gpupool
    assert float(y.sum()) == 3 * (1 << 20)
    before = pool.stats().num_allocs
    z = torch.ones(1 << 20, device="cuda")              # outside: PyTorch's own allocator
    assert pool.stats().num_allocs == before
    del x, y, z, mempool
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
