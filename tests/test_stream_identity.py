"""Streams are told apart by more than their handle value: a handle reused by a new stream
after the old one was destroyed, and the per-thread default stream of another thread
(CPU, simulated device)."""

import threading

from gpupool.testing import PER_THREAD_STREAM

LARGE = 1 << 20


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
    assert len(sim.calls_named("event_record")) == 1
    second = pool.allocate(LARGE, stream=PER_THREAD_STREAM)
    assert second.ptr == ptrs["a"]
