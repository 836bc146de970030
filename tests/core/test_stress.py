"""Stress on the H200 (marked gpu): 4 streams, random sizes, every buffer filled by a kernel
with a pattern unique to its holder and checked by a kernel on its stream before it is freed.
Any block handed to a new holder while an old holder's work could still touch it shows up as a
corrupted byte."""

import os

import numpy as np
import pytest

import gpupool

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

OPS = int(os.environ.get("GPUPOOL_STRESS_OPS", "100000"))

KERNELS = r"""
extern "C" __global__ void fill(unsigned int* out, long long n, unsigned int tag) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = tag ^ (unsigned int)i;
}
extern "C" __global__ void check(const unsigned int* data, long long n, unsigned int tag,
                                 unsigned long long* bad) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        if (data[i] != (tag ^ (unsigned int)i)) atomicAdd(bad, 1ULL);
}
"""


def test_four_streams_random_sizes_no_corruption():
    module = cupy.RawModule(code=KERNELS)
    fill, check = module.get_function("fill"), module.get_function("check")
    pool = gpupool.Pool(device=0)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(4)]
    bad = cupy.zeros(1, dtype=cupy.uint64)
    cupy.cuda.Device().synchronize()      # the counter is zero before any stream checks
    rng = np.random.default_rng(1)
    sizes = rng.choice([256, 4096, 65_536, 300_000, 1 << 20, 4 << 20], size=OPS)
    live = []
    for op in range(OPS):
        if live and (len(live) > 64 or rng.random() < 0.5):
            buf, stream, tag = live.pop(int(rng.integers(len(live))))
            n = buf.nbytes // 4
            check((32,), (256,), (buf.ptr, np.int64(n), np.uint32(tag), bad.data.ptr),
                  stream=stream)
            del buf                       # freed with the check still queued on its stream
            continue
        stream = streams[int(rng.integers(4))]
        buf = pool.allocate(int(sizes[op]), stream=stream.ptr)
        tag = np.uint32(op * 2654435761 % (1 << 32))
        fill((32,), (256,), (buf.ptr, np.int64(buf.nbytes // 4), tag), stream=stream)
        live.append((buf, stream, tag))
    for buf, stream, tag in live:
        check((32,), (256,), (buf.ptr, np.int64(buf.nbytes // 4), np.uint32(tag),
                              bad.data.ptr), stream=stream)
    cupy.cuda.Device().synchronize()
    assert int(bad.get()[0]) == 0
    stats = pool.stats()
    assert stats.num_allocs >= OPS // 3 and stats.cache_hits > stats.cache_misses
