"""Single driver failures injected into the simulated device (``gpupool.testing.Failures``) at
the places where the pool must handle them: the out-of-memory ladder and the ``on_oom``
callbacks (RMM's failure-callback adaptor tests are the anchor), limits (RMM's limiting
adaptor), stream IDs, frees and unmaps the driver refuses, and a record_stream use that can be
ordered neither by an event nor by a synchronize. See Note [Failure injection] in
docs/design.md.
"""

import gc
import warnings

import pytest

import gpupool
from gpupool.testing import Failures, SimulatedDevice

MIB = 1 << 20


def consistent(pool, sim, lost=0):
    assert pool._verify() == []
    stats = pool.stats()
    assert stats.in_use_bytes + stats.cached_bytes == stats.reserved_bytes
    assert stats.reserved_bytes == sim.used - lost
    assert sim.errors == []


# The out-of-memory ladder and on_oom (RMM: failure_callback_resource_adaptor) -------------

def test_an_injected_allocation_failure_runs_the_callback_and_the_retry_succeeds(oom_callback):
    sim = SimulatedDevice(capacity=16 * MIB, failures=Failures("alloc", nth=1))
    pool = gpupool.Pool(upstream=sim)
    asked_for = []
    oom_callback(asked_for.append)
    buf = pool.allocate(3 * MIB)                # the first cuMemAlloc fails, the retry works
    assert asked_for == [3 * MIB]
    assert [name for name, _ in sim.calls] == ["alloc", "alloc"]
    assert pool.stats().num_allocs == 1
    del buf
    consistent(pool, sim)


def test_the_ladder_gives_the_cache_back_before_the_callbacks(oom_callback):
    sim = SimulatedDevice(capacity=16 * MIB)
    pool = gpupool.Pool(upstream=sim)
    pool.allocate(4 * MIB).close()              # 4 MiB cached
    asked_for = []
    oom_callback(asked_for.append)
    sim.inject(Failures("alloc", nth=1, times=2))   # the growth and the ladder's retry fail
    buf = pool.allocate(6 * MIB)                    # the callbacks' retry works
    assert asked_for == [6 * MIB]
    # The growth fails, the stream is not being captured, the trim gives the 4 MiB back, the
    # retry fails, the callbacks run, their retry works.
    assert [name for name, _ in sim.calls[-6:]] == ["alloc", "stream_capturing", "synchronize",
                                                    "free", "alloc", "alloc"]
    assert pool.stats().reserved_bytes == 6 * MIB
    del buf
    consistent(pool, sim)


def test_a_callback_that_frees_memory_lets_the_retry_succeed(oom_callback):
    sim = SimulatedDevice(capacity=8 * MIB)
    pool = gpupool.Pool(upstream=sim)
    held = [pool.allocate(6 * MIB)]
    oom_callback(lambda nbytes: held.clear())      # frees the 6 MiB buffer
    sim.inject(Failures("alloc", nth=1))        # and the device fails once more
    buf = pool.allocate(6 * MIB)
    assert held == [] and buf.nbytes == 6 * MIB
    del buf
    consistent(pool, sim)


def test_a_device_that_keeps_failing_raises_out_of_memory_after_one_retry(oom_callback):
    sim = SimulatedDevice(capacity=16 * MIB, failures=Failures("alloc", nth=1, times=None))
    pool = gpupool.Pool(upstream=sim)
    asked_for = []
    oom_callback(asked_for.append)
    with pytest.raises(gpupool.OutOfMemoryError) as info:
        pool.allocate(MIB)
    assert asked_for == [MIB] and info.value.requested_bytes == MIB
    assert pool.stats().reserved_bytes == 0 and pool.memory_stats()["num_ooms"] == 1
    consistent(pool, sim)


def test_an_allocation_failing_otherwise_raises_its_cuda_error_without_the_ladder(oom_callback):
    sim = SimulatedDevice(failures=Failures("alloc", nth=1, code=999))
    pool = gpupool.Pool(upstream=sim)
    asked_for = []
    oom_callback(asked_for.append)
    with pytest.raises(gpupool.CudaError) as info:
        pool.allocate(MIB)
    assert info.value.code == 999 and info.value.message == sim.failures.injected[0][2]
    assert asked_for == []
    consistent(pool, sim)


@pytest.mark.parametrize("step, error", [("reserve", gpupool.OutOfMemoryError),
                                         ("create", gpupool.OutOfMemoryError),
                                         ("map", gpupool.OutOfMemoryError),
                                         ("set_access", gpupool.CudaError)])
def test_virtual_memory_steps_fail_as_the_driver_reports_them(step, error):
    sim = SimulatedDevice(capacity=16 * MIB, virtual_memory=True,
                          failures=Failures(step, nth=1, times=None))
    pool = gpupool.Pool(upstream=sim)
    with pytest.raises(error):
        pool.allocate(MIB)
    consistent(pool, sim)
    sim.inject(None)
    buf = pool.allocate(MIB)
    assert sim.mapped(buf.ptr, MIB)
    consistent(pool, sim)


# Limits (RMM: limiting_resource_adaptor) ----------------------------------------------------

def test_a_hard_limit_holds_while_allocations_fail_at_random():
    sim = SimulatedDevice(capacity=64 * MIB, failures=Failures("alloc", rate=0.3, seed=5))
    pool = gpupool.Pool(upstream=sim, hard_limit="8MiB")
    live, ooms = [], 0
    for i in range(300):
        try:
            live.append(pool.allocate((i % 7 + 1) * 300_000))
        except gpupool.OutOfMemoryError:
            ooms += 1
            live.clear()
        if i % 5 == 0:
            pool.trim()                         # the next growths ask the device again
        assert pool.stats().reserved_bytes <= 8 * MIB
        consistent(pool, sim)
    assert ooms > 0 and len(sim.failures.injected) > 20


# Stream IDs -----------------------------------------------------------------------------------

def test_a_failed_stream_id_query_raises_that_failure_not_invalid_handle():
    sim = SimulatedDevice(failures=Failures("stream_id", nth=1))
    pool = gpupool.Pool(upstream=sim)
    stream = sim.create_stream()
    with pytest.raises(gpupool.CudaError) as info:
        pool.allocate(MIB, stream=stream)
    assert info.value.code == 999                       # not 400 (CUDA_ERROR_INVALID_HANDLE)
    assert info.value.message == sim.failures.injected[0][2]
    assert sim.failures.seen == 1                       # asked once, not again for the error
    buf = pool.allocate(MIB, stream=stream)
    sim.inject(Failures("stream_id", nth=1))
    with pytest.raises(gpupool.CudaError) as info:
        buf.record_stream(sim.create_stream())
    assert info.value.message == sim.failures.injected[0][2]
    consistent(pool, sim)


def test_a_destroyed_stream_is_still_refused_as_an_invalid_handle(sim):
    pool = gpupool.Pool(upstream=sim)
    stream = sim.create_stream()
    sim.destroy_stream(stream)
    sim.errors.clear()
    with pytest.raises(gpupool.CudaError, match="unknown or destroyed stream") as info:
        pool.allocate(MIB, stream=stream)
    assert info.value.code == 400                       # CUDA_ERROR_INVALID_HANDLE
    sim.errors.clear()


# Frees and unmaps the driver refuses ----------------------------------------------------------

def refusal(what, cause, nbytes, calls=1):
    """The RuntimeWarning of a trim whose upstream refused calls, the last a what()."""
    return (rf"^Pool\.trim on device 0: the upstream refused {calls} calls? to give memory "
            rf"back \(the last, {what}: CudaError: CUDA_ERROR_UNKNOWN \(999\): simulated "
            rf"device: injected failure of {cause}\); {nbytes} B stay cached and reserved, "
            rf"and a later trim\(\) tries again$")


def trim_warned(pool, match):
    """pool.trim() under pytest.warns(RuntimeWarning, match=match), the warning pointing at
    the line that called trim; what trim returned."""
    with pytest.warns(RuntimeWarning, match=match) as record:
        released = pool.trim()
    assert len(record) == 1 and record[0].filename == __file__
    return released


def test_a_failed_free_keeps_the_segment_cached_and_a_later_trim_gives_it_back():
    # The trim warns, naming the error (it said nothing, trial 29); it does not raise.
    sim = SimulatedDevice(capacity=16 * MIB)
    pool = gpupool.Pool(upstream=sim)
    pool.allocate(3 * MIB).close()
    sim.inject(Failures("free", nth=1))
    match = refusal("free", r"free \(call 1 of free\)", 4 * MIB)
    assert trim_warned(pool, match) == 0                # the free failed: nothing given back
    assert pool.stats().reserved_bytes == pool.stats().cached_bytes == 4 * MIB
    consistent(pool, sim)
    sim.inject(None)
    assert pool.trim() == 4 * MIB
    assert sim.used == 0
    consistent(pool, sim)


def test_a_failed_free_when_shedding_keeps_the_segment_cached():
    sim = SimulatedDevice(capacity=64 * MIB, failures=Failures("free", nth=1, times=None))
    pool = gpupool.Pool(upstream=sim)
    for size in range(1, 12):                       # creeping requests: the pool sheds
        pool.allocate(size * MIB + 1).close()
        consistent(pool, sim)
    assert len(sim.failures.injected) > 0


def test_at_the_pool_s_end_a_failed_free_leaves_just_that_allocation():
    sim = SimulatedDevice(capacity=16 * MIB)
    pool = gpupool.Pool(upstream=sim)
    a, b = pool.allocate(3 * MIB), pool.allocate(5 * MIB)
    del a, b
    sim.inject(Failures("free", nth=1))
    del pool
    gc.collect()
    (ptr,) = sim._arrays                                # the one the failed free named
    assert sim.failures.injected[0][1] == (ptr,) and sim.used == sim._arrays[ptr][1]
    assert sim.errors == []


def test_at_the_pool_s_end_a_failed_unmap_leaves_its_range_reserved():
    sim = SimulatedDevice(capacity=16 * MIB, virtual_memory=True)
    pool = gpupool.Pool(upstream=sim)
    pool.allocate(3 * MIB).close()
    sim.inject(Failures("unmap", nth=1))
    del pool
    gc.collect()
    assert sim.errors == []                 # no unreserve of a range with pages mapped
    assert [name for name, _ in sim.calls[-1:]] == ["unmap"]
    assert sim.used == 4 * MIB and len(sim._ranges) == 1


def test_a_failed_unreserve_in_a_trim_forgets_the_range_and_keeps_the_bytes_right():
    sim = SimulatedDevice(capacity=16 * MIB, virtual_memory=True)
    pool = gpupool.Pool(upstream=sim)
    pool.allocate(3 * MIB).close()
    sim.inject(Failures("unreserve", nth=1))
    assert pool.trim() == 4 * MIB
    consistent(pool, sim)
    assert len(sim._ranges) == 1 and sim.used == 0      # address space only
    sim.inject(None)
    buf = pool.allocate(MIB)                            # a new range
    assert len(sim._ranges) == 2 and sim.mapped(buf.ptr, MIB)


def test_a_failed_unmap_in_a_trim_keeps_the_pages_cached():
    sim = SimulatedDevice(capacity=16 * MIB, virtual_memory=True)
    pool = gpupool.Pool(upstream=sim)
    pool.allocate(3 * MIB).close()
    sim.inject(Failures("unmap", nth=1))
    assert trim_warned(pool, refusal("unmap", r"unmap \(call 1 of unmap\)", 4 * MIB)) == 0
    consistent(pool, sim)
    sim.inject(None)
    assert pool.trim() == 4 * MIB and sim.used == 0


def test_a_trim_whose_synchronize_fails_gives_nothing_back_and_warns():
    sim = SimulatedDevice(capacity=16 * MIB, virtual_memory=True)
    pool = gpupool.Pool(upstream=sim)
    pool.allocate(3 * MIB).close()
    sim.inject(Failures("synchronize", nth=1))
    assert trim_warned(pool, r"^Pool\.trim on device 0: the device synchronize before it "
                             r"failed \(CudaError: .*synchronize.*\), so nothing was given "
                             r"back; 4194304 B stay cached, and a later trim\(\) tries "
                             r"again$") == 0
    consistent(pool, sim)
    sim.inject(None)
    assert pool.trim() == 4 * MIB and sim.used == 0


def test_only_a_call_of_trim_warns_of_a_refused_free():
    # The pool's own trims (before it grows, the out-of-memory ladder) keep quiet, as before.
    sim = SimulatedDevice(capacity=8 * MIB, failures=Failures("free", nth=1, times=None))
    pool = gpupool.Pool(upstream=sim)
    pool.allocate(3 * MIB).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(gpupool.OutOfMemoryError):
            pool.allocate(6 * MIB)                      # the ladder's trim: refused
    assert len(sim.failures.injected) > 0
    consistent(pool, sim)


# A use on another stream that nothing orders --------------------------------------------------

def test_a_block_whose_other_stream_use_cannot_be_ordered_waits_for_a_synchronize():
    sim = SimulatedDevice(capacity=64 * MIB)
    pool = gpupool.Pool(upstream=sim)
    s1, s2 = sim.create_stream(), sim.create_stream()
    buf = pool.allocate(3 * MIB, stream=s1)
    ptr = buf.ptr
    buf.record_stream(s2)
    sim.launch(s2)                                      # work on s2 still reads it
    sim.inject(Failures(("event_record", "synchronize"), nth=1, times=2))
    buf.close()                                         # no event, no synchronize
    assert [name for name, _, _ in sim.failures.injected] == ["event_record", "synchronize"]
    others = []                # kept alive: no other free block of 3 MiB, in a magazine or not
    for stream in (0, s1, s2):
        others.append(pool.allocate(3 * MIB, stream=stream))
        assert others[-1].ptr != ptr, f"handed to stream {stream:#x} with s2's work unordered"
    consistent(pool, sim)
    pool.merge_streams()                                # a synchronize: s2's work is done
    assert pool.allocate(3 * MIB, stream=s1).ptr == ptr
    consistent(pool, sim)


# Failures the pool gets past leave nothing pending -------------------------------------------

def test_a_failed_event_query_that_a_wait_gets_past_keeps_no_frame_alive():
    # A failure's exception, left pending, would keep its traceback's frames, and the
    # buffers in them, alive after the pool went on without it.
    sim = SimulatedDevice(capacity=64 * MIB)
    pool = gpupool.Pool(upstream=sim)
    stream = sim.create_stream()
    old = pool.allocate(3 * MIB)
    ptr = old.ptr
    sim.launch(0)
    old.close()                                     # free on stream 0, its work pending
    sim.inject(Failures("event_query", nth=1, times=None))

    def step():
        buf = pool.allocate(3 * MIB, stream=stream)     # stream 0's block, after a wait
        return buf.ptr

    assert step() == ptr
    # (asked first: the stream is not being captured, so it may query and wait)
    assert [name for name, _ in sim.calls[-3:]] == ["stream_capturing", "event_query",
                                                    "stream_wait_event"]
    assert pool.stats().in_use_bytes == 0           # no stale error holds step's buf
    consistent(pool, sim)
