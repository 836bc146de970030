"""Stream-ordered reuse on the simulated device (core/streamorder.pxd): a block freed on one stream
goes to another once its work is done or ordered before; record_stream; a buffer's stream; stream
arguments."""

import gc

import pytest
from conftest import check_invariants

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
