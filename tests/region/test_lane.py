"""A thread-scope region's lane (core/lane.pxd): its thread's allocate + free pairs of one size
are served without the pool's lock, and nothing that takes the pool's lock sees the lane: the
pool's counts, its bookkeeping, other threads' frees and requests, and a planned region's
addresses, stats and plans are those without lanes. See Note [Region lanes] in
docs/design.md."""

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_planrepeat_random import drive, scripts

import gpupool
from gpupool.core import pool as core_pool
from gpupool.testing import SimulatedDevice

MIB = 1 << 20


@pytest.fixture
def lanes_off():
    before = core_pool._set_lanes(False)
    yield
    core_pool._set_lanes(before)


def sim_pool():
    return gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 32, virtual_memory=True))


def pairs(region, sizes):
    """One entry of region: an allocate + free of each size in turn; the addresses."""
    addrs = []
    with region:
        for n in sizes:
            buf = region.pool.allocate(n)
            addrs.append(buf.ptr)
            buf.close()
    return addrs


def planned(pool, **options):
    """A planned region that has planned its step of pairs of 1 MiB (its entries on)."""
    region = gpupool.Region(pool=pool, collect=None, plan=True, **options)
    for _ in range(4):
        pairs(region, [MIB] * 4)
    return region


def test_a_planned_region_s_pairs_are_served_from_its_lane():
    pool = sim_pool()
    region = planned(pool)
    before, counts = region.stats(), pool.stats()
    addrs = pairs(region, [MIB] * 4)
    assert len(set(addrs)) == 1
    after = region.stats()
    # Request 0 takes the shared path (it may start a record step); the other 3, the lane.
    assert after.lane_hits - before.lane_hits == 3
    assert after.cache_hits - before.cache_hits == 4
    # The pool counts every free and allocation the lane served, bytes in use exact.
    now = pool.stats()
    assert (now.num_allocs - counts.num_allocs, now.num_frees - counts.num_frees,
            now.cache_hits - counts.cache_hits, now.in_use_bytes) == (4, 4, 4, 0)
    assert pool._verify() == []


def test_nothing_under_the_pool_s_lock_finds_a_block_in_a_lane():
    pool = sim_pool()
    region = planned(pool)
    before = region.stats().lane_hits
    ptrs = []
    with region:
        for i in range(4):
            buf = pool.allocate(MIB)    # 1 and 3 from the lane
            ptrs.append(buf.ptr)
            buf.close()                 # into the lane
            if i == 1:
                stats = pool.stats()    # the pool's lock: the lane's block put back
                assert stats.in_use_bytes == 0 and stats.num_frees == stats.num_allocs
                assert pool._verify() == []
    assert len(set(ptrs)) == 1          # request 2 took the same place, the shared way
    assert region.stats().lane_hits - before == 2
    assert pool.stats().in_use_bytes == 0 and pool._verify() == []


def test_another_thread_s_frees_and_requests_meet_no_lane():
    pool = sim_pool()
    region = planned(pool)
    done = []
    with region:
        for _ in range(2):
            pool.allocate(MIB).close()  # the second one's block waits in the lane
        theirs = pool.allocate(2 * MIB)

        def other():
            theirs.close()              # not its region: the shared path
            pool.allocate(MIB).close()  # the pool's memory: the lane's block is not lent
            done.append(pool._verify())

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert done == [[]]
        pool.allocate(MIB).close()
    assert region.stats().lane_hits > 0
    assert pool.stats().in_use_bytes == 0 and pool._verify() == []


@pytest.mark.parametrize("options", [{}, {"scope": "process"}, {"max_cached_bytes": 64 * MIB}])
def test_only_thread_scope_planned_regions_have_lanes(options):
    pool = sim_pool()
    plain = gpupool.Region(pool=pool, collect=None, **options)
    for _ in range(6):
        pairs(plain, [MIB] * 4)
    region = planned(pool, **options)
    pairs(region, [MIB] * 4)
    assert plain.stats().lane_hits == 0
    assert (region.stats().lane_hits > 0) == (options == {})
    assert region.stats().plan_hits > 0


def test_record_stream_and_the_memory_history_take_the_shared_path():
    sim = SimulatedDevice(capacity=1 << 32, virtual_memory=True)
    pool = gpupool.Pool(upstream=sim)
    other = sim.create_stream()
    region = planned(pool)
    before = region.stats().lane_hits
    with region:
        for _ in range(4):
            buf = pool.allocate(MIB)
            buf.record_stream(other)    # used on another stream: its free records an event
            buf.close()
    assert region.stats().lane_hits == before
    gpupool.record_memory_history(max_entries=100, stacks=None)
    try:
        pairs(region, [MIB] * 4)
    finally:
        gpupool.record_memory_history(enabled=None)
    assert region.stats().lane_hits == before
    assert pool._verify() == []


def test_threads_with_regions_of_their_own_beside_a_sweeping_thread():
    pool = sim_pool()
    stop, errors, made, hits = threading.Event(), [], [], []
    one_at_a_time = threading.Lock()    # regions taking turns go the pool's way, without lanes
                                        # (Note [Planned regions on several threads])

    def worker(seed):
        region = gpupool.Region(pool=pool, collect=None, plan=True)
        sizes = [(seed + i // 8) % 3 * MIB + MIB for i in range(40)]
        with one_at_a_time:
            made.append(sum(len(pairs(region, sizes)) for _ in range(25)))
        hits.append(region.stats().lane_hits)

    def sweeper():
        while not stop.is_set():
            stats = pool.stats()
            if stats.in_use_bytes + stats.cached_bytes != stats.reserved_bytes:
                errors.append(stats)
            pool.trim()
            errors.extend(pool._verify())

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    sweep = threading.Thread(target=sweeper)
    sweep.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    sweep.join()
    assert errors == []
    assert sum(hits) > 0
    stats = pool.stats()
    assert (stats.num_allocs, stats.num_frees, stats.in_use_bytes) == (sum(made), sum(made), 0)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(scripts())
def test_a_planned_region_plans_and_places_the_same_with_its_lane(monkeypatch, script):
    on = drive(script, monkeypatch)
    before = core_pool._set_lanes(False)
    try:
        off = drive(script, monkeypatch)
    finally:
        core_pool._set_lanes(before)
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        assert (a[0], {**a[1], "lane_hits": 0}, a[2]) == b, (i, script)


# A step of a planned region: pairs (an allocate and its free at once) and holds (freed at the
# entry's end), of a few sizes.
steps = st.lists(st.tuples(st.sampled_from(["pair", "hold"]), st.sampled_from([1, 2, 3])),
                 min_size=1, max_size=12)


def planned_run(entries):
    pool = sim_pool()
    region = gpupool.Region(pool=pool, collect=None, plan=True)
    out = []
    for step in entries:
        addrs, held = [], []
        with region:
            for kind, mib in step:
                buf = pool.allocate(mib * MIB)
                addrs.append(buf.ptr)
                if kind == "pair":
                    buf.close()
                else:
                    held.append(buf)
            held.clear()
        out.append(addrs)
    base = min(a for addrs in out for a in addrs)
    assert pool._verify() == []
    stats = {k: v for k, v in region.stats().as_dict().items()
             if k not in ("planning_ms", "record_ms", "collect_seconds")}
    return [[a - base for a in addrs] for addrs in out], stats, pool.stats()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(steps, st.integers(1, 8)), min_size=1, max_size=4))
def test_a_planned_region_s_pairs_place_the_same_with_its_lane(runs):
    entries = [step for step, times in runs for _ in range(times)]
    on = planned_run(entries)
    before = core_pool._set_lanes(False)
    try:
        off = planned_run(entries)
    finally:
        core_pool._set_lanes(before)
    assert on[0] == off[0] and on[2] == off[2]
    assert {**on[1], "lane_hits": 0} == off[1]


def test_a_planned_region_s_places_are_served_from_its_lane():
    addrs, stats, _ = planned_run([[("pair", 1)] * 6] * 12)
    # Request 0 of each entry takes the shared path; the others, once planned, the lane.
    assert stats["plan_hits"] >= 6 * 8 and stats["lane_hits"] >= 5 * 8
    assert addrs[-1] == addrs[-2]


@pytest.mark.gpu
def test_on_a_gpu_lane_blocks_keep_their_place_and_data():
    # A planned step of pairs on the device: the lane's blocks are the planned places, each
    # written and read back while a block the step keeps holds its own bytes.
    pool = gpupool.Pool(device=0, upstream="vmm")
    region = gpupool.Region(pool=pool, collect=None, plan=True)
    for entry in range(8):
        with region:
            kept = pool.allocate(2 * MIB)
            kept.memset(7)
            ptrs = []
            for i in range(6):
                buf = pool.allocate(MIB)
                buf.memset(i + 1)
                assert (buf.copy_to_host()[::4096] == i + 1).all()
                ptrs.append(buf.ptr)
                buf.close()
            assert (kept.copy_to_host()[::4096] == 7).all()
            kept.close()
        assert len(set(ptrs)) == 1
    stats = region.stats()
    assert stats.lane_hits > 0 and stats.plan_hits > 0
    assert pool.stats().in_use_bytes == 0 and pool._verify() == []
    region.release()
    pool.trim()
