"""Region.enter_in_thread() (region/inthread.pxi) on the simulated device: a region entered on
one thread made current on a worker thread too, only while it is entered; its exits and its
life; a worker in an entry that skip_first skips, served by the pool."""

import gc
import threading
import weakref

import pytest
from conftest import check_invariants

import gpupool
from gpupool.testing import SimulatedDevice

KIB = 1024


@pytest.fixture
def region(pool):
    return gpupool.Region(pool=pool)


def in_thread(fn):
    """fn() on a thread of its own; what it raised, or None."""
    raised = []

    def body():
        try:
            fn()
        except BaseException as exc:        # noqa: BLE001 (returned)
            raised.append(exc)
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return raised[0] if raised else None


def test_enter_in_thread_covers_a_worker_thread(pool, region):
    ptrs = []

    def worker():
        with region.enter_in_thread():
            ptrs.append(pool.allocate(300 * KIB).ptr)

    for _ in range(2):
        with region:
            t = threading.Thread(target=worker)
            t.start()
            t.join()
    assert ptrs[0] == ptrs[1]
    assert region.stats().cache_hits == 1


def test_an_enter_in_thread_block_exits_only_on_its_own_thread(pool, region):
    # An exit on another thread raises and changes nothing; the entering thread exits it
    # after (before, the other thread's exit left the region on the worker's stack, and the
    # worker's next allocation read the dropped region's cache).
    inside = region.enter_in_thread()
    entered, tried, done = threading.Event(), threading.Event(), []

    def worker():
        inside.__enter__()
        entered.set()
        tried.wait()
        pool.allocate(300 * KIB).close()        # still the region's
        inside.__exit__(None, None, None)
        done.append(region.stats().cache_misses)

    with region:
        t = threading.Thread(target=worker)
        t.start()
        entered.wait()
        with pytest.raises(gpupool.GpupoolError, match="exited on another thread"):
            inside.__exit__(None, None, None)
        tried.set()
        t.join()
    assert done == [1]
    with pytest.raises(gpupool.GpupoolError, match="without being entered"):
        inside.__exit__(None, None, None)
    check_invariants(pool)


def test_a_region_entered_in_a_thread_lives_while_entered_there(pool):
    # Its context object dropped without an exit, its region exited and dropped on the
    # thread that entered it, the region stays current on the worker and alive (before, it
    # could be dropped while the worker's stack of regions named its deleted cache). The
    # worker's thread ends with the region still entered there (the test's thread stays
    # clean).
    region = gpupool.Region(pool=pool, collect=None)
    ref = weakref.ref(region)
    entered, exited, seen = threading.Event(), threading.Event(), []

    def body():
        ref().enter_in_thread().__enter__()
        entered.set()
        exited.wait()
        gc.collect()
        assert ref() is not None
        pool.allocate(300 * KIB).close()
        pool.allocate(300 * KIB).close()
        assert ref().stats().cache_hits == 1        # the region's, on this thread
        seen.append(True)
    thread = threading.Thread(target=body)
    with region:
        thread.start()
        entered.wait()
    del region
    exited.set()
    thread.join()
    assert seen == [True]
    check_invariants(pool)


def test_enter_in_thread_decorates_a_function(pool, region):
    @region.enter_in_thread()
    def work():
        return pool.allocate(300 * KIB).ptr

    with region:
        ptrs = [work(), work()]
    assert ptrs[0] == ptrs[1] and region.stats().cache_hits == 1
    check_invariants(pool)


@pytest.mark.parametrize("scope", ["thread", "process"])
def test_enter_in_thread_refuses_a_region_not_entered(pool, scope):
    # It was accepted (trial 29): the worker's allocations were cached by a region no entry
    # covered (entries=0, a miss, cached bytes). Not entered (never, or exited since): refused
    # on this thread and on another, and nothing counted; entered on one thread, a worker's
    # entry is the intended use.
    region = gpupool.Region(pool=pool, scope=scope)

    def enter():
        with region.enter_in_thread():
            pool.allocate(2000)
    for when in ("never entered", "exited"):
        with pytest.raises(gpupool.GpupoolError, match="is not entered: enter_in_thread"):
            enter()
        exc = in_thread(enter)
        assert isinstance(exc, gpupool.GpupoolError) and "is not entered" in str(exc), when
        with region:
            pass
    stats = region.stats()
    assert (stats.entries, stats.cache_hits, stats.cache_misses, stats.cached_bytes) == (
        2, 0, 0, 0)
    with region:
        assert in_thread(enter) is None
    assert region.stats().cache_misses == 1
    check_invariants(pool)


@pytest.mark.parametrize("scope", ["thread", "process"])
def test_a_worker_in_a_skipped_entry_is_served_by_the_pool(pool, scope):
    # A worker in a skip_first region's first entry is served by the pool, as the entering
    # thread is; from the second entry on it is cached. Before, it pushed the region's cache:
    # its allocations were cached (a miss, cached bytes), and its buffer, a live block of the
    # region that no exit had settled, was invalidated by the second entry's exit.
    region = gpupool.Region(pool=pool, skip_first=True, on_exit="invalidate", scope=scope)
    kept = []

    def worker():
        with region.enter_in_thread():
            kept.append(pool.allocate(300 * KIB))

    with region:
        assert in_thread(worker) is None
    stats = region.stats()
    assert (stats.cache_hits, stats.cache_misses, stats.cached_bytes,
            stats.peak_in_use_bytes) == (0, 0, 0, 0)
    workspace, ptrs = kept.pop(), []
    for _ in range(2):
        with region:
            assert in_thread(worker) is None
            ptrs.append(kept.pop().ptr)
    stats = region.stats()
    assert stats.entries == 3 and stats.cache_hits + stats.cache_misses == 2
    assert ptrs[0] == ptrs[1] and stats.cached_bytes > 0
    assert not workspace.closed                 # the pool's: no exit of the region touches it
    workspace.close()                           # back to the pool, not to the region
    assert region.stats().cached_bytes == stats.cached_bytes
    assert check_invariants(pool).in_use_bytes == 0


def test_a_worker_that_stays_past_a_skipped_entry_stays_uncached(pool):
    # A worker that entered during the skipped entry and is still inside at the second keeps
    # what it pushed: the pool serves it until it exits (before, the region cached it).
    region = gpupool.Region(pool=pool, skip_first=True)
    entered, go, done = threading.Event(), threading.Event(), threading.Event()

    def worker():
        with region.enter_in_thread():
            entered.set()
            go.wait()
            pool.allocate(300 * KIB).close()
        done.set()

    thread = threading.Thread(target=worker)
    with region:
        thread.start()
        entered.wait()
    with region:
        go.set()
        done.wait()
        pool.allocate(300 * KIB).close()        # the entering thread's: cached
    thread.join()
    stats = region.stats()
    assert stats.cache_hits + stats.cache_misses == 1
    check_invariants(pool)


def test_a_process_region_covers_other_threads_from_its_second_entry(pool):
    # A skipped entry installs no process-wide region: the other threads are served as if no
    # region were entered (by the pool, or by another process region entered meanwhile).
    region = gpupool.Region(pool=pool, skip_first=True, scope="process")
    counted = []
    for _ in range(3):
        with region:
            assert in_thread(lambda: pool.allocate(300 * KIB).close()) is None
        stats = region.stats()
        counted.append(stats.cache_hits + stats.cache_misses)
    assert counted == [0, 1, 2]
    other = gpupool.Region(pool=pool, scope="process")
    skipping = gpupool.Region(pool=pool, skip_first=True, scope="process")
    with skipping, other:
        assert in_thread(lambda: pool.allocate(300 * KIB).close()) is None
    counts = [(r.stats().cache_hits + r.stats().cache_misses) for r in (skipping, other)]
    assert counts == [0, 1]
    check_invariants(pool)


def test_a_worker_in_a_skipped_entry_leaves_the_plan_records_alone():
    # Before, the worker's events of the skipped entry, recorded with no entry's marker, led
    # the second exit's read (the planner's kept events) and counted a miss in the region.
    def run(worker_first):
        pool = gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 32, virtual_memory=True))
        region = gpupool.Region(pool=pool, skip_first=True, plan=True, collect=None)

        @region.enter_in_thread()
        def worker():
            pool.allocate(700 * KIB).close()
        kept = []
        for e in range(6):
            with region:
                if e == 0 and worker_first:
                    assert in_thread(worker) is None
                bufs = [pool.allocate(n * KIB) for n in (100, 200, 400)]
                del bufs
            if e == 1:
                kept = [(p != 0, n) for p, n, _ in region.planner._recorded_steps.kept.tolist()]
        check_invariants(pool)
        stats = region.stats()
        return kept, (stats.cache_hits, stats.cache_misses, stats.plans, stats.plan_hits,
                      stats.plan_misses)

    kept, counts = run(True)
    assert kept[0] == (False, 0) and len(kept) == 7     # entry 2's marker, 3 requests, 3 frees
    assert (kept, counts) == run(False)
