"""Steps for the planned-region tests on the simulated device: a step of requests with its
frees and tails, run under a region, every allocation checked for overlap with the buffers
live (``Checked``)."""

import os

import pytest
from conftest import check_invariants, checked
from hypothesis import strategies as st

import gpupool
from gpupool.region import planned
from gpupool.testing import SimulatedDevice

KIB, MIB = 1024, 1 << 20


@pytest.fixture
def vsim():
    yield from checked(SimulatedDevice(capacity=1 << 32, virtual_memory=True))


@pytest.fixture
def vpool(vsim):
    return gpupool.Pool(upstream=vsim)


def reserved_kib(plan, entries):
    """A planned (``plan``) or plain region over ``entries`` on the expandable simulated device
    (64 KiB pages), each entry allocating its sizes in order, then freeing them in order: the
    pool's reserved and peak reserved KiB at the end."""
    pool = gpupool.Pool(upstream=SimulatedDevice(virtual_memory=True, page=64 * KIB))
    region = gpupool.Region(pool=pool, plan=plan)
    for sizes in entries:
        with region:
            for buf in [pool.allocate(n) for n in sizes]:
                buf.close()
    pool._verify()
    stats = pool.stats()
    return stats.reserved_bytes // KIB, stats.peak_reserved_bytes // KIB


def scripted_kib(plan, entries, events, held=()):
    """A planned (``plan``) or plain region over ``entries`` (each a list of sizes, bytes) of
    the step ``events`` (("a", k) allocates request k, ("f", k) frees it) on the expandable
    simulated device (64 KiB pages); the requests in ``held`` stay live into the next entry,
    freed at its start. Returns the pool's peak reserved KiB and the region's stats."""
    pool = gpupool.Pool(upstream=SimulatedDevice(virtual_memory=True, page=64 * KIB))
    region = gpupool.Region(pool=pool, plan=plan)
    kept = []
    for sizes in entries:
        with region:
            for buf in kept:
                buf.close()
            live = {}
            for op, k in events:
                if op == "a":
                    live[k] = pool.allocate(sizes[k])
                else:
                    live.pop(k).close()
            kept = [live.pop(k) for k in held]
            for buf in live.values():
                buf.close()
    for buf in kept:
        buf.close()
    pool._verify()
    return pool.stats().peak_reserved_bytes // KIB, region.stats()


def four_requests_kib(plan, entries, stats=False):
    """Trial 33's step (:func:`scripted_kib`), for each ``(first, last)`` of ``entries``:
    request 0 of ``first`` bytes, two of 85,068 and 51,971 B, the first of them freed, one of
    ``last`` bytes, then all freed. Returns the peak reserved KiB and the region's record plans
    (with ``stats``, its ``RegionStats``)."""
    events = [("a", 0), ("a", 1), ("a", 2), ("f", 1), ("a", 3), ("f", 2), ("f", 0), ("f", 3)]
    peak, done = scripted_kib(plan, [(first, 85068, 51971, last) for first, last in entries],
                              events)
    return peak, done if stats else done.record_plans


# The greedy's orders without the online way's ("start", tried first, ties to it): for tests
# that name places by the size order's layout.
SIZE_ORDERS = ("size", "area")


@pytest.fixture
def unmirrored(monkeypatch):
    """Plans around nothing that stays are not mirrored (``planned.MIRROR``): for tests that
    name places by the greedy's own layout, the largest lowest."""
    monkeypatch.setattr(planned, "MIRROR", False)


class Checked:
    """The live buffers of a test, checked for overlap at every allocation."""

    def __init__(self, pool):
        self.pool, self.live = pool, {}

    def allocate(self, key, nbytes, stream=None):
        buf = self.pool.allocate(nbytes, stream)
        self.live[key] = buf
        spans = sorted((b.ptr, b.ptr + b.nbytes) for b in self.live.values() if b.nbytes)
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert end <= start, "two live blocks share bytes"
        return buf

    def free(self, key):
        del self.live[key]


def entered(region, pool, sizes):
    """One entry of ``region``: ``sizes`` (bytes) allocated from ``pool`` in order, all freed
    at its end."""
    with region:
        bufs = [pool.allocate(n) for n in sizes]
        del bufs


def run_step(mem, sizes, frees, tails, entry):
    """One step: allocate ``sizes`` in order, free request ``frees[k]`` after allocation k
    (None: none), keep the ``tails`` live until the next step frees them first. Returns the
    addresses of the step's buffers."""
    for key in [k for k in mem.live if k[0] == "tail"]:
        mem.free(key)
    addrs = []
    for k, n in enumerate(sizes):
        tag = ("tail", entry, k) if k in tails else ("step", entry, k)
        addrs.append(mem.allocate(tag, n).ptr)
        j = frees[k]
        if j is not None and ("step", entry, j) in mem.live:
            mem.free(("step", entry, j))
    for key in [k for k in mem.live if k[0] == "step"]:
        mem.free(key)
    return addrs


SIZES = [3 * MIB, 1 * MIB, 5 * MIB, 2 * MIB, 512 * KIB, 4 * MIB]
FREES = [None, None, 0, 1, 3, None]
TAILS = {5}


def entries(pool, region, count, sizes=SIZES, frees=FREES, tails=TAILS, mem=None):
    mem = mem or Checked(pool)
    found = []
    for e in range(count):
        with region:
            found.append(run_step(mem, sizes, frees, tails, e))
        check_invariants(pool)
    return found, mem


SCALES = [1.0, 1.0, 1.0, 0.7, 0.9, 0.6, 0.8, 0.75, 0.95, 0.65]


def scaled(scale):
    return [int(n * scale) // 512 * 512 for n in SIZES]


def draw_step(data, lo, hi):
    """A random step for a hypothesis test: (sizes, frees, tails) of lo to hi requests, as
    ``run_step`` takes them."""
    n = data.draw(st.integers(lo, hi))
    sizes = data.draw(st.lists(st.integers(1, 4 * MIB), min_size=n, max_size=n))
    frees = [data.draw(st.one_of(st.none(), st.integers(0, k))) for k in range(n)]
    tails = set(data.draw(st.lists(st.integers(0, n - 1), max_size=3)))
    return sizes, frees, tails


class Run:
    """A planned region's entries of scaled SIZES, each returning its (hits, misses); the
    addresses of the last entry's requests in ``addrs``. ``mem``: how its requests are made
    (default: ``Checked(pool)``, through Python)."""

    def __init__(self, pool, mem=None, **region):
        region.setdefault("plan", True)
        self.pool, self.mem = pool, mem or Checked(pool)  # every allocation checked for overlap
        self.region = gpupool.Region(pool=pool, collect=None, **region)
        self.count, self.addrs = 0, []

    def entry(self, sizes, frees=FREES, tails=TAILS):
        before = self.region.stats()
        with self.region:
            self.addrs = run_step(self.mem, sizes, frees, tails, self.count)
        self.count += 1
        check_invariants(self.pool)
        after = self.region.stats()
        return after.plan_hits - before.plan_hits, after.plan_misses - before.plan_misses

    def warm(self):
        for scale in SCALES:
            self.entry(scaled(scale))
        return self

    def spread(self, low):
        """Two entries that fold a step of ``scaled(low)`` into the plan's signature: a record
        step may then pass the most request 0 asked by up to ``1 / low`` times (the factor
        request 0 varied by; ``Planner.record``)."""
        self.entry(scaled(low))
        self.entry(scaled(1.0))
        return self

    def close(self):
        self.mem.live.clear()
        assert check_invariants(self.pool).in_use_bytes == 0


def recorded(monkeypatch, name):
    """The recorded trace ``name`` (bench/data/traces-real) and tools/profile/long_replay.py's
    module, their directories put on ``sys.path`` for the test."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir)
    for sub in ("bench", os.path.join("tools", "profile")):
        monkeypatch.syspath_prepend(os.path.join(root, sub))
    import alloc_trace
    import fragmentation
    import long_replay

    (trace,) = [t for t in map(alloc_trace.load, alloc_trace.find(fragmentation.REAL_DIR))
                if t.name == name]
    return trace, long_replay


def run_structures(structures, order, plan):
    """Structures taking turns under a planned (``plan``) or plain region on the expandable
    simulated device (64 KiB pages): ``structures`` maps a name to (sizes in KiB, events as
    "a3" allocates request 3 and "f3" frees it, the requests held into the next entry, which
    frees them first thing); ``order`` names the entries' structures. Returns the peak
    reserved KiB and the region's stats."""
    pool = gpupool.Pool(upstream=SimulatedDevice(virtual_memory=True, page=64 * KIB))
    region, held = gpupool.Region(pool=pool, plan=plan), []
    for name in order:
        sizes, events, keep = structures[name]
        with region:
            for buf in held:
                buf.close()
            live = {}
            for event in events.split():
                k = int(event[1:])
                if event[0] == "a":
                    live[k] = pool.allocate(sizes[k] * KIB)
                else:
                    live.pop(k).close()
            held = [live.pop(k) for k in keep]
            check_invariants(pool)
    for buf in held:
        buf.close()
    pool._verify()
    return pool.stats().peak_reserved_bytes // KIB, region.stats()
