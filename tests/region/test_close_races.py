"""A buffer's free racing another free of its block: a free that waits for the pool's lock
(held here by a thread inside the pool's upstream call) lets go of the block first, so a
second close on another thread, or a region's exit that invalidates the buffer meanwhile,
finds it gone. Before, both freed it: two live buffers then shared memory. Found in review."""

import faulthandler
import threading
import time

import pytest
from conftest import hold_lock

import gpupool
from gpupool.testing import SimulatedDevice

MIB = 1 << 20


@pytest.fixture(autouse=True)
def watchdog():
    """A test that hangs (the race's old outcome: a corrupted list walked for ever) ends the
    run with the threads' tracebacks, not a silent wait."""
    faulthandler.dump_traceback_later(60, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def held_pool():
    """A pool on an expandable simulated device, and hold(): hold_lock on it."""
    device = SimulatedDevice(capacity=1 << 34, virtual_memory=True)
    pool = gpupool.Pool(upstream=device)
    return pool, lambda: hold_lock(pool, device)


def sound(pool, nbytes):
    """The pool balanced, its lists sound, and new buffers apart."""
    stats = pool.stats()
    assert pool._verify() == []
    assert stats.in_use_bytes == 0 and stats.num_allocs == stats.num_frees
    bufs = [pool.allocate(nbytes) for _ in range(4)]
    spans = sorted((b.ptr, b.ptr + b.nbytes) for b in bufs)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def waiting(threads):
    """Give threads time to reach the pool's lock; how many wait there."""
    time.sleep(0.3)
    return sum(t.is_alive() for t in threads)


def test_two_threads_closing_one_buffer_free_it_once():
    pool, hold = held_pool()
    buf = pool.allocate(128 * MIB)          # past the magazines: its free takes the lock
    go, holder = hold()
    closers = [threading.Thread(target=buf.close) for _ in range(2)]
    for t in closers:
        t.start()
    assert waiting(closers) == 1            # one waits for the lock; the other found none
    go.set()
    for t in closers + [holder]:
        t.join()
    sound(pool, 128 * MIB)


@pytest.mark.parametrize("plan", [False, True])
@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_buffer_freed_on_another_thread_while_its_region_s_exit_invalidates_it(plan, how):
    pool, hold = held_pool()
    region = gpupool.Region(pool=pool, on_exit="invalidate", collect=None, plan=plan)
    region.__enter__()
    box = [pool.allocate(MIB)]
    go, holder = hold()

    def free():
        time.sleep(0.3)                     # the exit waits for the lock by now
        if how == "close":
            box[0].close()
        else:
            box.clear()                     # the last reference: __dealloc__ frees it

    freer = threading.Thread(target=free)
    freer.start()
    seen = []
    threading.Timer(0.6, lambda: (seen.append(freer.is_alive()), go.set())).start()
    region.__exit__(None, None, None)       # waits for the lock, then the freer too
    freer.join()
    holder.join()
    assert seen == [True]
    box.clear()
    sound(pool, MIB)


def test_a_record_stream_waiting_for_the_lock_leaves_a_block_freed_meanwhile_alone():
    # record_stream waits for the pool's lock without the GIL; here the lock's thread, inside
    # the pool's upstream call, closes the buffer meanwhile (its free deferred to the unlock,
    # which comes before the waiter's turn). Before, the waiter then put the stream on the
    # freed block: a free block with record_stream streams, which the blocks later cut from
    # it would carry.
    device = SimulatedDevice(capacity=1 << 34, virtual_memory=True)
    pool = gpupool.Pool(upstream=device)
    other = device.create_stream()
    buf = pool.allocate(128 * MIB)          # past the magazines: its free takes the lock
    map_pages, waiter = device._map, []

    def held_map(va, size):
        device._map = map_pages
        waiter.append(threading.Thread(target=buf.record_stream, args=(other,)))
        waiter[0].start()
        assert waiting(waiter) == 1         # record_stream waits for the lock
        buf.close()                         # the lock's thread: freed at the unlock
        return map_pages(va, size)
    device._map = held_map
    pool.allocate(1 << 30).close()          # grows the pool: held_map runs under the lock
    waiter[0].join()
    sound(pool, 128 * MIB)


def test_a_record_stream_inside_the_pools_upstream_call_is_recorded_without_a_wait():
    # On the lock's thread (here inside the device's map, a Python upstream's call) the lock
    # is held already: record_stream used to wait for it there for ever.
    device = SimulatedDevice(capacity=1 << 34, virtual_memory=True)
    pool = gpupool.Pool(upstream=device)
    other = device.create_stream()
    buf = pool.allocate(128 * MIB)
    map_pages = device._map

    def held_map(va, size):
        device._map = map_pages
        buf.record_stream(other)
        return map_pages(va, size)
    device._map = held_map
    pool.allocate(1 << 30).close()          # grows the pool: held_map runs under the lock
    device.calls.clear()
    buf.close()                             # the stream recorded: an event on it at the free
    assert [args[1] for args in device.calls_named("event_record")] == [other]
    sound(pool, 128 * MIB)
