"""CuPy reads DeviceBuffers and allocates from gpupool, and its arrays live over memory put to
sleep and woken (Note [Sleep and wake]) (marked gpu)."""

import numpy as np
import pytest
from conftest import SLOW_WRITE, flat_memory_unmeasurable

import gpupool

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
import gpupool.cupy  # noqa: E402

MIB = 1 << 20


@pytest.fixture
def pool():
    return gpupool.Pool(device=0)


def test_cupy_reads_a_device_buffer_without_copying(pool):
    data = np.arange(4096, dtype=np.uint8)
    buf = pool.allocate(data.nbytes)
    buf.copy_from_host(data)
    view = cupy.asarray(buf)
    assert view.data.ptr == buf.ptr
    assert cupy.asnumpy(view).tobytes() == data.tobytes()
    view[:] = 3                                  # and writes land in the buffer
    assert (buf.copy_to_host() == 3).all()


def test_cupy_arrays_come_from_the_pool(pool):
    with cupy.cuda.using_allocator(gpupool.cupy.allocator(pool)):
        x = cupy.arange(MIB, dtype=cupy.float32)
        assert pool.stats().in_use_bytes >= 4 * MIB
        assert float(x.sum()) == float(np.arange(MIB, dtype=np.float32).sum())
        empty = cupy.empty(0)
        assert empty.size == 0
    del x
    assert pool.stats().in_use_bytes == 0


@flat_memory_unmeasurable
def test_cupy_loop_under_the_adapter_holds_reserved_memory_flat(pool):
    reserved = []
    with cupy.cuda.using_allocator(gpupool.cupy.allocator(pool)):
        w = cupy.random.standard_normal((256, 256), dtype=cupy.float32)
        for _ in range(200):
            x = cupy.random.standard_normal((512, 256), dtype=cupy.float32)
            y = cupy.tanh(x @ w) * 2 + 1
            y.sum()
            reserved.append(pool.stats().reserved_bytes)
    assert reserved[10] == reserved[-1], (reserved[:12], reserved[-3:], pool.stats())


def test_region_gives_cupy_steps_the_same_addresses(pool):
    region = gpupool.Region(pool=pool)
    seen = []
    with cupy.cuda.using_allocator(gpupool.cupy.allocator(pool)):
        for _ in range(4):
            with region:
                a = cupy.ones((1000, 1000), dtype=cupy.float32)
                b = a * 2
                seen.append((a.data.ptr, b.data.ptr))
                del a, b
    assert len(set(seen)) == 1


def test_cupy_allocation_follows_the_current_stream(pool):
    stream = cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.using_allocator(gpupool.cupy.allocator(pool)), stream:
        x = cupy.zeros(100, dtype=cupy.uint8)
    owner = x.data.mem._owner                     # the UnownedMemory keeps our buffer alive
    assert isinstance(owner, gpupool.DeviceBuffer)
    assert owner.stream == stream.ptr


def test_block_goes_to_another_stream_only_behind_the_kernel_still_writing_it(pool):
    kernel = cupy.RawKernel(SLOW_WRITE, "slow_write")
    a = cupy.cuda.Stream(non_blocking=True)
    b = cupy.cuda.Stream(non_blocking=True)
    n = 8 * MIB
    small = pool.allocate(256, stream=a.ptr)      # the block a allocates again below
    buf = pool.allocate(n, stream=a.ptr)
    first = buf.ptr
    with a:
        kernel((64,), (256,), (cupy.uint64(buf.ptr), cupy.int64(n), cupy.int64(200_000_000)))
    del buf                                       # the kernel is still running on a
    other = pool.allocate(n, stream=b.ptr)        # a's block has no event yet: a new block
    assert other.ptr != first
    del small
    # a is alive: an event marks its work (kept alive: its free would join a's free block,
    # which drops the event, to be recorded again when next wanted).
    kept = pool.allocate(256, stream=a.ptr)
    third = pool.allocate(n, stream=b.ptr)        # a's block, behind a GPU-side wait
    assert third.ptr == first
    third.memset(7, stream=b.ptr)                 # ordered after the slow kernel's 42s
    assert (third.copy_to_host(stream=b.ptr) == 7).all()
    del kept


def test_step_captured_as_a_cuda_graph_inside_a_region_replays_like_eager_runs(pool):
    # Elementwise kernels only: CuPy refuses cuBLAS calls during stream capture.
    rng = np.random.default_rng(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    region = gpupool.Region(pool=pool)
    with cupy.cuda.using_allocator(gpupool.cupy.allocator(pool)), stream:
        a = cupy.asarray(rng.standard_normal(256, dtype=np.float32))
        x = cupy.empty((128, 256), dtype=cupy.float32)

        def step():
            h = cupy.tanh(x * a + 1)
            g = h * h - x
            return g * 0.5 + h

        x.set(rng.standard_normal((128, 256), dtype=np.float32), stream=stream)
        with region:                         # eager warm-up: the region caches the step's blocks
            step()
        with region:                         # same sizes: every block is a cache hit, no driver
            before = region.stats()
            stream.begin_capture()
            try:
                out = step()
            finally:
                graph = stream.end_capture()
        after = region.stats()
        assert after.cache_misses == before.cache_misses
        assert after.cache_hits > before.cache_hits
        for _ in range(100):
            x.set(rng.standard_normal((128, 256), dtype=np.float32), stream=stream)
            graph.launch(stream)
            replayed = out.get(stream=stream)
            eager = step().get(stream=stream)
            np.testing.assert_allclose(replayed, eager, rtol=1e-6)


@pytest.mark.parametrize("captured", ["planned", "record"])
def test_step_captured_inside_a_planned_region_replays_like_eager_runs(pool, captured):
    # The 6th entry is captured, served from the plan made from the first ones ("planned"),
    # or an entry of 4 times the most rows seen, a record step planned at its first request
    # ("record"): its warm entries alternate 128 and 24 rows, so that the planner sees which
    # sizes follow the first request's (sizes that never varied keep their places' sizes), and
    # request 0 varies enough for a record step at 512 (none past the most times the factor it
    # varied by, 128 * 128 / 24 rows: Note [Record steps that leave nothing]).
    # Eager entries of the region between replays get the same places for the same requests
    # (Note [Capture in a planned region]). On CuPy the fourth exit makes the first plan:
    # the first entry's step differs from the later ones.
    rng = np.random.default_rng(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    region = gpupool.Region(pool=pool, plan=True)
    with cupy.cuda.using_allocator(gpupool.cupy.allocator(pool)), stream:
        a = cupy.asarray(rng.standard_normal(256, dtype=np.float32))

        def step(x):                        # elementwise kernels only (no cuBLAS in a capture)
            h = cupy.tanh(x * a + 1)
            g = h * h - x
            return g * 0.5 + h

        def rows(n):
            x = cupy.empty((n, 256), dtype=cupy.float32)
            x.set(rng.standard_normal((n, 256), dtype=np.float32), stream=stream)
            return x

        for i in range(5):
            x = rows(24 if captured == "record" and i % 2 else 128)
            with region:
                out = step(x)
        x = rows(512 if captured == "record" else 128)
        before = region.stats()
        with region:
            stream.begin_capture()
            try:
                out = step(x)
            finally:
                graph = stream.end_capture()
        after = region.stats()
        assert after.plan_hits > before.plan_hits, (before, after)
        assert after.record_plans == before.record_plans + (captured == "record"), after
        for i in range(20):
            x.set(rng.standard_normal(x.shape, dtype=np.float32), stream=stream)
            graph.launch(stream)
            replayed = out.get(stream=stream)
            if i % 2:
                eager = step(x).get(stream=stream)
            else:
                with region:
                    eager = step(x).get(stream=stream)
            np.testing.assert_allclose(replayed, eager, rtol=1e-6)


def expandable(pool):
    """``pool``, whose default upstream is the expandable one where the device has virtual
    memory management (sleep needs it); skips otherwise."""
    if not pool.upstream.expandable:
        pytest.skip("the device has no virtual memory management: sleep needs upstream='vmm'")
    return pool


def test_cupy_arrays_over_slept_memory_keep_their_addresses_and_values(pool):
    vmm_pool = expandable(pool)
    with cupy.cuda.using_allocator(gpupool.cupy.allocator(vmm_pool)):
        with gpupool.tag("cupy-weights"):
            x = cupy.arange(MIB, dtype=cupy.float32)
            gone = cupy.ones(MIB // 4, dtype=cupy.float32)
        ptr, expected = x.data.ptr, cupy.asnumpy(x)
        vmm_pool.sleep("cupy-weights", offload=True)
        assert vmm_pool.stats().asleep_bytes >= 5 * MIB
        # No array of the tag is used while asleep: a kernel on unmapped memory would fault.
        with gpupool.tag("cupy-weights"), pytest.raises(gpupool.SleepingMemoryError,
                                                        match="'cupy-weights'.*wake"):
            cupy.empty(1000, dtype=cupy.uint8)
        del gone                                    # freed while asleep
        assert float(cupy.ones(1000, dtype=cupy.float32).sum()) == 1000.0   # untagged: go on
        vmm_pool.wake("cupy-weights")
        assert x.data.ptr == ptr
        np.testing.assert_array_equal(cupy.asnumpy(x), expected)
        x += 1
        assert float(x[-1]) == MIB
        del x
    assert vmm_pool.stats().asleep_bytes == 0 and vmm_pool._verify() == []


def test_a_sleeping_buffer_is_not_handed_to_cupy(pool):
    vmm_pool = expandable(pool)
    with gpupool.tag("cupy-buffer"):
        buf = vmm_pool.allocate(4096)
    view = cupy.asarray(buf)
    view[:] = 5
    vmm_pool.sleep("cupy-buffer", offload=True)
    for use in (lambda: cupy.asarray(buf), lambda: cupy.from_dlpack(buf),
                lambda: buf.copy_to_host()):
        with pytest.raises(gpupool.SleepingMemoryError, match="sleeps"):
            use()
    vmm_pool.wake("cupy-buffer")
    assert view.data.ptr == buf.ptr and (cupy.asnumpy(view) == 5).all()
    assert (cupy.asnumpy(cupy.asarray(buf)) == 5).all()
