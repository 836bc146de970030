"""Pool policy on the simulated device: sizes, alignment, reuse, streams, segments, trim, stats."""

import contextlib
import gc
import logging
import pickle
import subprocess
import sys

import numpy as np
import pytest
from conftest import check_invariants
from hypothesis import given
from hypothesis import strategies as st

import gpupool
from gpupool.testing import SimulatedDevice

MIB = 1 << 20
LARGE = 12 << 20      # above the segment limit (10 MiB): each block is its own upstream allocation


def small_segment_on(pool, stream):
    """Leave a free 2 MiB segment on ``stream``: a later small request on it (made to have the
    stream allocate again, which records its events) is cut from this segment, the best fit,
    rather than from a large free block of the stream, which would then lose its event."""
    pool.allocate(10, stream=stream)


def freed_behind_work(pool, sim, stream):
    """Free a LARGE block on ``stream`` behind queued work (the stream keeps a small free
    segment: small_segment_on); returns its pointer."""
    small_segment_on(pool, stream)
    buf = pool.allocate(LARGE, stream=stream)
    ptr = buf.ptr
    sim.launch(stream)
    del buf
    return ptr


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


def test_same_stream_reuse_returns_the_same_block(pool, sim):
    buf = pool.allocate(LARGE)
    ptr = buf.ptr
    sim.launch(0)                       # work on the block still pending: same stream is fine
    del buf
    again = pool.allocate(LARGE)
    assert again.ptr == ptr
    assert len(sim.calls_named("alloc")) == 1
    assert pool.stats().cache_hits == 1


def test_busy_block_goes_to_another_stream_behind_a_gpu_wait(pool, sim):
    b = sim.create_stream()
    buf = pool.allocate(LARGE)                    # legacy default stream
    ptr = buf.ptr
    sim.launch(0)
    queued = sim._queued[0]
    del buf
    other = pool.allocate(LARGE, stream=b)        # 0 is still busy: b waits for it on the GPU
    assert other.ptr == ptr
    (event_stream,) = [args[1] for args in sim.calls_named("event_record")]
    assert event_stream == 0
    assert [args[0] for args in sim.calls_named("stream_wait_event")] == [b]
    assert sim.pending(0) and sim.ordered(b, 0, queued)
    assert "synchronize" not in [name for name, _ in sim.calls]


def test_blocks_whose_streams_are_done_are_preferred(pool, sim):
    a, b, c = sim.create_stream(), sim.create_stream(), sim.create_stream()
    small_segment_on(pool, a)         # small requests on a and c cut these, not the large blocks
    small_segment_on(pool, c)
    first, second = pool.allocate(LARGE, stream=a), pool.allocate(LARGE, stream=c)
    busy, idle = first.ptr, second.ptr
    sim.launch(a)
    sim.launch(c)
    del first, second
    held = [pool.allocate(LARGE, stream=b)]       # no events yet: a new block; a, c asked
    pool.allocate(10, stream=a)                   # both streams allocate again: events
    pool.allocate(10, stream=c)
    sim.complete(c)
    held.append(pool.allocate(LARGE, stream=b))
    assert held[-1].ptr == idle
    assert sim.calls_named("stream_wait_event") == []
    held.append(pool.allocate(LARGE, stream=b))   # then the busy one, behind a GPU wait
    assert held[-1].ptr == busy
    assert sim.ordered(b, a, sim._queued[a])


def test_cross_stream_reuse_once_the_event_reports_complete(pool, sim):
    a, b = sim.create_stream(), sim.create_stream()
    ptr = freed_behind_work(pool, sim, a)
    held = pool.allocate(LARGE, stream=b)            # asks a for an event
    pool.allocate(10, stream=a)                      # ... which a records here
    sim.complete(a)
    assert pool.allocate(LARGE, stream=b).ptr == ptr
    assert held.ptr != ptr
    assert sim.calls_named("stream_wait_event") == []      # done: no wait needed


def test_a_smaller_request_cuts_a_cached_block_and_the_freed_piece_joins_back(pool, sim):
    buf = pool.allocate(LARGE)
    ptr = buf.ptr
    del buf
    assert pool.cached_blocks() == [(ptr, LARGE, False)]
    piece = pool.allocate(MIB + 1)                 # rounded to 512 B: 1 MiB + 512
    assert piece.ptr == ptr                        # the cached block, cut at its start
    assert gpupool.size_class(MIB + 1) == MIB + 512
    assert pool.stats().in_use_bytes == MIB + 512  # the piece, not the whole block, in use
    assert pool.cached_blocks() == [(ptr + MIB + 512, LARGE - MIB - 512, True)]
    assert len(sim.calls_named("alloc")) == 1 and pool.stats().cache_hits == 1
    del piece                                      # joins the rest: one block again
    assert pool.cached_blocks() == [(ptr, LARGE, False)]
    assert pool.allocate(LARGE).ptr == ptr         # whole again: serves the full size
    assert len(sim.calls_named("alloc")) == 1
    check_invariants(pool)


def test_best_fit_takes_the_smallest_cached_block_that_fits_lowest_address_first(pool, sim):
    sizes = (16 * MIB, 12 * MIB, 14 * MIB, 14 * MIB)     # each a segment of its own
    bufs = [pool.allocate(n) for n in sizes]
    ptrs = {n: sorted(b.ptr for b in bufs if b.nbytes == n) for n in sizes}
    del bufs
    assert len(pool.cached_blocks()) == 4
    first = pool.allocate(13 * MIB)                # 12 MiB is too small, 14 MiB the best fit
    assert first.ptr == ptrs[14 * MIB][0]          # of two equal blocks, the lower address
    second = pool.allocate(13 * MIB)
    assert second.ptr == ptrs[14 * MIB][1]
    rests = [(p + 13 * MIB, MIB, True) for p in ptrs[14 * MIB]]
    assert pool.cached_blocks() == sorted(rests + [(ptrs[12 * MIB][0], 12 * MIB, False),
                                                   (ptrs[16 * MIB][0], 16 * MIB, False)])
    third = pool.allocate(MIB - 1000)              # the smallest block that fits: a 1 MiB rest
    assert third.ptr == min(rests)[0]
    assert pool.stats().upstream_allocs == 4       # no growth: every request was cut
    del first, second, third
    check_invariants(pool)


def test_free_never_calls_the_driver(pool, sim):
    a = sim.create_stream()
    buf = pool.allocate(LARGE, stream=a)
    sim.calls.clear()
    del buf
    assert sim.calls == []


def test_buffer_may_outlive_its_stream(pool, sim):
    a, b = sim.create_stream(), sim.create_stream()
    buf = pool.allocate(LARGE, stream=a)
    ptr = buf.ptr
    sim.destroy_stream(a)
    del buf                              # nothing may touch the destroyed stream
    other = pool.allocate(LARGE, stream=b)
    assert other.ptr != ptr              # its work cannot be checked; a trim frees it for all
    del other
    assert pool.trim() == 2 * LARGE      # a trim synchronizes the device and frees both
    assert pool.stats().reserved_bytes == 0
    assert sim.errors == []


def test_other_streams_get_the_block_after_its_stream_allocates_again(pool, sim):
    a, b = sim.create_stream(), sim.create_stream()
    ptr = freed_behind_work(pool, sim, a)
    held = pool.allocate(LARGE, stream=b)    # a's block has no event yet: b gets a new block
    assert held.ptr != ptr
    assert sim.calls_named("event_record") == []
    pool.allocate(10, stream=a)              # a is alive: events now mark its work so far
    # One for each of a's free blocks: the large one and the free rest of the small segment.
    assert [args[1] for args in sim.calls_named("event_record")] == [a, a]
    assert pool.allocate(LARGE, stream=b).ptr == ptr      # b waits for it on the GPU
    assert sim.ordered(b, a, sim._queued[a])


def test_record_stream_orders_reuse_after_that_streams_work(pool, sim):
    other = sim.create_stream()
    buf = pool.allocate(LARGE)
    ptr = buf.ptr
    buf.record_stream(other)
    sim.launch(other)
    del buf
    queued = sim._queued[other]
    assert pool.allocate(LARGE).ptr == ptr          # its own stream now waits for `other`
    assert sim.ordered(0, other, queued)


def test_a_record_stream_use_survives_a_request_that_looked_at_its_block_and_took_another():
    sim = SimulatedDevice(page=4096)                # segments of exactly the request
    pool = gpupool.Pool(upstream=sim)
    other, side = sim.create_stream(), sim.create_stream()
    PER_THREAD = 2
    MIB = 1 << 20
    a = pool.allocate(2 * MIB + MIB // 8)           # legacy stream; one size class with d
    d = pool.allocate(2 * MIB, stream=PER_THREAD)
    ptr = a.ptr
    a.record_stream(other)
    sim.launch(other)                               # other still reads a's block
    queued = sim._queued[other]
    sim.launch()
    sim.launch(PER_THREAD)
    del a, d
    # side waits on the GPU for both free blocks and takes the smaller, d's; a's block keeps
    # the event of its use on other.
    assert pool.allocate(2 * MIB, stream=side).ptr != ptr
    again = pool.allocate(2 * MIB + MIB // 8)
    assert again.ptr == ptr and sim.ordered(0, other, queued)
    assert sim.errors == []


def test_a_record_stream_use_whose_event_cannot_be_recorded_is_waited_for(pool, sim):
    other = sim.create_stream()
    buf = pool.allocate(LARGE)
    buf.record_stream(other)
    sim.launch(other)

    def failing_record(event, stream):
        raise RuntimeError("simulated cuEventRecord failure")

    sim._event_record = failing_record
    sim.calls.clear()
    del buf                                         # freed: no event on other can be made
    del sim._event_record
    assert sim.calls_named("synchronize") == [()] and not sim.pending(other)
    gc.collect()
    assert pool.stats().in_use_bytes == 0           # the failure's traceback was not kept


def test_stream_setter_moves_the_block(pool, sim):
    a = sim.create_stream()
    buf = pool.allocate(LARGE)
    ptr = buf.ptr
    buf.stream = a
    assert buf.stream == a
    sim.launch(a)
    del buf
    assert pool.allocate(LARGE, stream=a).ptr == ptr


def test_stream_objects_are_accepted(pool, sim):
    handle = sim.create_stream()

    class CudaStreamProtocol:
        def __cuda_stream__(self):
            return (0, handle)

    class CupyLike:
        ptr = handle

    class TorchLike:
        cuda_stream = handle

    for stream in (CudaStreamProtocol(), CupyLike(), TorchLike(), handle):
        assert pool.allocate(10, stream=stream).stream == handle
    assert pool.allocate(10, stream=1).stream == 0      # CU_STREAM_LEGACY is the legacy stream


@pytest.mark.parametrize("stream, error", [(-1, ValueError), ("s", TypeError), (1.0, TypeError)])
def test_bad_streams_raise(pool, stream, error):
    with pytest.raises(error):
        pool.allocate(10, stream=stream)


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


def test_hard_limit_trims_then_raises_with_the_numbers(sim):
    pool = gpupool.Pool(upstream=sim, hard_limit="3MiB")
    first = pool.allocate(2 << 20)
    del first
    second = pool.allocate(3 << 20)          # needs the cached 2 MiB block released first
    assert second.nbytes == 3 << 20
    with pytest.raises(gpupool.OutOfMemoryError) as info:
        pool.allocate(1 << 20)
    message = str(info.value)
    for part in ("1.000 MiB", "3.000 MiB in use", "3.000 MiB reserved", "hard limit 3.000 MiB"):
        assert part in message
    assert isinstance(info.value, MemoryError)
    assert pool.stats().oom_retries >= 1


@pytest.mark.parametrize("cap", [1_000_000, 3 * (1 << 20) + 12_345, 100 << 20])
def test_pool_capped_at_n_bytes_can_allocate_one_n_byte_block(sim, cap):
    pool = gpupool.Pool(upstream=sim, hard_limit=cap)
    small = [pool.allocate(1000) for _ in range(3)]              # leaves memory cached
    del small
    buf = pool.allocate(cap)                 # the cache is released, then an exact block:
    assert buf.nbytes == cap
    # for caps that are not whole 2 MiB pages, rounding the growth to the page (or the
    # request to 512 B) would cross the cap, so the pool asks the upstream for exactly cap
    assert sim.calls_named("alloc")[-1] == (cap,)
    assert pool.stats().reserved_bytes == cap
    del buf
    assert pool.allocate(cap).nbytes == cap  # and again, from the cache or anew
    with pytest.raises(gpupool.OutOfMemoryError):
        pool.allocate(cap + 1)
    check_invariants(pool)


def test_out_of_memory_from_the_device_carries_the_numbers_and_asks_the_upstream_nothing(sim):
    small = type(sim)(capacity=4 << 20)
    pool = gpupool.Pool(upstream=small)
    keep = pool.allocate(3 << 20)
    small.calls.clear()
    with pytest.raises(gpupool.OutOfMemoryError) as info:
        pool.allocate(2 << 20)
    error = info.value
    assert (error.requested_bytes, error.in_use_bytes, error.reserved_bytes, error.cached_bytes,
            error.limit_bytes) == (2 << 20, 3 << 20, 4 << 20, 1 << 20, None)
    assert error.device_free_bytes is None and error.device_total_bytes is None
    assert "mem_info" not in [name for name, _ in small.calls]      # no call made to build it
    message = str(error)
    for part in ("allocating 2.000 MiB (2097152 B)", "3.000 MiB in use", "4.000 MiB reserved",
                 "1.000 MiB cached", "gpupool.on_oom", "gpupool.pool_status()"):
        assert part in message
    assert "hard limit" not in message
    assert keep.nbytes == 3 << 20
    check_invariants(pool)


def test_out_of_memory_numbers_under_a_hard_limit_and_through_pickle(sim):
    pool = gpupool.Pool(upstream=sim, hard_limit="3MiB")
    with pytest.raises(gpupool.OutOfMemoryError) as info:
        pool.allocate(4 << 20)
    assert info.value.limit_bytes == 3 << 20 and info.value.requested_bytes == 4 << 20
    again = pickle.loads(pickle.dumps(info.value))
    assert str(again) == str(info.value) and again.limit_bytes == 3 << 20
    plain = gpupool.OutOfMemoryError("a message only")     # as gpupool.torch builds its own
    assert str(plain) == "a message only" and plain.requested_bytes is None
    assert isinstance(plain, MemoryError)


def test_on_oom_callback_runs_and_the_allocation_is_retried(sim):
    small = type(sim)(capacity=4 << 20)
    pool = gpupool.Pool(upstream=small)
    held = [pool.allocate(3 << 20)]
    seen = []

    def free_held(nbytes):
        seen.append(nbytes)
        held.clear()

    gpupool.on_oom(free_held)
    try:
        buf = pool.allocate(2 << 20)
    finally:
        gpupool.remove_oom_callback(free_held)
    assert seen == [2 << 20]
    assert buf.nbytes == 2 << 20


def test_a_raising_callback_is_logged_and_the_others_still_free_memory(sim, caplog):
    small = type(sim)(capacity=4 << 20)
    pool = gpupool.Pool(upstream=small)
    held = [pool.allocate(3 << 20)]

    def broken(nbytes):
        raise RuntimeError("a broken callback")

    def free_held(nbytes):
        held.clear()

    gpupool.on_oom(broken)
    gpupool.on_oom(free_held)
    try:
        with caplog.at_level(logging.ERROR, logger="gpupool"):
            buf = pool.allocate(2 << 20)            # the second callback frees the memory
    finally:
        gpupool.remove_oom_callback(broken)
        gpupool.remove_oom_callback(free_held)
    assert buf.nbytes == 2 << 20
    [record] = caplog.records
    assert record.name == "gpupool" and "on_oom callback" in record.getMessage()
    assert record.exc_info[0] is RuntimeError


def test_a_raising_callback_does_not_replace_the_out_of_memory_error(sim, caplog):
    small = type(sim)(capacity=4 << 20)
    pool = gpupool.Pool(upstream=small)
    keep = pool.allocate(3 << 20)

    def broken(nbytes):
        raise RuntimeError("a broken callback")

    gpupool.on_oom(broken)
    try:
        with caplog.at_level(logging.ERROR, logger="gpupool"), \
                pytest.raises(gpupool.OutOfMemoryError, match="allocating 2.000 MiB"):
            pool.allocate(2 << 20)
    finally:
        gpupool.remove_oom_callback(broken)
    assert "a broken callback" in caplog.text
    del keep


def test_removing_an_unknown_callback_is_a_clear_error():
    with pytest.raises(ValueError, match="is not an on_oom callback.*gpupool.on_oom"):
        gpupool.remove_oom_callback(print)
    with pytest.raises(TypeError, match="callable"):
        gpupool.on_oom(42)


def test_soft_limit_releases_cached_blocks(sim):
    pool = gpupool.Pool(upstream=sim, soft_limit="2MiB")
    a = pool.allocate(LARGE)
    del a
    b = pool.allocate(2 * LARGE)         # reserved 3 MiB > 2 MiB: the cached 1 MiB goes back
    assert pool.stats().reserved_bytes == 2 * LARGE
    assert b.nbytes == 2 * LARGE


def test_limits_from_the_environment(sim, monkeypatch):
    monkeypatch.setenv("GPUPOOL_HARD_LIMIT", "50%")
    monkeypatch.setenv("GPUPOOL_SOFT_LIMIT", "256MB")
    pool = gpupool.Pool(upstream=sim)
    assert pool.hard_limit == sim.capacity // 2
    assert pool.soft_limit == 256 * 10**6


def test_upstream_errors_reach_the_caller(sim):
    class Broken(type(sim)):
        def _alloc(self, nbytes):
            raise RuntimeError("simulated driver failure")

    pool = gpupool.Pool(upstream=Broken())
    with pytest.raises(RuntimeError, match="simulated driver failure"):
        pool.allocate(10)
    check_invariants(pool)


@pytest.mark.parametrize("device, error", [
    (-1, ValueError), (1 << 31, ValueError), (True, TypeError), (1.5, TypeError),
    ("0", TypeError), (None, TypeError)])
@pytest.mark.parametrize("upstream", ["simulated", None, "driver"])
def test_impossible_devices_are_refused_before_any_driver_call(sim, device, error, upstream):
    # Without a driver, a driver call would raise NoDeviceError instead.
    with pytest.raises(error, match="device"):
        gpupool.Pool(device=device, upstream=sim if upstream == "simulated" else upstream)


def test_impossible_devices_of_the_simulated_device_and_the_default_pools():
    for device, error in ((-1, ValueError), (True, TypeError), (0.0, TypeError)):
        with pytest.raises(error, match="device"):
            SimulatedDevice(device=device)
    with pytest.raises(ValueError, match="non-negative device ordinal, got -1"):
        gpupool.get_pool(-1)
    with pytest.raises(ValueError, match="non-negative device ordinal, got -1"):
        gpupool.allocate(10, device=-1)
    assert gpupool.Pool(device=np.int64(3), upstream=SimulatedDevice(device=3)).device == 3


def test_impossible_devices_of_the_driver_upstreams_are_refused_before_cuinit():
    for device, error in ((True, TypeError), (-1, ValueError), (1.0, TypeError)):
        with pytest.raises(error, match="device"):
            gpupool.DriverUpstream(device)


def test_a_bool_is_not_a_device_of_the_default_pools(default_pools):
    one = gpupool.Pool(upstream=SimulatedDevice(device=1))
    gpupool.set_pool(one)
    assert gpupool.get_pool(1) is one
    with pytest.raises(TypeError, match="int device ordinal"):
        gpupool.get_pool(True)              # True == 1: it would find device 1's pool
    assert gpupool.get_pool(np.int64(1)) is one


def test_pool_status_of_something_that_is_not_a_pool_is_a_clear_error():
    with pytest.raises(TypeError, match="takes a gpupool.Pool, got int"):
        gpupool.pool_status(pool=42)


@pytest.mark.parametrize("returned, error, match", [
    (1.5, TypeError, r"_alloc must return an int, got 1\.5"),
    ("0x1000", TypeError, "_alloc must return an int"),
    (-1, ValueError, "_alloc returned -1, not an unsigned 64-bit integer"),
    (0, ValueError, "_alloc returned address 0"),
])
def test_an_upstream_returning_no_address_is_a_clear_error(returned, error, match):
    class Bad(SimulatedDevice):
        def _alloc(self, nbytes, stream=None):
            super()._alloc(nbytes, stream)
            return returned

    pool = gpupool.Pool(upstream=Bad())
    with pytest.raises(error, match=match):
        pool.allocate(1000)
    assert pool.stats().in_use_bytes == pool.stats().reserved_bytes == 0


def test_bad_upstream_arguments():
    with pytest.raises(ValueError):
        gpupool.Pool(upstream="nonsense")
    with pytest.raises(TypeError):
        gpupool.Pool(upstream=42)


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
