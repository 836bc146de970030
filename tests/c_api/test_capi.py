"""The C API: tests build examples/c_extension and drive it against the simulated device (and
the real one where there is a GPU)."""

import ctypes
import gc
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from capi_table import Table, allocate, api, call, ptr_out, size_out, stats
from conftest import REPO, check_balanced, check_invariants, threads_together

import gpupool
from gpupool.testing import SimulatedDevice

EXAMPLE = REPO / "examples" / "c_extension"


def build(tmp, cflags=""):
    src = tmp / "src"
    shutil.copytree(EXAMPLE, src)
    args = [sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp / "lib"),
            "--build-temp", str(tmp / "build")]
    env = dict(os.environ, CFLAGS=f"{os.environ.get('CFLAGS', '')} {cflags}")
    result = subprocess.run(args, cwd=src, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return next((tmp / "lib").glob("gpupool_scratch*"))


def load(path):
    spec = importlib.util.spec_from_file_location("gpupool_scratch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return load(build(tmp_path_factory.mktemp("capi")))


pytestmark = pytest.mark.usefixtures("default_pools")


class CountingDevice(SimulatedDevice):
    """A simulated device that counts its stream ID lookups (cuStreamGetId)."""

    lookups = 0

    def _stream_id(self, stream):
        self.lookups += 1
        return super()._stream_id(stream)


@pytest.fixture
def sim_pool():
    gc.collect()    # pools of earlier tests in cycles: each holds one of this thread's 8 slots
    sim = CountingDevice()
    pool = gpupool.Pool(upstream=sim, device=0)
    gpupool.set_pool(pool)
    yield pool
    assert sim.errors == []


def test_c_allocations_come_from_the_shared_pool(scratch, sim_pool):
    ptr = scratch.allocate(1000)
    assert ptr % 256 == 0
    stats = check_invariants(sim_pool)
    assert stats.in_use_bytes == 1024 and stats.num_allocs == 1
    assert scratch.stats()["in_use_bytes"] == 1024
    python_buf = sim_pool.allocate(1000)
    assert python_buf.ptr != ptr
    scratch.free(ptr)
    assert sim_pool.stats().in_use_bytes == 1024
    del python_buf
    assert scratch.allocate(1000) == ptr            # the same cached block


def test_the_c_api_stats_are_the_pools_counters(scratch, sim_pool):
    kept = [scratch.allocate(n) for n in (1000, 300_000, 5 << 20)]
    scratch.free(kept.pop())
    buf = sim_pool.allocate(64 << 10)
    del buf
    sim_pool.trim()
    # Every counter of the C API's record; the sleep counters (asleep, offloaded, pinned) are
    # not in it.
    pool_stats = sim_pool.stats().as_dict()
    assert pool_stats.pop("asleep_bytes") == pool_stats.pop("offloaded_bytes") == 0
    assert pool_stats.pop("pinned_bytes") == 0
    assert scratch.stats() == pool_stats
    for ptr in kept:
        scratch.free(ptr)


def test_scratch_per_call(scratch, sim_pool):
    seen = []
    assert scratch.with_scratch(300_000, lambda p, n: seen.append((p, n)) or "done") == "done"
    assert scratch.with_scratch(300_000, lambda p, n: seen.append((p, n))) is None
    assert seen[0] == seen[1] and seen[0][1] == 300_000
    stats = check_invariants(sim_pool)
    assert stats.in_use_bytes == 0 and stats.cache_hits == 1


def test_errors_are_codes_not_crashes(scratch, sim_pool):
    with pytest.raises(RuntimeError, match="invalid value"):
        scratch.free(12345)                          # not from this API
    with pytest.raises(RuntimeError, match="invalid value"):
        scratch.allocate(0)
    with pytest.raises(RuntimeError, match="no CUDA driver, or no such device"):
        scratch.allocate(10, 63)                     # no pool for device 63 here
    small = gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 20))
    gpupool.set_pool(small)
    with pytest.raises(MemoryError, match="out of memory"):
        scratch.allocate(2 << 20)


def test_regions_cache_c_allocations_made_inside_them(scratch, sim_pool):
    region = gpupool.Region(pool=sim_pool)
    ptrs = []
    for _ in range(3):
        with region:
            ptrs.append(scratch.with_scratch(500_000, lambda p, n: p))
    assert ptrs[0] == ptrs[1] == ptrs[2]
    assert region.stats().cache_hits == 2


def test_abi_mismatch_is_refused(tmp_path):
    path = build(tmp_path, "-DGPUPOOL_API_VERSION=99")
    with pytest.raises(ImportError, match="version 2 .* does not match .* version 99"):
        load(path)


def test_header_is_found_with_get_include():
    assert (Path(gpupool.get_include()) / "gpupool.h").is_file()


@pytest.mark.gpu
def test_c_api_on_the_device(scratch):
    cupy = pytest.importorskip("cupy")
    pool = gpupool.Pool(device=0)
    gpupool.set_pool(pool)
    ptr = scratch.allocate(1 << 20)
    assert pool.stats().in_use_bytes == 1 << 20
    memory = cupy.cuda.UnownedMemory(ptr, 1 << 20, None, 0)
    view = cupy.ndarray(1 << 20, cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))
    view.fill(9)
    assert int((view == 9).sum()) == 1 << 20
    scratch.free(ptr)
    assert pool.stats().in_use_bytes == 0
    assert scratch.bench(4096, 10_000) > 0


def test_set_pool_makes_the_default_without_a_driver(sim_pool):
    assert gpupool.get_pool() is sim_pool
    assert gpupool.allocate(10).pool is sim_pool
    assert gpupool.Region().pool is sim_pool


def test_many_c_allocations_freed_in_any_order(scratch, sim_pool):
    import random

    ptrs = [scratch.allocate(1000 + i % 7 * 300) for i in range(3000)]    # grows the table
    assert len(set(ptrs)) == 3000
    random.Random(0).shuffle(ptrs)
    for ptr in ptrs[:1500]:
        scratch.free(ptr)
    again = [scratch.allocate(1000) for _ in range(500)]                 # reuses deleted slots
    for ptr in ptrs[1500:] + again:
        scratch.free(ptr)
    with pytest.raises(RuntimeError, match="invalid value"):
        scratch.free(ptrs[0])                                            # freed twice
    stats = check_invariants(sim_pool)
    assert stats.in_use_bytes == 0 and stats.num_frees == 3500


def test_a_stream_the_driver_refuses_fails_the_allocation_not_the_free(scratch, sim_pool):
    sim = sim_pool.upstream
    stream = sim.create_stream()
    ptr = scratch.allocate(1000, 0, stream)
    sim.destroy_stream(stream)
    with pytest.raises(RuntimeError, match="gpupool error"):
        scratch.allocate(1000, 0, stream)          # destroyed: the driver refuses the handle
    scratch.free(ptr, 0, stream)                   # the free still gives the block back
    assert sim_pool.stats().in_use_bytes == 0
    sim.errors.clear()                             # the refused handle was this test's doing


def test_a_block_a_thread_took_from_its_magazine_is_freed_by_pointer_on_any_thread(
        scratch, sim_pool):
    from concurrent.futures import ThreadPoolExecutor

    def take_twice():
        ptr = scratch.allocate(1000)
        scratch.free(ptr)                           # into this thread's magazine
        return ptr, scratch.allocate(1000)          # taken from it, without the pool's lock

    # A fresh thread: a thread keeps magazines for 8 pools at most (GP_THREAD_POOLS), and
    # the main thread's table may be full of the pools earlier GPU tests keep alive.
    with ThreadPoolExecutor(1) as owner:
        ptr, again = owner.submit(take_twice).result()
        assert again == ptr
        assert sim_pool._magazines_info()[0]["handed"] == 1
        with ThreadPoolExecutor(1) as worker:       # the free of another thread finds it
            worker.submit(scratch.free, again).result()
        assert sim_pool._magazines_info()[0]["handed"] == 0
    with pytest.raises(Exception, match="invalid value"):
        scratch.free(again)                         # freed once: a second free is refused
    stats = check_invariants(sim_pool)
    assert (stats.in_use_bytes, stats.num_allocs, stats.num_frees) == (0, 2, 2)


def test_c_api_loops_on_threads_without_the_gil_keep_the_counts_exact(sim_pool):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import _cext
        loop = _cext.build("gpupool_bench_loop", [str(REPO / "bench" / "_capi_loop.c")])
    except Exception as exc:                        # no compiler: nothing to run
        pytest.skip(f"the C loop did not build: {exc}")
    finally:
        sys.path.pop(0)
    sizes, pairs, threads = [256, 4096, 70_000, 1 << 20, 16 << 20], 5000, 4
    threads_together(loop.loop, [(sizes, pairs)] * threads)
    check_balanced(sim_pool, threads * pairs)
    assert sum(m["handed"] for m in sim_pool._magazines_info()) == 0


# Version 2 of the table, called through ctypes (tests/capi_table.py) -----------------------

def test_the_table_is_laid_out_as_the_header_says():
    table = api()
    assert (table.version, table.size) == (2, ctypes.sizeof(Table))


def test_free_ptr_needs_no_stream_and_finds_the_device(sim_pool):
    stream = sim_pool.upstream.create_stream()
    ptr = allocate(1000, 0, stream)
    assert call("free_ptr", 5, ptr) == 0                # another device first, then device 0
    assert sim_pool.stats().in_use_bytes == 0
    assert allocate(1000, 0, stream) == ptr             # freed on its allocation stream
    assert call("free_ptr", 0, ptr) == 0
    assert call("free_ptr", 0, ptr) == 1                # not handed out any more
    assert call("free_ptr", 0, None) == 0


def test_stats_reach_the_cumulative_counters(sim_pool):
    ptrs = [allocate(n) for n in (1000, 5000)]
    call("free_ptr", 0, ptrs[0])
    counters = sim_pool._counters()
    pool_stats = sim_pool.stats().as_dict()
    for key in ("asleep_bytes", "offloaded_bytes", "pinned_bytes"):     # not in the C record
        del pool_stats[key]
    assert stats() == pool_stats | {
        name: counters[name] for name in ("num_ooms", "allocated_bytes", "freed_bytes")}
    assert stats()["allocated_bytes"] == 1024 + 5120 and stats()["freed_bytes"] == 1024
    call("free_ptr", 0, ptrs[1])


def test_trim_and_reset_peaks(sim_pool):
    ptr = allocate(3 << 20)
    call("free_ptr", 0, ptr)
    released = size_out()
    assert call("trim", 0, ctypes.byref(released)) == 0
    assert released.value == 4 << 20 and sim_pool.stats().reserved_bytes == 0
    assert call("trim", 0, None) == 0
    assert sim_pool.stats().peak_in_use_bytes == 3 << 20
    assert call("reset_peaks", 0) == 0
    stats_now = sim_pool.stats()
    assert (stats_now.peak_in_use_bytes, stats_now.peak_reserved_bytes) == (0, 0)


def test_cache_info_gives_the_largest_free_block_and_the_headroom(sim):
    pool = gpupool.Pool(upstream=sim, device=0, hard_limit="16MiB")
    gpupool.set_pool(pool)
    largest, headroom = size_out(), size_out()
    assert call("cache_info", 0, ctypes.byref(largest), ctypes.byref(headroom)) == 0
    assert (largest.value, headroom.value) == (0, 16 << 20)
    ptr = allocate(3 << 20)                             # a 4 MiB segment, 1 MiB of it free
    assert call("cache_info", 0, ctypes.byref(largest), ctypes.byref(headroom)) == 0
    assert (largest.value, headroom.value) == (1 << 20, 12 << 20)
    call("free_ptr", 0, ptr)
    assert call("cache_info", 0, ctypes.byref(largest), ctypes.byref(headroom)) == 0
    assert largest.value == 4 << 20
    unlimited = gpupool.Pool(upstream=SimulatedDevice(), device=0)
    gpupool.set_pool(unlimited)
    assert call("cache_info", 0, ctypes.byref(largest), ctypes.byref(headroom)) == 0
    assert headroom.value == 2 ** 64 - 1
    assert call("cache_info", 0, None, ctypes.byref(headroom)) == 1


def test_base_allocation_is_the_segment(sim_pool):
    first, second = allocate(1000), allocate(1000)      # one shared 2 MiB segment
    base, nbytes = ptr_out(), size_out()
    assert call("base_allocation", 0, second, ctypes.byref(base), ctypes.byref(nbytes)) == 0
    assert (base.value, nbytes.value) == (first, 2 << 20)
    call("free_ptr", 0, second)
    assert call("base_allocation", 0, second, ctypes.byref(base), ctypes.byref(nbytes)) == 1
    call("free_ptr", 0, first)


def test_a_free_on_the_blocks_own_created_stream_asks_the_driver_nothing(scratch,
                                                                         sim_pool):
    sim = sim_pool.upstream
    stream = sim.create_stream()
    ptr = scratch.allocate(1000, 0, stream)
    assert sim.lookups == 1                         # the allocation looks the stream up
    scratch.free(ptr, 0, stream)
    assert sim.lookups == 1                         # its free, on the same handle, does not
    assert scratch.allocate(1000, 0, stream) == ptr     # and filed it under the stream's key
    assert sim.lookups == 2
    scratch.free(ptr, 0, stream)
    check_invariants(sim_pool)


BIG = 16 << 20      # a block of its own (no shared segment), so the one of its size class


def test_a_free_on_another_created_stream_is_looked_up_and_keyed_by_it(scratch, sim_pool):
    sim = sim_pool.upstream
    first, second = sim.create_stream(), sim.create_stream()
    ptr = scratch.allocate(BIG, 0, first)
    sim.launch(second)                              # work still running on the second stream
    scratch.free(ptr, 0, second)
    assert sim.lookups == 2                         # the free named another stream: looked up
    assert scratch.allocate(BIG, 0, first) != ptr  # not the first stream's at once
    assert scratch.allocate(BIG, 0, second) == ptr     # the second stream's own block
    sim.complete()
    check_invariants(sim_pool)


def test_a_handle_reused_by_a_new_stream_does_not_hand_the_old_streams_block_out(
        scratch, sim_pool):
    sim = sim_pool.upstream
    old = sim.create_stream()
    ptr = scratch.allocate(BIG, 0, old)
    sim.launch(old)                                 # a kernel still using the block
    sim.destroy_stream(old)                         # returns at once, as cuStreamDestroy does
    new = sim.create_stream(reuse=old)              # the same handle, another stream ID
    scratch.free(ptr, 0, new)                       # filed under the old stream's key
    other = scratch.allocate(BIG, 0, new)
    assert other != ptr                             # so the new stream does not get it
    sim.complete()                                  # the old work done, and
    assert sim_pool.merge_streams() == 1       # the block made free for every stream:
    assert scratch.allocate(BIG, 0, new) == ptr    # not lost
    scratch.free(ptr, 0, new)
    scratch.free(other, 0, new)
    check_invariants(sim_pool)
