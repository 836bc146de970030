"""A planned region (Region(plan=True)) whose entries run while their stream is being captured
into a CUDA graph, on the simulated device (``SimulatedDevice.capturing``): a planned entry, a
record step that maps pages past the mapped end, a place whose last work is another stream's,
and a request that runs out of memory. None synchronizes the device or makes the captured
stream wait across the capture's boundary (each a misuse of the simulated device), live
blocks never overlap (``Checked``) and the counts add up (``check_invariants``). See Note
[Capture in a planned region] in docs/design.md."""

import pytest
from planned_steps import MIB, SIZES, Checked, Run, scaled, vsim  # noqa: F401 (fixture)

import gpupool
from gpupool.testing import Failures

# What a captured stream's requests must not bring about: a synchronize (it invalidates the
# capture), a wait across the capture's boundary, pages unmapped (after a synchronize).
UNSAFE = {"synchronize", "stream_wait_event", "unmap", "event_query"}
SHARED = 2                  # the request whose buffer is also used on the legacy stream


class OnStream(Checked):
    """Checked requests on one stream; with ``shared`` set, request SHARED's buffer is also
    used on the legacy stream behind work still running there (``record_stream``), so its
    block is freed with an event there that has not completed."""

    def __init__(self, pool, sim, stream):
        super().__init__(pool)
        self.sim, self.stream, self.shared = sim, stream, False

    def allocate(self, key, nbytes, stream=None):
        buf = super().allocate(key, nbytes, self.stream if stream is None else stream)
        if self.shared and key[2] == SHARED:
            buf.record_stream(0)
            self.sim.launch(0)
        return buf


def warmed(sim, **pool_options):
    """A planned region warmed on SCALES (its plan installed) on a created stream of sim:
    (Run, stream)."""
    pool = gpupool.Pool(upstream=sim, **pool_options)
    stream = sim.create_stream()
    return Run(pool, OnStream(pool, sim, stream)).warm(), stream


def captured(run, sim, stream, sizes):
    """One entry of sizes while stream is being captured: its (hits, misses) and the names of
    the simulated driver calls made meanwhile (its exit included)."""
    start = len(sim.calls)
    sim.capturing.add(stream)
    try:
        served = run.entry(sizes)
    finally:
        sim.capturing.discard(stream)
    return served, {name for name, _ in sim.calls[start:]}


def test_a_planned_entry_under_capture_is_served_from_its_plan(vsim):
    run, stream = warmed(vsim)
    served, calls = captured(run, vsim, stream, scaled(0.9))
    # Every request at its place (host work only), and the same places as the entry before
    # and after: a graph captured here replays at the addresses the step gets.
    assert served == (len(SIZES), 0)
    assert not calls & UNSAFE, calls
    addrs = run.addrs
    assert run.entry(scaled(0.9)) == (len(SIZES), 0) and run.addrs == addrs
    assert vsim.errors == []
    run.close()


def test_a_record_step_under_capture_maps_its_places_without_a_synchronize(vsim):
    run, stream = warmed(vsim)
    run.spread(0.2)                     # request 0 varied 5 times: a 4 times record is one
    mapped = run.pool.stats().reserved_bytes
    served, calls = captured(run, vsim, stream, scaled(4.0))
    # Request 0 went online and grew the pool; the rest was served from the record plan, its
    # places past the mapped end mapped for it (pages mapped, nothing synchronized).
    assert served == (len(SIZES) - 1, 0)
    assert run.region.stats().record_plans == 1
    assert run.pool.stats().reserved_bytes > mapped
    assert "map" in calls and not calls & UNSAFE, calls
    assert vsim.errors == []
    run.close()


def test_a_soft_limit_trim_waits_for_a_request_outside_the_capture(vsim):
    pool = gpupool.Pool(upstream=vsim, soft_limit=4 * MIB)
    stream = vsim.create_stream()
    pool.allocate(3 * MIB, stream).close()
    vsim.capturing.add(stream)
    start = len(vsim.calls)
    grown = pool.allocate(9 * MIB, stream)          # past the soft limit: no trim now
    assert not {name for name, _ in vsim.calls[start:]} & UNSAFE
    vsim.capturing.clear()
    start = len(vsim.calls)
    pool.allocate(12 * MIB, stream).close()         # outside the capture: trimmed
    assert "synchronize" in {name for name, _ in vsim.calls[start:]}
    grown.close()
    assert vsim.errors == []


def test_a_place_behind_another_streams_work_is_not_waited_for_under_capture(vsim):
    run, stream = warmed(vsim)
    run.mem.shared = True
    assert run.entry(scaled(0.9)) == (len(SIZES), 0)
    run.mem.shared = False
    # Request SHARED's place holds a block whose legacy-stream work is still running: the
    # captured stream neither queries its event (refused during a capture) nor waits for it
    # (that event lies outside the capture), so the request misses its place and goes
    # online, which does neither.
    (hits, misses), calls = captured(run, vsim, stream, scaled(0.9))
    assert misses >= 1 and not calls & UNSAFE, calls
    assert "stream_capturing" in calls and "event_query" not in calls, calls
    assert vsim.errors == []
    # Outside the capture the stream waits for it on the GPU, and the plan serves again.
    vsim.complete()
    run.entry(scaled(0.9))
    assert run.entry(scaled(0.9)) == (len(SIZES), 0)
    run.close()


@pytest.mark.parametrize("scale", [0.9, 2.0, 8.0])
def test_out_of_memory_under_capture_gives_nothing_back(vsim, scale):
    # Every growth fails from the entry's start. A planned entry needs none; a record step's
    # request 0 (2.0) and a step larger than all the memory mapped (8.0) run out of memory,
    # and the ladder, whose trims synchronize, gives nothing back while the stream is being
    # captured: the request fails as out of memory.
    run, stream = warmed(vsim)
    reserved, start = run.pool.stats().reserved_bytes, len(vsim.calls)
    vsim.inject(Failures(("reserve", "map"), nth=1, times=None))
    try:
        if scale < 1:
            served, calls = captured(run, vsim, stream, scaled(scale))
            assert served == (len(SIZES), 0)
        else:
            with pytest.raises(gpupool.OutOfMemoryError):
                captured(run, vsim, stream, scaled(scale))
            calls = {name for name, _ in vsim.calls[start:]}
            run.count += 1
    finally:
        vsim.inject(None)
    assert not calls & UNSAFE, calls
    assert vsim.errors == []
    assert run.pool.stats().reserved_bytes == reserved
    run.mem.live = {k: b for k, b in run.mem.live.items() if k[0] == "tail"}
    # Outside the capture the same step runs (its growth succeeds now).
    run.entry(scaled(scale))
    run.entry(scaled(scale))
    assert vsim.errors == []
    run.close()
