"""Per-thread magazines (gpupool/core/magazine.pxd) on the simulated device: a thread's free and
its next request of the same size are served without the pool's lock; whatever reaches
across threads (growth, trims, stream merges, statistics, thread exit, the C API's frees by
pointer) finds the blocks a thread holds; statistics stay exact, the peak included."""

import gc
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import Worker, check_balanced, check_invariants, threads_together

import gpupool
from gpupool.testing import SimulatedDevice

MiB = 1 << 20
# The calling thread's per-thread default stream: its key is the thread's own, so that two
# threads' held blocks are on different streams (a request takes in other threads' held blocks
# on its own stream: test_a_cut_sees_the_blocks_other_threads_hold_on_its_stream).
PTS = 2


def on_thread(fn, *args):
    """fn(*args) on a new thread that then exits; its result."""
    with ThreadPoolExecutor(1) as worker:
        return worker.submit(fn, *args).result(timeout=60)


class BlockingDevice(SimulatedDevice):
    """A simulated device whose event records wait for ``go`` once ``hold`` is set: the pool
    holds its lock meanwhile (it records them inside, at the free of a block that
    record_stream gave another stream)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.hold, self.inside, self.go = False, threading.Event(), threading.Event()

    timed_out = False

    def _event_record(self, event, stream):
        if self.hold:
            self.inside.set()
            if not self.go.wait(10):
                self.timed_out = True
                raise RuntimeError("nobody said go: the other thread waited for the lock")
        return super()._event_record(event, stream)


def retake_while_locked(sim, pool, nbytes, **kw):
    """Allocate nbytes (kw: on a stream) while another thread holds the pool's lock (inside
    an event record of a free); returns the buffer and whether it came without waiting."""
    side = sim.create_stream()
    other = pool.allocate(8192)
    other.record_stream(side)
    sim.hold, sim.timed_out = True, False
    sim.inside.clear()
    sim.go.clear()
    freer = threading.Thread(target=other.close)        # records an event under the lock
    freer.start()
    try:
        assert sim.inside.wait(10)                      # the freer holds the pool's lock now
        buf = pool.allocate(nbytes, **kw)
        without_waiting = not sim.timed_out             # else it came after the freer gave up
    finally:
        sim.go.set()
        freer.join(60)
        sim.hold = False
    return buf, without_waiting


def assert_retake_needs_no_lock(sim, pool, nbytes=4096):
    """A block this thread frees comes back while another thread holds the pool's lock."""
    buf = pool.allocate(nbytes)
    ptr = buf.ptr
    buf.close()
    again, without_waiting = retake_while_locked(sim, pool, nbytes)
    assert again.ptr == ptr and without_waiting
    again.close()


def test_a_retake_of_the_same_size_is_the_same_block_and_counts_exactly():
    pool = gpupool.Pool(upstream=SimulatedDevice())
    buf = pool.allocate(3000)
    ptr = buf.ptr
    buf.close()
    info = pool._magazines_info()
    assert [(m["blocks"], m["held"], m["credit"]) for m in info] == [(1, 3072, 3072)]
    stats = check_invariants(pool)
    assert (stats.in_use_bytes, stats.cached_bytes, stats.num_frees) == (0, stats.reserved_bytes, 1)
    for _ in range(5):
        buf = pool.allocate(3000)
        assert buf.ptr == ptr
        buf.close()
    stats = check_invariants(pool)
    assert (stats.num_allocs, stats.num_frees, stats.cache_hits) == (6, 6, 5)
    assert (stats.in_use_bytes, stats.peak_in_use_bytes) == (0, 3072)
    counters = pool._counters()
    assert counters["allocated_bytes"] == counters["freed_bytes"] == 6 * 3072


def test_a_thread_retakes_its_block_while_another_holds_the_pools_lock():
    sim = BlockingDevice()
    pool = gpupool.Pool(upstream=sim)
    pool.allocate(64 * MiB).close()                     # memory to cut from: no growth below
    buf = pool.allocate(4096)
    ptr = buf.ptr
    buf.close()                                         # into this thread's magazine
    # Without magazines the retake would wait for the pool's lock until the freer gave up.
    again, without_waiting = retake_while_locked(sim, pool, 4096)
    assert again.ptr == ptr and without_waiting
    again.close()
    assert sim.errors == []
    check_invariants(pool)


def test_a_wanted_stream_does_not_keep_other_streams_from_their_magazines():
    # A stream whose blocks another waits for (one that may never allocate again: destroyed,
    # say) takes the shared path, which answers it; other streams keep their magazines.
    sim = BlockingDevice()
    pool = gpupool.Pool(upstream=sim)
    dead, side = sim.create_stream(), sim.create_stream()
    pool.allocate(2 * MiB, stream=dead).close()
    sim.launch(dead)                                    # work queued on it after the free
    pool.allocate(2 * MiB, stream=side).close()         # waits for dead's block: dead wanted
    assert_retake_needs_no_lock(sim, pool)
    sim.complete(dead)
    check_invariants(pool)


def test_a_block_held_by_one_thread_serves_another_before_the_pool_grows():
    # Out of memory (the device holds one 2 MiB segment): the worker's held block serves.
    sim = SimulatedDevice(capacity=2 * MiB)
    pool = gpupool.Pool(upstream=sim)
    worker = Worker()
    ptr = worker(lambda: pool.allocate(2 * MiB).ptr)    # a whole segment, freed on the worker
    assert pool._magazines_info()[0]["blocks"] == 1
    used = sim.used
    buf = pool.allocate(2 * MiB)                        # on this thread: no block of its own
    assert buf.ptr == ptr and sim.used == used          # the worker's block, no trim
    assert pool.stats().upstream_frees == 0 and pool.stats().oom_retries == 0
    assert pool._magazines_info()[0]["blocks"] == 0
    check_invariants(pool)
    buf.close()
    worker.exit()


def test_a_thread_that_exits_leaves_its_blocks_to_the_pool():
    sim = SimulatedDevice(capacity=8 * MiB)
    pool = gpupool.Pool(upstream=sim)

    def use():
        bufs = [pool.allocate(n) for n in (1000, 70_000, MiB)]
        for buf in bufs:
            buf.close()

    on_thread(use)
    # Python's join returns before the OS thread has run its thread-local destructors.
    deadline = time.monotonic() + 10
    while not pool._magazines_info()[0]["orphan"] and time.monotonic() < deadline:
        time.sleep(0.001)
    assert [m["orphan"] for m in pool._magazines_info()] == [True]
    stats = check_invariants(pool)                      # an exited thread's blocks counted
    assert stats.in_use_bytes == 0 and stats.num_frees == 3
    assert pool.trim() == stats.reserved_bytes          # and given back
    assert pool._magazines_info() == []                 # its magazine deleted
    check_invariants(pool)


def test_trims_and_stream_merges_flush_every_threads_magazine():
    sim = SimulatedDevice()
    pool = gpupool.Pool(upstream=sim)
    stream, other = sim.create_stream(), sim.create_stream()
    pool.allocate(128 * MiB, stream=stream).close()     # free memory to cut from, on stream
    pool.allocate(128 * MiB, stream=other).close()      # and on other
    worker = Worker()
    worker(lambda: pool.allocate(MiB, stream=stream).close())
    pool.allocate(2 * MiB, stream=other).close()        # another stream's: the worker keeps its
    assert sum(m["blocks"] for m in pool._magazines_info()) == 2
    assert pool.merge_streams() >= 1                    # the worker's block was on stream
    assert sum(m["blocks"] for m in pool._magazines_info()) == 0
    worker(lambda: pool.allocate(MiB).close())
    assert pool.trim() > 0 and sim.used == 0
    check_invariants(pool)
    worker.exit()


def test_a_cut_sees_the_blocks_other_threads_hold_on_its_stream():
    # Issue 13: PyTorch's autograd thread allocates the backward while the main thread's
    # magazine holds what the forward freed. Cut around those blocks, the backward's peak
    # came out 570 MiB above one thread's on the recorded GPT-2 run (bench/fragmentation.py's
    # trace, split between two threads at each step's peak).
    sim = SimulatedDevice()
    pool = gpupool.Pool(upstream=sim)
    stream = sim.create_stream()
    pool.allocate(16 * MiB, stream=stream).close()      # one free segment on stream
    pool.merge_streams()
    worker = Worker()
    worker(lambda: pool.allocate(MiB, stream=stream).close())
    held = worker(lambda: pool.allocate(MiB, stream=stream))    # from its magazine
    ptr = held.ptr                                      # the segment's first MiB
    worker(held.close)                                  # held in the worker's magazine
    pool.allocate(5 * MiB, stream=stream).close()       # a miss: the worker was active
    assert [m["blocks"] for m in pool._magazines_info()] == [1, 1]
    buf = pool.allocate(3 * MiB, stream=stream)         # a miss: the worker is idle now
    assert buf.ptr == ptr                               # the cut saw its block
    assert [m["blocks"] for m in pool._magazines_info()] == [0, 0]
    buf.close()
    # Another stream's request leaves it: its blocks are not free for that stream yet.
    side = sim.create_stream()
    worker(lambda: pool.allocate(MiB, stream=stream).close())
    pool.allocate(3 * MiB, stream=side).close()
    pool.allocate(5 * MiB, stream=side).close()
    assert [m["blocks"] for m in pool._magazines_info()][0] == 1
    check_invariants(pool)
    worker.exit()


def test_threads_allocating_on_one_stream_keep_their_magazines_through_each_others_misses():
    sim = SimulatedDevice()
    pool = gpupool.Pool(upstream=sim)
    steady, roaming = Worker(), Worker()
    side = sim.create_stream()
    steady(lambda: pool.allocate(8192, stream=side).close())    # held throughout (not flushed)
    steady(lambda: pool.allocate(MiB).close())

    def steadys():
        return [m for m in pool._magazines_info()
                if any(n == 8192 and handle == side for n, handle, _ in m["streams"])]

    before = steadys()[0]["no_block"]
    for k in range(50):                 # every request of roaming misses; steady allocates too
        roaming(lambda k=k: pool.allocate((k + 2) * 4096).close())
        steady(lambda: pool.allocate(MiB).close())
    after = steadys()
    assert len(after) == 1 and after[0]["blocks"] == 2
    assert after[0]["no_block"] == before               # its 1 MiB block was there every time
    check_invariants(pool)
    steady.exit()
    roaming.exit()


def test_the_peak_is_exact_when_a_held_block_is_flushed_not_retaken():
    # Bytes a thread holds are free: another thread's allocation meanwhile is not a new peak
    # unless in use really went above it.
    pool = gpupool.Pool(upstream=SimulatedDevice())
    pool.allocate(128 * MiB).close()        # free memory to cut from: no flush before growth
    pool.merge_streams()                    # for any stream
    pool.reset_peak_stats()
    worker = Worker()
    worker(lambda: pool.allocate(MiB, stream=PTS).close())  # the worker holds 1 MiB: peak
    assert pool.stats().peak_in_use_bytes == MiB
    big = pool.allocate(2 * MiB)                        # in use 2 MiB (the held 1 MiB is free)
    assert pool._magazines_info()[0]["blocks"] == 1
    assert pool.stats().peak_in_use_bytes == 2 * MiB
    big.close()                                         # this thread holds 2 MiB now
    worker(lambda: pool.allocate(MiB, stream=PTS).close())  # in use 1 MiB at most
    assert pool.stats().peak_in_use_bytes == 2 * MiB
    kept = worker(lambda: pool.allocate(MiB, stream=PTS))   # both kept: in use 3 MiB
    big = pool.allocate(2 * MiB)
    assert pool.stats().peak_in_use_bytes == 3 * MiB
    worker(kept.close)
    big.close()
    pool.reset_peak_stats()
    assert pool.stats().peak_in_use_bytes == 0
    # After the reset no thread has credit: a retake is counted by the pool, and exactly.
    kept = worker(lambda: pool.allocate(MiB, stream=PTS))
    assert pool.stats().peak_in_use_bytes == MiB
    worker(kept.close)
    check_invariants(pool)
    worker.exit()


def test_credit_comes_back_from_idle_threads_first_and_the_peak_stays_exact():
    pool = gpupool.Pool(upstream=SimulatedDevice())
    pool.allocate(64 * MiB).close()
    pool.merge_streams()                                # free memory, no thread holding it
    pool.reset_peak_stats()
    one, four, other = Worker(), Worker(), Worker()
    one(lambda: pool.allocate(MiB, stream=PTS).close())     # peak 1 MiB, its credit 1 MiB
    four(lambda: pool.allocate(4 * MiB, stream=PTS).close())  # peak 4 MiB: all credit went
    assert pool.stats().peak_in_use_bytes == 4 * MiB
    one(lambda: pool.allocate(MiB, stream=PTS).close())     # beyond credit: 1 MiB of 4's
    assert [m["credit"] for m in pool._magazines_info()[1:]] == [MiB, 3 * MiB]
    kept = other(lambda: pool.allocate(2 * MiB, stream=PTS))  # in use 2 MiB: 2 MiB of credit go,
    credits = [m["credit"] for m in pool._magazines_info()[1:3]]
    # from threads that made no request since the last settle (one's retake), in turn
    assert credits == [0, 2 * MiB]
    assert pool.stats().peak_in_use_bytes == 4 * MiB    # in use never went above 4 MiB
    both = (one(lambda: pool.allocate(MiB, stream=PTS)),
            four(lambda: pool.allocate(4 * MiB, stream=PTS)))
    assert pool.stats().peak_in_use_bytes == 7 * MiB    # 2 + 1 + 4, retaken: exactly
    one(both[0].close)
    four(both[1].close)
    other(kept.close)
    check_invariants(pool)
    for worker in (one, four, other):
        worker.exit()


def test_credit_a_retake_of_one_block_never_needs_goes_before_a_richer_threads():
    # Issue 18: taking the most credit first had threads cycling through a few sizes take
    # each other's credit for their largest block at every turn, on the shared path.
    pool = gpupool.Pool(upstream=SimulatedDevice())
    pool.allocate(64 * MiB).close()
    pool.merge_streams()
    pool.reset_peak_stats()
    small, large = Worker(), Worker()
    kept = large(lambda: pool.allocate(8 * MiB, stream=PTS))

    def both():
        x, y = pool.allocate(MiB, stream=PTS), pool.allocate(4 * MiB, stream=PTS)
        x.close()
        y.close()

    small(both)
    large(kept.close)                   # peak 13 MiB; small holds 1 + 4 MiB, large 8 MiB

    def credits():
        return [m["credit"] for m in pool._magazines_info()[1:]]

    assert credits() == [5 * MiB, 8 * MiB]
    small(lambda: pool.allocate(MiB, stream=PTS).close())       # both active: within credit
    large(lambda: pool.allocate(8 * MiB, stream=PTS).close())
    taken = pool.allocate(MiB)          # in use 1 MiB: 1 MiB of credit goes, small's spare one
    assert credits() == [4 * MiB, 8 * MiB]
    assert pool.stats().peak_in_use_bytes == 13 * MiB
    taken.close()
    check_invariants(pool)
    small.exit()
    large.exit()


def test_many_wanted_streams_of_idle_threads_leave_other_threads_their_magazines():
    # Ten threads hold a whole segment each on their per-thread streams; a request of this
    # thread that finds no free block makes all ten wanted. Before, more than 8 wanted
    # streams sent every thread's request the shared way until each of them allocated again.
    pool = gpupool.Pool(upstream=SimulatedDevice())
    workers = [Worker() for _ in range(10)]
    for worker in workers:
        worker(lambda: pool.allocate(2 * MiB, stream=2).close())   # per-thread stream
    pool.allocate(2 * MiB).close()                  # grows; the ten streams are wanted now
    for _ in range(100):
        pool.allocate(2 * MiB).close()              # the legacy stream: not wanted
    mine = [m for m in pool._magazines_info() if m["streams"][:1] == [(2 * MiB, 0, 0)]]
    assert len(mine) == 1 and mine[0]["wanted"] == 0 and mine[0]["no_block"] == 0
    assert all(m["wanted"] == 0 for m in pool._magazines_info())
    check_invariants(pool)
    for worker in workers:
        worker.exit()


def test_gpupool_magazines_0_turns_every_threads_magazine_off():
    code = """
        import os, threading
        os.environ["GPUPOOL_MAGAZINES"] = "0"
        import gpupool
        import gpupool.diagnose
        from gpupool.testing import SimulatedDevice
        pool = gpupool.Pool(upstream=SimulatedDevice())
        def work():
            for n in (4096, 1 << 20, 4096):
                pool.allocate(n).close()
        worker = threading.Thread(target=work)
        worker.start(); worker.join()
        work()
        s = pool.stats()
        print(pool._magazines_info(), s.num_allocs, s.num_frees, s.cache_hits, s.in_use_bytes)
        print("Magazines: off" in gpupool.diagnose.format_report(gpupool.diagnose.gather()))
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["[] 6 6 5 0", "True"]


CYCLE = [256, 4096, 64 << 10, MiB, 16 * MiB]      # bench/threads.py's sizes, in turn


def test_a_thread_cycling_through_small_and_large_sizes_on_one_expandable_segment_hits():
    # Issue 18: on an expandable segment (one range per stream) every small request broke
    # the thread's held 16 MiB block, and the next 16 MiB request flushed and joined the small
    # ones again: all requests missed the magazine and took the pool's lock.
    pool = gpupool.Pool(upstream=SimulatedDevice(virtual_memory=True))
    for _ in range(3):
        for n in CYCLE:
            pool.allocate(n).close()
    before = pool._magazines_info()[0]
    for _ in range(50):
        for n in CYCLE:
            pool.allocate(n).close()
    after = pool._magazines_info()[0]
    assert after["blocks"] == len(CYCLE)
    assert (after["misses"], after["no_block"]) == (before["misses"], before["no_block"])
    stats = check_invariants(pool)
    assert stats.peak_in_use_bytes == 16 * MiB
    assert stats.peak_reserved_bytes <= 16 * MiB + 2 * MiB     # one page more, for the small


def test_a_small_request_grows_the_pool_rather_than_break_a_held_block_8_times_its_size():
    pool = gpupool.Pool(upstream=SimulatedDevice(virtual_memory=True))
    big = pool.allocate(16 * MiB)
    ptr = big.ptr
    big.close()                                         # held: the segment has no free byte
    small = pool.allocate(MiB)                          # 1/16 of it: a page more
    assert not ptr <= small.ptr < ptr + 16 * MiB
    assert pool._magazines_info()[0]["blocks"] == 1
    assert pool.stats().reserved_bytes == 18 * MiB
    small.close()
    check_invariants(pool)
    # A larger request (above 1 MiB) is not small: the held block goes back and is cut.
    pool = gpupool.Pool(upstream=SimulatedDevice(virtual_memory=True))
    big = pool.allocate(16 * MiB)
    ptr = big.ptr
    big.close()
    other = pool.allocate(2 * MiB)
    assert other.ptr == ptr and pool.stats().reserved_bytes == 16 * MiB
    assert pool._magazines_info()[0]["blocks"] == 0
    other.close()
    check_invariants(pool)


@pytest.mark.parametrize("virtual_memory", [True, False])
def test_out_of_memory_a_small_request_breaks_the_held_block_it_would_leave(virtual_memory):
    sim = SimulatedDevice(capacity=16 * MiB, virtual_memory=virtual_memory)
    pool = gpupool.Pool(upstream=sim)
    big = pool.allocate(16 * MiB)
    ptr = big.ptr
    big.close()
    small = pool.allocate(256)                          # no page left on the device
    assert small.ptr == ptr and pool.stats().reserved_bytes == 16 * MiB
    assert pool._magazines_info()[0]["blocks"] == 0
    small.close()
    check_invariants(pool)


def test_regions_and_record_stream_keep_their_own_rules():
    sim = SimulatedDevice()
    pool = gpupool.Pool(upstream=sim)
    side = sim.create_stream()
    region = gpupool.Region(pool=pool)
    with region:
        region_ptr = pool.allocate(4096).ptr            # freed into the region, not a magazine
    assert pool._magazines_info() == [] or pool._magazines_info()[0]["blocks"] == 0
    buf = pool.allocate(8192)
    buf.record_stream(side)
    sim.launch(side)
    buf.close()                                         # used on another stream: the pool's
    assert all(m["blocks"] == 0 for m in pool._magazines_info())
    with region:
        assert pool.allocate(4096).ptr == region_ptr
    check_invariants(pool)


@pytest.mark.parametrize("threads", [2, 4])
def test_threads_allocating_at_once_keep_the_counts_exact(threads):
    sim = SimulatedDevice(capacity=256 * MiB)
    pool = gpupool.Pool(upstream=sim)
    sizes = [256, 4096, 70_000, MiB, 5 * MiB]
    rounds = 300
    start = threading.Barrier(threads)

    def run(seed):
        start.wait()
        kept = []
        for i in range(rounds):
            buf = pool.allocate(sizes[(i + seed) % len(sizes)])
            if i % 7 == seed % 7:
                kept.append(buf)
            else:
                buf.close()
            if len(kept) > 3:
                kept.pop(0).close()
        for buf in kept:
            buf.close()

    threads_together(run, [(k,) for k in range(threads)])
    stats = check_balanced(pool, threads * rounds)
    counters = pool._counters()
    assert counters["allocated_bytes"] == counters["freed_bytes"]
    assert stats.cache_hits + stats.cache_misses == stats.num_allocs
    assert stats.reserved_bytes == sim.used


def test_a_thread_that_used_many_pools_still_gets_a_magazine_for_a_new_one():
    # A thread has room for 8 magazines; those of pools that are gone are reused. Pools of
    # earlier tests left in reference cycles are alive and hold theirs until collected.
    gc.collect()
    for _ in range(20):
        pool = gpupool.Pool(upstream=SimulatedDevice())
        pool.allocate(1000).close()
        assert [m["blocks"] for m in pool._magazines_info()] == [1]
        check_invariants(pool)
        del pool
    pools = [gpupool.Pool(upstream=SimulatedDevice()) for _ in range(10)]
    for pool in pools:                          # 10 live pools: the last 2 use the shared path
        pool.allocate(1000).close()
        check_invariants(pool)
    assert sum(len(pool._magazines_info()) for pool in pools) <= 8


def test_a_pool_the_collector_clears_lets_go_of_the_threads_magazines():
    # A pool in a reference cycle may be cleared (its upstream dropped) before it is freed:
    # its magazines must still let go of it, or a new pool at its address would take them.
    import gc
    for _ in range(30):
        sim = SimulatedDevice()
        pool = gpupool.Pool(upstream=sim)
        sim.pool = pool                         # pool -> upstream -> pool
        pool.allocate(1000).close()
        del sim, pool
        gc.collect()
    for _ in range(30):
        pool = gpupool.Pool(upstream=SimulatedDevice())
        assert pool._magazines_info() == []
        pool.allocate(1000).close()
        pool.allocate(1000).close()
        assert [m["blocks"] for m in pool._magazines_info()] == [1]
        check_invariants(pool)


def test_a_snapshot_shows_held_blocks_free_and_counts_them_as_the_statistics_do():
    from gpupool.snapshot import memory_snapshot
    pool = gpupool.Pool(upstream=SimulatedDevice())
    kept = pool.allocate(MiB)
    pool.allocate(4096).close()                         # held in this thread's magazine
    assert [m["blocks"] for m in pool._magazines_info()] == [1]
    segments = memory_snapshot(pool)["segments"]
    blocks = [b for s in segments for b in s["blocks"]]
    allocated = sum(s["allocated_size"] for s in segments)
    assert allocated == pool.stats().in_use_bytes == MiB
    assert [b["state"] for b in blocks if b["size"] == 4096] == ["inactive"]
    kept.close()


def test_threads_that_come_and_go_leave_their_blocks_to_the_next_ones():
    # A thread per request: each exited thread's held block serves the next thread's request
    # (its magazine reaped before the pool grows), so reserved memory stays one block's.
    sim = SimulatedDevice(capacity=4 << 30)
    pool = gpupool.Pool(upstream=sim)

    def work():
        pool.allocate(8 * MiB).close()

    for _ in range(40):
        on_thread(work)
        deadline = time.monotonic() + 10                # its thread-local destructors run
        while not all(m["orphan"] for m in pool._magazines_info()) and \
                time.monotonic() < deadline:
            time.sleep(0.001)
    stats = check_invariants(pool)
    assert stats.reserved_bytes <= 2 * 8 * MiB and stats.num_allocs == 40
    assert len(pool._magazines_info()) <= 1             # exited threads' magazines deleted


def test_a_dead_threads_per_thread_stream_keeps_no_other_stream_from_its_magazine():
    sim = BlockingDevice()
    pool = gpupool.Pool(upstream=sim)
    on_thread(lambda: pool.allocate(16 * MiB, stream=2).close())   # its per-thread stream
    time.sleep(0.05)                                    # its thread-local destructors run
    big = pool.allocate(12 * MiB)                       # waits for it in vain: it is wanted
    assert_retake_needs_no_lock(sim, pool)
    big.close()
    check_invariants(pool)


def test_a_c_api_free_through_a_magazine_is_recorded_in_the_memory_history(default_pools):
    from capi_table import allocate, call
    sim = SimulatedDevice()
    pool = gpupool.Pool(upstream=sim, device=0)
    gpupool.set_pool(pool)
    ptr = allocate(1000)
    call("free", 0, ptr, 0)
    ptr = allocate(1000)                                # taken back: listed as handed
    assert pool._magazines_info()[0]["handed"] == 1
    gpupool.record_memory_history("all")
    try:
        call("free", 0, ptr, 0)
        trace = gpupool.memory_snapshot(pool)["device_traces"][0]
    finally:
        gpupool.record_memory_history(None)
    assert [e["action"] for e in trace if e["addr"] == ptr][:1] == ["free_requested"]
    check_invariants(pool)


def test_requests_that_find_their_magazine_empty_and_the_pools_sweeps_are_counted():
    sim = SimulatedDevice()
    pool = gpupool.Pool(upstream=sim)
    assert pool._sweep_counts() == {"others": 0, "want": 0, "handed": 0, "settle": 0}
    pool.allocate(MiB).close()          # grows: the magazines are swept first (none yet)
    grown = pool._sweep_counts()
    assert grown["want"] == 1
    (mine,) = pool._magazines_info()
    assert (mine["blocks"], mine["empty"]) == (1, 0)
    pool.allocate(MiB).close()          # from the magazine
    assert pool._magazines_info()[0]["empty"] == 0
    pool.trim()                         # flushes every magazine
    assert pool._magazines_info()[0]["blocks"] == 0
    pool.allocate(MiB).close()          # the magazine is empty: the shared path
    pool.allocate(MiB).close()          # held again: served there
    (mine,) = pool._magazines_info()
    assert (mine["empty"], mine["waits"], mine["free_waits"], mine["no_hand"]) == (1, 0, 0, 0)
    before = pool._sweep_counts()
    pool.allocate(64 * MiB).close()     # no block of its size: a miss looks at idle threads'
    after = pool._sweep_counts()        # and, as the pool grows for it, at every magazine
    assert (after["others"], after["want"], after["handed"]) == \
        (before["others"] + 1, before["want"] + 1, 0)
    assert after["settle"] > before["settle"]   # a new peak
    check_invariants(pool)
