"""Per-thread magazines (gpupool/core/magazine.pxd) on the simulated device: a thread's free and
its next request of the same size are served without the pool's lock, also while another
thread holds it and while another stream is wanted; regions and record_stream keep their own
rules; GPUPOOL_MAGAZINES=0 turns them off; snapshots, the memory history and the counters of
misses and sweeps see them. Across threads: test_magazine_threads.py; small and large sizes
on one segment: test_magazine_sizes.py."""

import subprocess
import sys
import textwrap
import threading
import time

from conftest import check_invariants, on_thread

import gpupool
from gpupool.testing import SimulatedDevice

MiB = 1 << 20


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


def test_a_dead_threads_per_thread_stream_keeps_no_other_stream_from_its_magazine():
    sim = BlockingDevice()
    pool = gpupool.Pool(upstream=sim)
    on_thread(lambda: pool.allocate(16 * MiB, stream=2).close())   # its per-thread stream
    time.sleep(0.05)                                    # its thread-local destructors run
    big = pool.allocate(12 * MiB)                       # waits for it in vain: it is wanted
    assert_retake_needs_no_lock(sim, pool)
    big.close()
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
