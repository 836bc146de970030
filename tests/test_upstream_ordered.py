"""A stream-ordered upstream (the driver's memory pool, simulated): memory allocated on one
stream reaches another only behind that allocation (CPU, simulated device)."""

import pytest
from conftest import check_invariants

import gpupool
from gpupool.testing import SimulatedDevice

LARGE = 12 << 20      # above the segment limit (10 MiB): its own upstream allocation


@pytest.fixture
def osim():
    device = SimulatedDevice(capacity=1 << 30, stream_ordered=True)
    yield device
    assert device.errors == [], "the pool misused the simulated device"


@pytest.fixture
def opool(osim):
    return gpupool.Pool(upstream=osim)


def test_large_blocks_are_allocated_on_the_requesting_stream(opool, osim):
    s = osim.create_stream()
    buf = opool.allocate(LARGE, stream=s)
    assert osim.calls_named("alloc") == [(LARGE, s)]
    assert osim.allocated_on[buf.ptr][0] == s


def test_slab_blocks_for_another_stream_wait_for_the_slab_allocation(opool, osim):
    a, b = osim.create_stream(), osim.create_stream()
    first = opool.allocate(1000, stream=a)           # a new slab, allocated in a's order
    slab_stream, work = osim.allocated_on[max(p for p in osim.allocated_on if p <= first.ptr)]
    assert slab_stream == a and osim.pending(a)
    second = opool.allocate(1000, stream=b)          # carved from the same slab, on b
    assert len(osim.calls_named("alloc")) == 1
    assert osim.ordered(b, a, work)                  # b waits for the slab's allocation
    assert second.ptr != first.ptr


def test_slab_event_is_dropped_once_complete(opool, osim):
    a, b, c = osim.create_stream(), osim.create_stream(), osim.create_stream()
    held = [opool.allocate(1000, stream=a)]
    osim.complete(a)
    held.append(opool.allocate(1000, stream=b))      # the event reports done: no GPU wait
    assert osim.calls_named("stream_wait_event") == []
    queries = len(osim.calls_named("event_query"))
    held.append(opool.allocate(1000, stream=c))      # ... and is not asked again
    assert len(osim.calls_named("event_query")) == queries
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
