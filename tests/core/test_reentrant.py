"""Calls into a pool from inside its own upstream call (a Python upstream's code, or a
collection that runs there), on the thread holding the pool's lock: a free waits for the
unlock (deferred), and so does the end of a region dropped there; every other call that takes
the lock raises GpupoolError instead of waiting for ever (it used to hang). Found in review."""

import gc
import weakref

import pytest

import gpupool
from gpupool.testing import SimulatedDevice

MIB = 1 << 20


def inside_upstream_call(pool, device, fn):
    """fn() run inside pool's next map (its upstream call, the lock held); what it raised."""
    raised = []
    map_pages = device._map

    def held_map(va, nbytes):
        device._map = map_pages
        try:
            fn()
        except Exception as exc:            # noqa: BLE001 (returned)
            raised.append(exc)
        return map_pages(va, nbytes)

    device._map = held_map
    pool.allocate(256 * MIB).close()        # grows the pool: a map
    return raised


@pytest.fixture
def setup():
    device = SimulatedDevice(capacity=1 << 32, virtual_memory=True)
    pool = gpupool.Pool(upstream=device)
    region = gpupool.Region(pool=pool, collect=None, plan=True)
    for _ in range(4):
        with region:
            pool.allocate(MIB).close()
    return pool, device, region


CALLS = {
    "stats": lambda pool, region, buf: pool.stats(),
    "memory_stats": lambda pool, region, buf: pool.memory_stats(),
    "trim": lambda pool, region, buf: pool.trim(),
    "merge_streams": lambda pool, region, buf: pool.merge_streams(),
    "_verify": lambda pool, region, buf: pool._verify(),
    "cached_blocks": lambda pool, region, buf: pool.cached_blocks(),
    "reset_peak_stats": lambda pool, region, buf: pool.reset_peak_stats(),
    "memory_snapshot": lambda pool, region, buf: gpupool.memory_snapshot(pool=pool),
    "Region()": lambda pool, region, buf: gpupool.Region(pool=pool),
    "region entry": lambda pool, region, buf: region.__enter__(),
    "region.stats": lambda pool, region, buf: region.stats(),
    "region.release": lambda pool, region, buf: region.release(),
    "region.keep": lambda pool, region, buf: region.keep(buf),
    "enter_in_thread": lambda pool, region, buf: region.enter_in_thread().__enter__(),
}


@pytest.mark.parametrize("call", CALLS)
def test_a_call_that_takes_the_lock_raises_inside_the_pool_s_upstream_call(setup, call):
    pool, device, region = setup
    with region:
        buf = pool.allocate(MIB)
        raised = inside_upstream_call(pool, device, lambda: CALLS[call](pool, region, buf))
        buf.close()
    assert len(raised) == 1 and isinstance(raised[0], gpupool.GpupoolError), raised
    assert "from inside its own upstream call" in str(raised[0])
    assert pool._verify() == []
    region.stats()                          # the pool still serves and reports
    assert pool.stats().in_use_bytes == 0


@pytest.mark.parametrize("how", ["with", "enter_in_thread"])
def test_a_region_s_exit_inside_the_pool_s_upstream_call_raises_and_changes_nothing(setup, how):
    pool, device, region = setup
    block = region if how == "with" else region.enter_in_thread()
    if block is not region:
        region.__enter__()                  # (enter_in_thread() needs the region entered)
    block.__enter__()
    raised = inside_upstream_call(pool, device, lambda: block.__exit__(None, None, None))
    assert len(raised) == 1 and "from inside its own upstream call" in str(raised[0])
    block.__exit__(None, None, None)        # still entered: exits here
    if block is not region:
        region.__exit__(None, None, None)
    assert pool._verify() == [] and pool.stats().in_use_bytes == 0


@pytest.mark.parametrize("plan", [False, True])
def test_a_region_collected_inside_the_pool_s_upstream_call_ends_at_the_unlock(plan):
    device = SimulatedDevice(capacity=1 << 32, virtual_memory=True)
    pool = gpupool.Pool(upstream=device)
    cycle = [gpupool.Region(pool=pool, collect=None, plan=plan)]
    cycle.append(cycle)                     # only a collection frees it
    for _ in range(4):
        with cycle[0]:
            pool.allocate(MIB).close()
    held = cycle[0].stats().cached_bytes
    before = sum(nbytes for _, nbytes, _ in pool.cached_blocks())
    assert held > 0
    ref, dead = weakref.ref(cycle[0]), []
    del cycle
    assert inside_upstream_call(pool, device, lambda: (gc.collect(), dead.append(ref() is None))) \
        == []
    assert dead == [True]                   # it died there, the lock held
    assert pool._verify() == []
    assert pool.stats().in_use_bytes == 0
    # The region's cached blocks are the pool's again (besides the 256 MiB of the call).
    assert sum(nbytes for _, nbytes, _ in pool.cached_blocks()) >= before + held + 256 * MIB
    with gpupool.Region(pool=pool):         # and the pool's regions go on
        pool.allocate(MIB).close()
