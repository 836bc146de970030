"""Streams are told apart by more than their handle value: a handle reused by a new stream
after the old one was destroyed, and the per-thread default stream of another thread
(CPU, simulated device)."""

import threading

import pytest

import gpupool
from gpupool.testing import PER_THREAD_STREAM

LARGE = 12 << 20      # above the segment limit (10 MiB): its own upstream allocation


def test_reused_handle_of_a_destroyed_stream_does_not_skip_the_wait(pool, sim):
    old = sim.create_stream()
    buf = pool.allocate(LARGE, stream=old)
    ptr = buf.ptr
    sim.launch(old)                     # a kernel on the block still runs after the destroy
    del buf
    sim.destroy_stream(old)
    new = sim.create_stream(reuse=old)  # same handle value, another stream
    assert new == old
    again = pool.allocate(LARGE, stream=new)
    # The old stream's work cannot be waited for (it is gone): the block must not be reused.
    assert again.ptr != ptr
    assert sim.calls_named("stream_wait_event") == []
    del again
    assert pool.trim() == 2 * LARGE     # a trim synchronizes the device, then frees both
    assert pool.stats().reserved_bytes == 0


def test_live_stream_keeps_its_blocks_across_allocations(pool, sim):
    s = sim.create_stream()
    buf = pool.allocate(LARGE, stream=s)
    ptr = buf.ptr
    sim.launch(s)
    del buf
    assert pool.allocate(LARGE, stream=s).ptr == ptr      # same stream: no wait, same block


def test_per_thread_stream_blocks_reach_other_threads_once_their_thread_allocates(pool, sim):
    # Thread A frees a block on its per-thread stream; thread B, on its own per-thread
    # stream, gets another block until A allocates again (then an event covers A's work).
    freed = threading.Event()
    go_on = threading.Event()
    ptrs = {}

    def thread_a():
        # A free 2 MiB segment on A's stream: A's small request below is cut from it (the
        # best fit), not from A's large block, which keeps the event recorded for it.
        pool.allocate(10, stream=PER_THREAD_STREAM)
        buf = pool.allocate(LARGE, stream=PER_THREAD_STREAM)
        ptrs["a"] = buf.ptr
        del buf
        freed.set()
        go_on.wait(10)
        ptrs["a_small"] = pool.allocate(10, stream=PER_THREAD_STREAM).ptr   # records the event

    t = threading.Thread(target=thread_a)
    t.start()
    assert freed.wait(10)
    first = pool.allocate(LARGE, stream=PER_THREAD_STREAM)      # this thread: no event yet
    assert first.ptr != ptrs["a"]
    assert sim.calls_named("event_record") == []
    go_on.set()
    t.join(10)
    # A's stream, alive again: an event for each of its free blocks (the large one, the free
    # rest of the small segment) on the per-thread stream, recorded by thread A.
    assert [args[1] for args in sim.calls_named("event_record")] == [PER_THREAD_STREAM] * 2
    second = pool.allocate(LARGE, stream=PER_THREAD_STREAM)
    assert second.ptr == ptrs["a"]
    assert ptrs["a_small"] != ptrs["a"]


def test_merge_streams_frees_an_idle_streams_blocks_for_every_stream(pool, sim):
    # Stream a frees a block and never allocates again: b cannot take it (no event can be
    # recorded on a, which may be gone) until merge_streams synchronizes once.
    import gpupool

    a, b = sim.create_stream(), sim.create_stream()
    pool.allocate(10, stream=a)         # a 2 MiB segment free on a: the region's small block
    buf = pool.allocate(LARGE, stream=a)    # below is cut from it, not from the large block
    ptr = buf.ptr
    sim.launch(a)
    del buf
    held = pool.allocate(LARGE, stream=b)
    assert held.ptr != ptr                          # a's block is still a's
    region = gpupool.Region(pool=pool)
    with region:
        small = pool.allocate(1000, stream=a)
        small_ptr = small.ptr
        del small                                   # cached by the region, on stream a
    assert pool.cached_blocks() == [(ptr, LARGE, False)]    # the pool's: a's large block
    sim.calls.clear()
    assert pool.merge_streams() == 2                # a's large block and the region's
    assert [name for name, _ in sim.calls] == ["synchronize"]
    assert pool.stats().reserved_bytes == 2 * LARGE + (2 << 20)     # nothing was freed
    assert pool.allocate(LARGE, stream=b).ptr == ptr                # b gets it, no wait
    assert sim.calls_named("stream_wait_event") == []
    hits = region.stats().cache_hits
    with region:
        assert pool.allocate(1000, stream=b).ptr == small_ptr       # a region hit on b
    assert region.stats().cache_hits == hits + 1
    assert sim.calls_named("stream_wait_event") == []


def test_another_threads_per_thread_stream_is_reached_through_an_event_that_follows_it(pool,
                                                                                       sim):
    # Thread A writes a buffer on its per-thread stream (handle 2); this thread consumes it on
    # its own per-thread stream (handle 2 too, another stream) and on a created stream.
    made = {}

    def producer():
        buf = pool.allocate(64 << 10, stream=PER_THREAD_STREAM)
        sim.launch(PER_THREAD_STREAM)          # A's kernel writing it, still running
        made.update(buf=buf, stream=sim.per_thread_stream(),
                    queued=sim.queued(PER_THREAD_STREAM))

    t = threading.Thread(target=producer)
    t.start()
    t.join(10)
    buf, a_stream, queued = made.pop("buf"), made["stream"], made["queued"]
    mine, c = sim.per_thread_stream(), sim.create_stream()
    assert a_stream != mine
    buf.__dlpack__(stream=PER_THREAD_STREAM)                # this thread's per-thread stream
    assert sim.ordered(mine, a_stream, queued)
    buf.__dlpack__(stream=c)
    assert sim.ordered(c, a_stream, queued)
    gpupool.as_buffer(buf, stream=c)                        # ordered the same way
    assert sim.pending(a_stream)                            # the host never waited
    # Handle 2 here would name this thread's stream: the events follow A's work through the
    # legacy default stream, which synchronizes with every per-thread stream.
    assert {args[1] for args in sim.calls_named("event_record")} == {0}


@pytest.mark.parametrize("read", ["cuda array interface", "copy_to_host", "memset", "copy"])
def test_the_buffers_own_stream_from_another_thread_follows_the_producers_work(pool, sim,
                                                                             read):
    # Work "on the buffer's stream" (handle 2) from another thread runs on that thread's
    # per-thread stream, and a CAI consumer there reads 2 as its own: it is made to follow A's.
    made = {}

    def producer():
        made["buf"] = pool.allocate(4096, stream=PER_THREAD_STREAM)
        sim.launch(PER_THREAD_STREAM)
        made.update(stream=sim.per_thread_stream(), queued=sim.queued(PER_THREAD_STREAM))

    t = threading.Thread(target=producer)
    t.start()
    t.join(10)
    buf = made.pop("buf")
    if read == "cuda array interface":
        assert buf.__cuda_array_interface__["stream"] == PER_THREAD_STREAM
    elif read == "copy_to_host":
        buf.copy_to_host()
    elif read == "memset":
        buf.memset(1)
    else:
        assert buf.copy().stream == PER_THREAD_STREAM
    assert sim.ordered(sim.per_thread_stream(), made["stream"], made["queued"])
    assert sim.calls_named("synchronize") == []


def test_a_consumers_per_thread_stream_is_a_use_whichever_thread_frees_the_block(pool, sim):
    handed, back = threading.Event(), threading.Event()
    box, seen = [], {}

    def producer():
        box.append(pool.allocate(64 << 10, stream=PER_THREAD_STREAM))
        seen["ptr"] = box[0].ptr
        handed.set()
        back.wait(10)                           # the consumer used it and dropped it
        again = pool.allocate(64 << 10, stream=PER_THREAD_STREAM)
        seen.update(same=again.ptr == seen["ptr"],
                    ordered=sim.ordered(PER_THREAD_STREAM, seen["consumer"], seen["queued"]))

    t = threading.Thread(target=producer)
    t.start()
    assert handed.wait(10)
    buf = box.pop()
    capsule = buf.__dlpack__(stream=PER_THREAD_STREAM)     # consumed on this thread's stream
    sim.launch(PER_THREAD_STREAM)                          # by a kernel still running
    seen.update(consumer=sim.per_thread_stream(), queued=sim.queued(PER_THREAD_STREAM))
    del capsule, buf                                       # freed here, on this thread
    back.set()
    t.join(10)
    assert seen["same"] and seen["ordered"], seen


def test_the_simulated_per_thread_stream_is_one_per_thread_and_blocking(sim):
    # What the tests above rely on: handle 2 names the calling thread's stream; the legacy
    # stream and the per-thread ones synchronize with each other, created streams do not.
    sim.launch(PER_THREAD_STREAM)
    mine, queued = sim.per_thread_stream(), sim.queued(PER_THREAD_STREAM)
    seen = {}
    t = threading.Thread(target=lambda: seen.update(
        key=sim.per_thread_stream(), pending=sim.pending(PER_THREAD_STREAM)))
    t.start()
    t.join(10)
    assert seen["key"] != mine and not seen["pending"] and sim.pending(mine)
    c = sim.create_stream()
    assert not sim.ordered(c, mine, queued) and sim.ordered(0, mine, queued)
    event = sim._event_create()
    sim._event_record(event, 0)                   # on the legacy stream: covers mine too
    sim._stream_wait_event(c, event)
    assert sim.ordered(c, mine, queued)
    assert not sim.ordered(c, seen["key"], 1)     # the other thread's had no work then
    with pytest.raises(ValueError, match="cannot be destroyed"):
        sim.destroy_stream(PER_THREAD_STREAM)
    sim.errors.clear()
