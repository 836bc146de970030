"""Region.enter_in_thread() (region/inthread.pxi) on the simulated device: a region entered on
one thread made current on a worker thread too, only while it is entered; its exits and its
life."""

import gc
import threading
import weakref

import pytest
from conftest import check_invariants

import gpupool

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
