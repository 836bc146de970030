"""Pool policy on the simulated device: sizes, alignment, best fit, cut and join, segments, trim,
stats, threads."""

import contextlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import check_invariants
from hypothesis import given
from hypothesis import strategies as st

import gpupool

MIB = 1 << 20
LARGE = 12 << 20      # above the segment limit (10 MiB): each block is its own upstream allocation


@given(st.integers(min_value=1, max_value=1 << 40))
def test_size_class_is_the_request_rounded_up_to_512_bytes(nbytes):
    size = gpupool.size_class(nbytes)
    assert size % 512 == 0
    assert nbytes <= size <= nbytes + 511


def test_size_classes_are_monotonic():
    sizes = [gpupool.size_class(n) for n in range(1, 1 << 17, 97)]
    assert sizes == sorted(sizes)


@pytest.mark.parametrize("nbytes", [1, 255, 256, 257, 1000, 4097, 70_000, 300_000, LARGE + 1])
def test_blocks_are_256_byte_aligned(pool, nbytes):
    bufs = [pool.allocate(nbytes) for _ in range(5)]
    for buf in bufs:
        assert buf.ptr % 256 == 0
        assert buf.nbytes == nbytes


def test_zero_bytes_gives_empty_buffer_without_upstream_call(pool, sim):
    buf = pool.allocate(0)
    assert buf.ptr == 0 and buf.nbytes == 0
    assert buf.__cuda_array_interface__["shape"] == (0,)
    assert sim.calls == []
    del buf
    assert pool.stats().num_allocs == 0


@pytest.mark.parametrize(
    "nbytes, error",
    [(-1, ValueError), (1 << 60, ValueError), (1.5, TypeError), ("10", TypeError),
     (None, TypeError), (True, TypeError)],
)
def test_bad_sizes_raise_before_allocating(pool, sim, nbytes, error):
    with pytest.raises(error):
        pool.allocate(nbytes)
    assert sim.calls == []
    check_invariants(pool)


def test_numpy_integer_sizes_are_accepted(pool):
    np = pytest.importorskip("numpy")
    assert pool.allocate(np.int64(100)).nbytes == 100


def test_small_blocks_share_a_segment(pool, sim):
    bufs = [pool.allocate(1000) for _ in range(100)]
    assert len(sim.calls_named("alloc")) == 1
    assert len({b.ptr for b in bufs}) == 100
    stats = check_invariants(pool)
    assert stats.in_use_bytes == 100 * 1024


def test_a_segment_goes_back_only_when_all_its_blocks_are_free(pool, sim):
    bufs = [pool.allocate(1000) for _ in range(3)]
    del bufs[0]
    assert pool.trim() == 0
    assert sim.calls_named("free") == []
    bufs.clear()
    assert pool.trim() == 2 << 20
    assert len(sim.calls_named("free")) == 1
    assert sim.used == 0
    assert check_invariants(pool).reserved_bytes == 0


def test_trim_releases_large_cached_blocks_and_synchronizes_first(pool, sim):
    buf = pool.allocate(LARGE)
    sim.launch(0)
    del buf
    assert pool.trim() == LARGE
    assert [name for name, _ in sim.calls][-3:] == ["synchronize", "free", "trim"]
    assert sim.used == 0
    stats = check_invariants(pool)
    assert stats.upstream_frees == 1


def test_stats_bookkeeping(pool):
    a = pool.allocate(LARGE)
    b = pool.allocate(1000)
    stats = check_invariants(pool)
    assert stats.num_allocs == 2 and stats.num_frees == 0
    assert stats.in_use_bytes == LARGE + 1024
    assert stats.cache_misses == 2 and stats.cache_hits == 0
    del a
    stats = check_invariants(pool)
    assert stats.num_frees == 1 and stats.in_use_bytes == 1024
    assert stats.peak_in_use_bytes == LARGE + 1024
    c = pool.allocate(LARGE)
    assert check_invariants(pool).cache_hits == 1
    del b, c
    pool.reset_peak_stats()
    stats = check_invariants(pool)
    assert stats.peak_in_use_bytes == 0
    assert stats.as_dict()["num_allocs"] == 3


def test_pool_status_on_the_simulated_device_names_it_not_a_gpu(pool, capsys):
    buf = pool.allocate(1000)
    gpupool.pool_status(pool=pool)
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("Simulated device memory usage: ") and "GPU" not in first
    assert second == "Memory pool usage: 1.000 KiB (2.000 MiB reserved)"
    del buf


def test_pool_status_of_something_that_is_not_a_pool_is_a_clear_error():
    with pytest.raises(TypeError, match="takes a gpupool.Pool, got int"):
        gpupool.pool_status(pool=42)


def test_buffers_freed_from_other_threads(pool):
    import threading

    bufs = [pool.allocate(1000 + i) for i in range(200)]
    bufs += [pool.allocate(LARGE) for _ in range(4)]

    def drop(chunk):
        chunk.clear()

    chunks = [bufs[i::4] for i in range(4)]
    bufs.clear()
    threads = [threading.Thread(target=drop, args=(c,)) for c in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = check_invariants(pool)
    assert stats.in_use_bytes == 0 and stats.num_frees == 204


def test_threads_allocating_and_freeing_at_once_keep_the_pool_consistent(pool, sim):
    # Cached allocate/free pairs from 8 threads meet on the pool's lock (its contended path:
    # spin, then futex wait); every buffer is filled and checked, so a block handed to two
    # threads at once shows as a wrong byte.
    import threading

    errors = []
    for size in (1000, 4000, LARGE):          # warm the cache so the loop is all hits
        [pool.allocate(size) for _ in range(8)]

    def work(tag):
        try:
            for i in range(300):
                buf = pool.allocate((1000, 4000, LARGE)[i % 3])
                buf.memset(tag)
                if not (buf.copy_to_host()[:64] == tag).all():
                    errors.append(f"thread {tag}: block shared with another thread")
                del buf
        except Exception as exc:               # pragma: no cover - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = check_invariants(pool)
    assert stats.in_use_bytes == 0 and stats.num_allocs == stats.num_frees


def test_regions_nest_64_deep_on_a_thread_then_a_clear_error(pool):
    with contextlib.ExitStack() as stack:
        for _ in range(64):
            stack.enter_context(gpupool.uncached())
        with pytest.raises(gpupool.GpupoolError, match="nested more than 64"):
            gpupool.Region(pool=pool).__enter__()
    region = gpupool.Region(pool=pool)        # the failed entry left no trace
    with region:
        buf = pool.allocate(1000)
    assert region.stats().cache_misses == 1 and region.stats().entries == 1
    del buf


def test_shutdown_with_live_buffers_is_silent():
    code = """
import gpupool
from gpupool.testing import SimulatedDevice
pool = gpupool.Pool(upstream=SimulatedDevice())
keep = [pool.allocate(n) for n in (10, 5000, 1 << 20)]
region = gpupool.Region(pool=pool)
with region:
    more = pool.allocate(100)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0
    assert result.stderr == ""


def test_memory_stats_in_pytorch_form(sim):
    pool = gpupool.Pool(upstream=type(sim)(capacity=4 << 20))
    a = pool.allocate(MIB)          # a 2 MiB segment; the 1000 B below are cut from it
    b = pool.allocate(1000)
    del b
    with pytest.raises(gpupool.OutOfMemoryError):
        pool.allocate(8 << 20)
    stats = pool.memory_stats()
    assert stats["allocated_bytes.all.current"] == MIB
    assert stats["allocated_bytes.all.peak"] == MIB + 1024
    assert stats["allocated_bytes.all.allocated"] == MIB + 1024
    assert stats["allocated_bytes.all.freed"] == 1024
    assert stats["reserved_bytes.all.current"] == pool.stats().reserved_bytes
    assert stats["allocation.all.current"] == 1 and stats["allocation.all.allocated"] == 2
    assert stats["segment.all.current"] == stats["num_device_alloc"] - stats["num_device_free"]
    assert stats["num_ooms"] == 1 and stats["num_alloc_retries"] >= 1
    del a


def test_hits_plus_misses_count_allocations_even_after_out_of_memory(sim):
    pool = gpupool.Pool(upstream=type(sim)(capacity=4 << 20))
    pool.allocate(1000)
    with pytest.raises(gpupool.OutOfMemoryError):
        pool.allocate(1 << 40)
    stats = pool.stats()
    assert stats.num_allocs == stats.cache_hits + stats.cache_misses == 1
