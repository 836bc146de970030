"""A stream-ordered upstream (the driver's memory pool, simulated): memory allocated on one
stream reaches another only behind that allocation (CPU, simulated device)."""

import pytest
from conftest import check_invariants, checked

import gpupool
from gpupool.testing import SimulatedDevice

KIB, MIB = 1 << 10, 1 << 20
LARGE = 12 << 20      # above the segment limit (10 MiB): its own upstream allocation


@pytest.fixture
def osim():
    yield from checked(SimulatedDevice(capacity=1 << 30, stream_ordered=True))


@pytest.fixture
def opool(osim):
    return gpupool.Pool(upstream=osim)


def test_large_blocks_are_allocated_on_the_requesting_stream(opool, osim):
    s = osim.create_stream()
    buf = opool.allocate(LARGE, stream=s)
    assert osim.calls_named("alloc") == [(LARGE, s)]
    assert osim.allocated_on[buf.ptr][0] == s


def test_a_piece_of_a_segment_reaches_another_stream_only_behind_an_event_after_its_allocation(
        opool, osim):
    a, b = osim.create_stream(), osim.create_stream()
    first = opool.allocate(1000, stream=a)           # a new 2 MiB segment, in a's order
    seg = first.ptr                                  # cut at its start; the rest free on a
    seg_stream, work = osim.allocated_on[seg]
    assert seg_stream == a and osim.pending(a)
    held = [opool.allocate(1536 * KIB, stream=b)]    # the rest has no event yet: b grows its
    assert not seg <= held[0].ptr < seg + 2 * MIB    # own segment (and asks a for an event)
    assert len(osim.calls_named("alloc")) == 2
    assert osim.calls_named("event_record") == []
    held.append(opool.allocate(4 * MIB, stream=a))   # a allocates again (not from the rest):
    assert [args[1] for args in osim.calls_named("event_record")] == [a]    # the event
    second = opool.allocate(MIB, stream=b)           # b's own rest is too small: a's, cut
    assert seg < second.ptr < seg + 2 * MIB
    assert [args[0] for args in osim.calls_named("stream_wait_event")] == [b]
    assert osim.ordered(b, a, work)                  # b waits for the segment's allocation
    names = [name for name, _ in osim.calls]
    assert names.index("alloc") < names.index("event_record") < names.index("stream_wait_event")
    check_invariants(opool)


def test_an_event_that_reported_complete_is_dropped_and_recycled(opool, osim):
    a, b, c = osim.create_stream(), osim.create_stream(), osim.create_stream()
    first = opool.allocate(1000, stream=a)           # a's segment; its rest free on a
    held = [opool.allocate(1536 * KIB, stream=b)]    # no event on a's rest yet: b's own
    held.append(opool.allocate(4 * MIB, stream=a))   # a allocates: an event on its rest
    ((event, _),) = osim.calls_named("event_record")
    osim.complete(a)
    held.append(opool.allocate(MIB, stream=b))       # cut from a's rest: the event reports
    assert first.ptr < held[-1].ptr < first.ptr + 2 * MIB       # done, so no GPU wait
    assert osim.calls_named("stream_wait_event") == []
    assert osim.calls_named("event_query") == [(event,)]
    held.append(opool.allocate(1000, stream=c))      # b's blocks (no events) wait for b; the
    assert osim.calls_named("event_query") == [(event,)]        # done event is not asked again
    created = len(osim.calls_named("event_create"))
    held.append(opool.allocate(4 * MIB, stream=b))   # b allocates: events on its free blocks,
    recorded = osim.calls_named("event_record")[1:]  # the first of them the recycled one
    assert [s for _, s in recorded] == [b, b] and recorded[0][0] == event
    assert len(osim.calls_named("event_create")) == created + 1
    check_invariants(opool)


def test_release_threshold_follows_the_soft_limit_and_trim_reaches_the_upstream(osim):
    pool = gpupool.Pool(upstream=osim, soft_limit="64MiB")
    buf = pool.allocate(LARGE)
    del buf
    assert pool.trim() == LARGE
    assert osim.calls_named("trim") == [()]
    assert pool.stats().reserved_bytes == 0


def test_unknown_upstream_name_lists_the_choices():
    with pytest.raises(ValueError, match="'driver', 'async'"):
        gpupool.Pool(upstream="cuda")
