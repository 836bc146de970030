"""Requests that creep upward on a plain upstream: a growth past twice the peak in use first
gives back the wholly free segments too small for the request, once their work is done
(core/growplain.pxd, sg_shed in core/giveback.pxd)."""

import pytest
from conftest import check_invariants, checked

import gpupool
from gpupool.testing import SimulatedDevice

MIB = 1 << 20
START, STEP, STEPS = 16 * MIB, 256 << 10, 64       # bench/creep.py's loop
PEAK_IN_USE = 2 * (START + (STEPS - 1) * STEP)      # 63.5 MiB


class WatchedDevice(SimulatedDevice):
    """A simulated device that knows which queued work uses which allocation (``use``), and
    counts a free of an allocation whose work has not completed as a misuse."""

    def __init__(self, **kw):
        super().__init__(capacity=1 << 32, **kw)
        self.last_use = {}              # allocation base -> (stream key, work number)

    def use(self, buf, stream=0):
        """Queue work on ``stream`` that reads ``buf`` ("a kernel still running")."""
        self.launch(stream)
        base = max(p for p in self._arrays if p <= buf.ptr)
        self.last_use[base] = (self._key(stream), self.queued(stream))

    def _free(self, ptr):
        key, work = self.last_use.pop(ptr, (0, 0))
        if self._done[key] < work:
            self._misuse(f"free of {ptr:#x} while work queued on it is pending")
        super()._free(ptr)


@pytest.fixture(params=[False, True], ids=["driver", "async"])
def sim(request):
    yield from checked(WatchedDevice(stream_ordered=request.param))


def creep(pool, sim, stream=None, work=False, steps=STEPS):
    """Two live buffers growing by STEP a step from START; each step frees the previous two
    and allocates two new ones. The device keeps up (a stream-ordered allocation is work on
    the stream, done at once); with work, each buffer is used on the stream, and the device
    completes the work only every other step (it runs behind). Returns the peak of reserved
    bytes seen."""
    live, peak = [], 0
    handle = 0 if stream is None else stream
    for k in range(steps):
        live.clear()
        for _ in range(2):
            live.append(pool.allocate(START + k * STEP, stream=stream))
            peak = max(peak, pool.stats().reserved_bytes)
            if work:
                sim.use(live[-1], handle)
            else:
                sim.complete(handle)
        if work and k % 2:
            sim.complete(handle)
        check_invariants(pool)
    live.clear()
    return peak


def segments(pool):
    return gpupool.memory_snapshot(pool)["segments"]


def assert_counted(pool, sim):
    """The pool's statistics agree with the device: reserved bytes, segments."""
    stats = check_invariants(pool)
    assert stats.reserved_bytes == sim.used
    assert stats.upstream_allocs - stats.upstream_frees == len(sim._arrays) == len(segments(pool))
    assert sum(s["total_size"] for s in segments(pool)) == stats.reserved_bytes


@pytest.mark.parametrize("stream", ["legacy", "created"])
def test_a_creeping_loop_reserves_at_most_twice_its_peak_in_use(sim, stream):
    pool = gpupool.Pool(upstream=sim)
    peak = creep(pool, sim, None if stream == "legacy" else sim.create_stream())
    stats = pool.stats()
    assert stats.peak_in_use_bytes == PEAK_IN_USE
    assert peak == stats.peak_reserved_bytes <= 2 * PEAK_IN_USE
    assert stats.upstream_frees > 0 and not sim.calls_named("synchronize")
    assert_counted(pool, sim)


def test_with_work_in_flight_the_loop_stays_bounded_and_frees_only_finished_segments(sim):
    pool = gpupool.Pool(upstream=sim)
    s = sim.create_stream()
    peak = creep(pool, sim, s, work=True)
    # A segment freed at a growth still has the step's work queued on it: it gets an event
    # and goes back at a later growth (1.95x the peak here, 1.45x with the device idle).
    assert peak == pool.stats().peak_reserved_bytes <= 2 * PEAK_IN_USE
    assert pool.stats().upstream_frees > 0 and not sim.calls_named("synchronize")
    assert_counted(pool, sim)


def test_a_segment_with_work_pending_on_another_stream_stays_until_that_work_is_done(sim):
    pool = gpupool.Pool(upstream=sim)
    a, b = sim.create_stream(), sim.create_stream()
    pool.allocate(1 << 10, stream=b)    # a small free segment on b, for b's request below
    busy = [pool.allocate(START + k * 2 * MIB, stream=b) for k in range(4)]
    for buf in busy:
        sim.use(buf, b)
    bases = {buf.ptr for buf in busy}
    del buf
    busy.clear()                        # four free segments, 16..22 MiB, b's work pending
    creep(pool, sim, a, steps=40)       # past twice the peak in use: growth sheds
    assert bases <= {s["address"] for s in segments(pool)}
    assert not bases & {ptr for (ptr,) in sim.calls_named("free")}
    # b allocates again (its free blocks get their event), its work completes: the next
    # growth that passes the bound gives them back.
    pool.allocate(1 << 10, stream=b)
    sim.complete(b)
    creep(pool, sim, a, steps=STEPS)
    assert bases <= {ptr for (ptr,) in sim.calls_named("free")}
    assert not sim.calls_named("synchronize")
    assert_counted(pool, sim)


def test_a_record_stream_use_keeps_the_segment_until_that_streams_work_is_done(sim):
    pool = gpupool.Pool(upstream=sim)
    other = sim.create_stream()
    buf = pool.allocate(START)
    buf.record_stream(other)
    sim.use(buf, other)
    base = buf.ptr
    del buf
    creep(pool, sim, steps=40)
    assert base not in {ptr for (ptr,) in sim.calls_named("free")}
    sim.complete(other)
    creep(pool, sim, steps=STEPS)
    assert base in {ptr for (ptr,) in sim.calls_named("free")}
    assert_counted(pool, sim)


def test_below_the_bound_the_cache_stays_whole(sim):
    pool = gpupool.Pool(upstream=sim)
    bufs = [pool.allocate(START + k * 2 * MIB) for k in range(4)]   # 16..22 MiB live at once
    bufs.clear()
    big = pool.allocate(40 * MIB)       # 76 + 40 MiB reserved, peak in use 76 MiB: no shed
    assert sim.calls_named("free") == []
    del big
    assert_counted(pool, sim)


def test_regions_cached_segments_are_not_shed(sim):
    pool = gpupool.Pool(upstream=sim)
    region = gpupool.Region(pool=pool, collect=None)
    with region:
        kept = [pool.allocate(START - k * 2 * MIB) for k in range(1, 4)]
        bases = {buf.ptr for buf in kept}
        kept.clear()                    # cached by the region, smaller than every request
    creep(pool, sim, steps=40)
    assert not bases & {ptr for (ptr,) in sim.calls_named("free")}
    region.release()                    # now the pool's: the next growths shed them
    creep(pool, sim, steps=STEPS)
    assert bases <= {ptr for (ptr,) in sim.calls_named("free")}
    assert_counted(pool, sim)


def test_an_expandable_upstream_never_frees_segments_for_a_creeping_loop():
    sim = SimulatedDevice(capacity=1 << 32, virtual_memory=True)
    pool = gpupool.Pool(upstream=sim)
    assert creep(pool, sim) <= PEAK_IN_USE + 2 * MIB
    assert sim.calls_named("free") == [] and sim.errors == []
