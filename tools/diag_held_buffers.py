"""Diagnostic for the GPU machine (run it under compute-sanitizer too): after a CuPy loop, which
objects keep arrays alive? Runs the loop on gpupool's allocator and on CuPy's own pool, and
prints, for a few surviving gpupool buffers, where they were allocated and the chain of objects
(frames and tracebacks included) that holds them."""
import gc
import sys
import traceback
import types
import weakref

import cupy

import gpupool

pool = gpupool.Pool(device=0)
refs = []


def alloc(nbytes):
    buf = pool.allocate(nbytes, cupy.cuda.get_current_stream().ptr)
    refs.append((weakref.ref(buf), len(refs), traceback.format_stack(limit=5)[:-1]))
    return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(buf.ptr, nbytes, buf, 0), 0)


def loop(steps):
    w = cupy.random.standard_normal((256, 256), dtype=cupy.float32)
    for _ in range(steps):
        x = cupy.random.standard_normal((512, 256), dtype=cupy.float32)
        y = cupy.tanh(x @ w) * 2 + 1
        y.sum()
    cupy.cuda.Device().synchronize()


def describe(obj):
    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_filename}:{obj.f_lineno} {obj.f_code.co_name}"
    if isinstance(obj, types.TracebackType):
        return f"traceback line {obj.tb_lineno}"
    if isinstance(obj, BaseException):
        return f"exception {type(obj).__name__}: {obj}"[:200]
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def holders(obj, depth, skip):
    if depth == 0:
        return
    for r in gc.get_referrers(obj):
        if id(r) in skip:
            continue
        print("    " * (5 - depth) + describe(r))
        holders(r, depth - 1, skip | {id(r)})


cupy_pool = cupy.get_default_memory_pool()
loop(2)
before = cupy_pool.used_bytes()
loop(20)
gc.collect()
print("CuPy's own pool: used bytes before", before, "after 20 more steps", cupy_pool.used_bytes())

with cupy.cuda.using_allocator(alloc):
    loop(20)
gc.collect()
alive = [(r(), i, st) for r, i, st in refs if r() is not None]
print("gpupool: allocated", len(refs), "alive after the loop", len(alive), pool.stats())
skip = {id(alive), id(refs), id(sys._getframe())}
for obj, i, stack in alive[1:3]:
    print("== alive: allocation #", i, "refcount", sys.getrefcount(obj), "allocated at")
    print("".join(stack[-2:]))
    holders(obj, 5, skip | {id(obj)})
