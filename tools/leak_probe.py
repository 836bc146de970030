"""Diagnostic: which objects keep CuPy's gpupool buffers alive in a loop (run it under
compute-sanitizer, where the GPU tests saw buffers outlive their loop iteration)."""

import gc
import weakref

import cupy

import gpupool
import gpupool.cupy

pool = gpupool.Pool(device=0)
alive = []
base = gpupool.cupy.allocator(pool)


def alloc(nbytes):
    ptr = base(nbytes)
    alive.append(weakref.ref(ptr.mem._owner))
    return ptr


with cupy.cuda.using_allocator(alloc):
    w = cupy.random.standard_normal((256, 256), dtype=cupy.float32)
    for _ in range(20):
        x = cupy.random.standard_normal((512, 256), dtype=cupy.float32)
        y = cupy.tanh(x @ w) * 2 + 1
        y.sum()
survivors = [r() for r in alive if r() is not None]
print("buffers alive after the loop:", len(survivors), "of", len(alive), pool.stats())
for buf in survivors[:3]:
    for holder in gc.get_referrers(buf):
        print("  held by", type(holder).__name__, repr(holder)[:150])
        for outer in gc.get_referrers(holder)[:4]:
            print("     held by", type(outer).__name__, repr(outer)[:150])
gc.collect()
print("after gc.collect():", sum(r() is not None for r in alive), "alive")
