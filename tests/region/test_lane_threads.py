"""A planned region's lane (core/lane.pxd) beside the pool's lock held elsewhere: a free made
inside the pool's own upstream call (the lock's thread: deferred), another thread that entered
the region (`enter_in_thread`) freeing and allocating while the lock is held, and that thread
and the region's own thread at once beside a thread reading the pool. Written in review."""

import sys
import threading

import gpupool
from gpupool.testing import SimulatedDevice

MIB = 1 << 20


class Hooked(SimulatedDevice):
    """A simulated device that calls `hook` once, inside its next map (the pool's lock held)."""

    hook = None

    def _map(self, va, nbytes):
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return super()._map(va, nbytes)


def pairs(region, sizes):
    with region:
        for n in sizes:
            region.pool.allocate(n).close()


def planned(pool):
    """A planned region that has planned its step of pairs of 1 MiB."""
    region = gpupool.Region(pool=pool, collect=None, plan=True)
    for _ in range(4):
        pairs(region, [MIB] * 4)
    return region


def balanced(pool):
    stats = pool.stats()
    return pool._verify() == [] and stats.in_use_bytes == 0 and \
        stats.num_allocs == stats.num_frees


def test_a_free_inside_the_pool_s_upstream_call_is_deferred():
    device = Hooked(capacity=1 << 32, virtual_memory=True)
    pool = gpupool.Pool(upstream=device)
    region = planned(pool)
    with region:
        pool.allocate(MIB).close()              # into the lane
        held = [pool.allocate(MIB)]             # from the lane
        device.hook = lambda: held.pop().close()    # freed by the lock's thread, in the region
        big = pool.allocate(256 * MIB)          # the pool grows: its upstream call
        assert held == []
        big.close()
        pool.allocate(MIB).close()
    assert balanced(pool)


def test_another_thread_in_the_region_frees_and_allocates_while_the_lock_is_held():
    device = Hooked(capacity=1 << 32, virtual_memory=True)
    pool = gpupool.Pool(upstream=device)
    region = planned(pool)
    errors = []
    with region:
        keep = [pool.allocate(MIB) for _ in range(3)]

        def other():
            try:
                with region.enter_in_thread():
                    for buf in keep:
                        buf.close()
                    pool.allocate(MIB).close()
            except BaseException as e:          # noqa: BLE001 (reported below)
                errors.append(e)

        thread = threading.Thread(target=other)
        device.hook = lambda: (thread.start(), thread.join(0.5))
        big = pool.allocate(256 * MIB)
        thread.join()
        big.close()
    assert errors == []
    assert balanced(pool)


def test_two_threads_in_the_region_beside_a_reading_thread():
    pool = gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 32, virtual_memory=True))
    region = planned(pool)
    stop, errors = threading.Event(), []

    def reader():
        try:
            while not stop.is_set():
                stats = pool.stats()
                if stats.in_use_bytes + stats.cached_bytes != stats.reserved_bytes:
                    errors.append(stats)
                errors.extend(pool._verify())
                region.stats()
        except BaseException as e:                  # noqa: BLE001 (reported below)
            errors.append(e)

    def worker():
        try:
            with region.enter_in_thread():
                for i in range(300):
                    pool.allocate(MIB * (1 + i % 2)).close()
        except BaseException as e:              # noqa: BLE001 (reported below)
            errors.append(e)

    reading = threading.Thread(target=reader)
    reading.start()
    for _ in range(5):
        with region:
            thread = threading.Thread(target=worker)
            thread.start()
            for _ in range(300):
                pool.allocate(MIB).close()
            thread.join()
    stop.set()
    reading.join()
    assert errors == []
    assert region.stats().lane_hits > 0
    assert balanced(pool)


def test_a_planners_plans_are_read_while_another_thread_changes_them():
    # Region.stats reads Planner.plans on any thread while the worker's plan changes the
    # OrderedDict: a comprehension over its live view raised "OrderedDict mutated during
    # iteration" (trial 28, test_two_threads_in_the_region_beside_a_reading_thread's reader).
    from gpupool.region.planned import Planner
    planner, stop, errors = Planner(), threading.Event(), []
    for k in range(64):
        planner._plans[k] = (k, None, 0)

    def change():
        k = 64
        while not stop.is_set():
            planner._plans[k] = (k, None, 0)
            planner._plans.popitem(last=False)
            k += 1
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=change)
    thread.start()
    try:
        for _ in range(3000):
            assert len(planner.plans) == 64
    except BaseException as e:                      # noqa: BLE001 (asserted below)
        errors.append(e)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(switch)
    assert errors == []
