"""Expandable segments (the "vmm" upstream) on the simulated device, and on a real device
(marked gpu): gpupool.VmmUpstream over the driver's virtual memory API.

``SimulatedDevice(virtual_memory=True)`` records the pool's ``reserve``, ``map``, ``unmap`` and
``unreserve`` calls, counts mapped bytes (``device_bytes``) and records an unmap made while
any stream has work pending (a misuse, ``sim.errors``). Each stream grows a segment of its
own: a range of address space whose pages are mapped as it grows, so free space at its end
joins the next request; a trim unmaps whole free pages (the end of a segment shrinks it,
pages in the middle become a hole, mapped again when a request fits it).

PAGE is 4 KiB to keep the tests small. The simulated device's reservations are host mmaps,
aligned to the host page only; the pool counts pages from a segment's start, so larger pages
work too (a regression test at the end uses 64 KiB pages on a misaligned reservation).
"""

import gc
import mmap
from contextlib import nullcontext

import numpy as np
import pytest
from conftest import check_invariants
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant
from test_state_machine import PoolMachine

import gpupool
from gpupool.testing import SimulatedDevice

KIB, MIB = 1 << 10, 1 << 20
PAGE = 4 * KIB                          # host pages are multiples of it: reservations align


def vmm(capacity=64 * MIB):
    """A simulated device with virtual memory and a pool on it."""
    sim = SimulatedDevice(capacity=capacity, virtual_memory=True, page=PAGE)
    return sim, gpupool.Pool(upstream=sim)


@pytest.fixture
def vsim():
    device = SimulatedDevice(capacity=64 * MIB, virtual_memory=True, page=PAGE)
    yield device
    assert device.errors == [], "the pool misused the simulated device"


@pytest.fixture
def vpool(vsim):
    return gpupool.Pool(upstream=vsim)


def names(sim, *wanted):
    """The names of the calls in sim.calls that are among wanted, in order."""
    return [name for name, _ in sim.calls if name in wanted]


def grow_two_buffers(pool, iterations, start=MIB):
    """Two buffers 10% larger every iteration, both freed at its end; the peak live bytes."""
    peak, size = 0, float(start)
    for _ in range(iterations):
        x, y = pool.allocate(int(size)), pool.allocate(int(size * 1.05))
        peak = max(peak, pool.stats().in_use_bytes)
        del x, y
        size *= 1.1
    return peak


# (1) Growth at the end of the stream's segment ------------------------------------------

def test_growing_buffers_reuse_the_free_end_so_reserved_stays_near_the_peak(vpool, vsim):
    peak = grow_two_buffers(vpool, 20)
    stats = check_invariants(vpool)
    assert stats.peak_reserved_bytes < 2 * peak
    assert stats.peak_reserved_bytes <= peak + PAGE        # at most a page of slack
    assert vsim.peak_device_bytes == stats.peak_reserved_bytes
    # One range; every map continues where the last ended (the free end joined the request),
    # at most one map per iteration after the first.
    assert len(vsim.calls_named("reserve")) == 1
    maps = vsim.calls_named("map")
    assert all(va == prev + n for (prev, n), (va, _) in zip(maps, maps[1:], strict=False))
    assert len(maps) <= 20 + 1
    assert vsim.calls_named("unmap") == []


def test_on_a_plain_upstream_growing_buffers_need_new_segments(pool, sim):
    # A plain segment cannot grow: each larger pair needs a new segment. The freed ones, too
    # small now, go back when a growth would pass twice the peak in use (sg_shed: see
    # tests/core/test_creep.py), so reserved stays within twice the peak, not within a page
    # as above; the frees join, leaving whole segments cached, which a trim gives back.
    peak = grow_two_buffers(pool, 20)
    stats = check_invariants(pool)
    assert peak + PAGE < stats.peak_reserved_bytes <= 2 * peak     # the contrast with above
    assert stats.upstream_frees > 0
    assert all(not piece for _, _, piece in pool.cached_blocks())
    assert pool.trim() == stats.reserved_bytes
    assert sim.used == 0


# (2) Exact growth ------------------------------------------------------------------------

def test_a_request_maps_the_pages_it_needs_and_no_more(vpool, vsim):
    x = vpool.allocate(5 * PAGE + 1)                # 5 pages and 512 B: 6 pages
    (va,) = [args[0] for args in vsim.calls_named("map")]
    assert vsim.calls_named("map") == [(va, 6 * PAGE)] and x.ptr == va
    assert vpool.stats().reserved_bytes == vsim.device_bytes == 6 * PAGE
    y = vpool.allocate(3 * PAGE)      # the free end (a page less 512 B) joins: 3 more pages
    assert y.ptr == x.ptr + 5 * PAGE + 512
    assert vsim.calls_named("map")[-1] == (va + 6 * PAGE, 3 * PAGE)
    assert vpool.cached_blocks() == [(y.ptr + 3 * PAGE, PAGE - 512, True)]
    check_invariants(vpool)


def test_small_requests_map_their_pages_not_a_shared_segment(vpool, vsim):
    ballast = vpool.allocate(32 * MIB)       # a plain pool would now grow 4 MiB segments
    small = vpool.allocate(100 * KIB)
    assert vsim.calls_named("map")[-1] == (ballast.ptr + 32 * MIB, 100 * KIB)
    assert small.ptr == ballast.ptr + 32 * MIB
    assert vpool.stats().reserved_bytes == 32 * MIB + 100 * KIB


def layout(pool, sizes):
    """Blocks of these sizes allocated in turn on the legacy stream (one range, back to
    back); those of the odd places are freed (into the free lists, made free for every
    stream: merge_streams flushes the thread's magazine). Returns the blocks kept."""
    blocks = [pool.allocate(n) for n in sizes]
    for i in range(1, len(blocks), 2):
        blocks[i].close()
    pool.merge_streams()
    return blocks[::2]


def test_a_small_request_goes_against_a_live_small_block_not_into_a_large_hole(vpool):
    # [8 KiB live][4 MiB free][8 KiB live][4 MiB free][1 MiB live]: best fit would cut the
    # request from the first hole's bottom, between the small block and a large free run.
    # Small blocks, some long-lived (an optimizer's state), split the free runs that large
    # requests then needed (ViT-B/16's replay reserved 5,234 MiB against PyTorch's 5,110).
    first, second, last = layout(vpool, [8 * KIB, 4 * MIB, 8 * KIB, 4 * MIB, MIB])
    x = vpool.allocate(16 * KIB)
    assert x.ptr == second.ptr - 16 * KIB          # the top of the hole below a small block
    y = vpool.allocate(16 * KIB)
    assert y.ptr == x.ptr - 16 * KIB               # the small blocks grow down, together
    big = vpool.allocate(4 * MIB - 32 * KIB)        # the rest of the hole is still one block
    assert big.ptr == first.ptr + 8 * KIB
    check_invariants(vpool)


def test_a_small_request_takes_a_hole_of_about_its_size_wherever_it_is(vpool):
    # [2 MiB live][24 KiB free][2 MiB live][4 MiB free][8 KiB live][2 MiB free][2 MiB live]:
    # the 24 KiB hole holds at most 1.75 times the request, so best fit stands.
    a = layout(vpool, [2 * MIB, 24 * KIB, 2 * MIB, 4 * MIB, 8 * KIB, 2 * MIB, 2 * MIB])[0]
    x = vpool.allocate(16 * KIB)
    assert x.ptr == a.ptr + 2 * MIB
    check_invariants(vpool)


def test_a_small_request_with_no_small_block_to_go_against_is_best_fit(vpool):
    # [1 MiB live][4 MiB free][2 MiB live][64 KiB free][2 MiB live]
    a, b, c = layout(vpool, [MIB, 4 * MIB, 2 * MIB, 64 * KIB, 2 * MIB])
    x = vpool.allocate(16 * KIB)
    assert x.ptr == b.ptr + 2 * MIB                 # the smallest hole, from its bottom
    check_invariants(vpool)


def test_on_a_plain_upstream_a_small_request_is_best_fit(pool):
    first, second, last = layout(pool, [8 * KIB, 4 * MIB, 8 * KIB, 4 * MIB, MIB])
    x = pool.allocate(16 * KIB)
    assert x.ptr != second.ptr - 16 * KIB
    check_invariants(pool)


# (3) Trim ----------------------------------------------------------------------------------

def test_trim_synchronizes_then_unmaps_whole_free_pages_only(vpool, vsim):
    s = vsim.create_stream()
    live = vpool.allocate(PAGE // 2, stream=s)      # half of the first page
    big = vpool.allocate(4 * PAGE, stream=s)        # the rest of it and 4 more pages
    base = live.ptr
    assert vpool.stats().reserved_bytes == 5 * PAGE
    live.copy_from_host(np.arange(PAGE // 2, dtype=np.uint8) % 251)
    vsim.launch(s)                                  # work on big still pending at its free
    del big
    vsim.calls.clear()
    assert vpool.trim() == 4 * PAGE
    # The device synchronized first, then the whole pages went: the end of the segment.
    assert names(vsim, "synchronize", "unmap", "map", "trim") == ["synchronize", "unmap", "trim"]
    assert vsim.calls_named("unmap") == [(base + PAGE, 4 * PAGE)]
    assert vsim.errors == []
    stats = check_invariants(vpool)
    assert stats.reserved_bytes == vsim.device_bytes == PAGE
    # The partial page stays mapped and cached, the live block's page stays mapped.
    assert vpool.cached_blocks() == [(base + PAGE // 2, PAGE // 2, True)]
    assert vsim.mapped(base, PAGE) and not vsim.mapped(base + PAGE, PAGE)
    np.testing.assert_array_equal(live.copy_to_host(),
                                  np.arange(PAGE // 2, dtype=np.uint8) % 251)
    live.memset(7)
    assert (live.copy_to_host() == 7).all()


def test_a_trim_with_nothing_cached_neither_synchronizes_nor_unmaps(vpool, vsim):
    keep = vpool.allocate(PAGE)
    vpool.allocate(3 * PAGE).close()        # freed on the legacy stream: bound to it
    vsim.calls.clear()
    assert vpool.trim() == 3 * PAGE
    assert names(vsim, "synchronize", "unmap") == ["synchronize", "unmap"]
    vsim.calls.clear()
    assert vpool.trim() == 0                # nothing cached: no synchronize, no unmap
    assert names(vsim, "synchronize", "unmap") == []
    assert vsim.mapped(keep.ptr, PAGE)


# (4) Holes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("neighbour_free", [False, True])
def test_a_hole_left_by_a_trim_is_mapped_again_rather_than_growing_the_end(
        vpool, vsim, neighbour_free):
    a = vpool.allocate(PAGE)
    b = vpool.allocate(4 * PAGE)
    c = vpool.allocate(PAGE)
    base = a.ptr
    del b
    assert vpool.trim() == 4 * PAGE
    assert vsim.calls_named("unmap") == [(base + PAGE, 4 * PAGE)]     # a hole: the end stays
    assert vsim.mapped(c.ptr, PAGE) and not vsim.mapped(base + PAGE, PAGE)
    request = 3 * PAGE
    if neighbour_free:
        del c                          # the hole and its free neighbour hold 5 pages
        request = 5 * PAGE
    vsim.calls.clear()
    d = vpool.allocate(request)
    ((va, nbytes),) = vsim.calls_named("map")
    assert va == base + PAGE and nbytes <= 4 * PAGE     # the hole, not the segment's end
    assert d.ptr == base + PAGE
    assert vsim.mapped(d.ptr, request)
    assert vsim.calls_named("reserve") == []
    assert check_invariants(vpool).reserved_bytes <= 6 * PAGE


# (4b) Cold free pages move to growth --------------------------------------------------------

COLD_ALLOCS = 128                       # core/segments.pxd: allocations that leave a block cold


def pieces(pool, sim, stream=None, pages=3, count=2, churn=COLD_ALLOCS):
    """count free blocks of `pages` pages each between live pages (the segment ends with a
    live one), then `churn` allocations that touch none of them (a 512-byte block freed and
    taken again: parked). Returns the live buffers and the reserved bytes."""
    live = [pool.allocate(PAGE, stream=stream)]
    holes = []
    for _ in range(count):
        holes.append(pool.allocate(pages * PAGE, stream=stream))
        live.append(pool.allocate(PAGE, stream=stream))
    small = pool.allocate(512, stream=stream)       # in the last page's free end
    for i, b in enumerate(live):
        b.memset(i + 1)
    sim.launch(0 if stream is None else stream)     # work on the blocks is pending
    del holes
    for _ in range(churn):
        del small
        small = pool.allocate(512, stream=stream)
    live.append(small)
    return live, pool.stats().reserved_bytes


@pytest.mark.parametrize("stream", ["legacy", "created", "in a region"])
def test_growth_moves_the_pages_of_cold_free_blocks_instead_of_adding_new_ones(
        vpool, vsim, stream):
    s = vsim.create_stream() if stream == "created" else None
    live, reserved = pieces(vpool, vsim, s)
    assert vpool.stats().cached_bytes >= 6 * PAGE
    vsim.calls.clear()
    with gpupool.Region(pool=vpool, collect=None) if stream == "in a region" else nullcontext():
        big = vpool.allocate(5 * PAGE, stream=s)    # fits no free block: the segment grows
    # The device synchronized, then the two pieces' pages went, then 5 new pages came at the
    # end: reserved bytes fell by a page instead of growing by 5.
    assert names(vsim, "synchronize", "unmap", "map") == ["synchronize", "unmap", "unmap", "map"]
    stats = check_invariants(vpool)
    assert stats.reserved_bytes == reserved - PAGE == vsim.device_bytes
    assert stats.peak_reserved_bytes == reserved
    assert vsim.mapped(big.ptr, 5 * PAGE)
    for i, b in enumerate(live[:-1]):               # the live blocks' pages stay
        assert vsim.mapped(b.ptr, PAGE) and (b.copy_to_host() == i + 1).all()
    big.memset(9)
    assert (big.copy_to_host() == 9).all()


def test_after_pages_moved_the_pieces_serve_and_a_trim_gives_back_as_before(vpool, vsim):
    # After the pages moved, a request that fits a remaining piece takes it, and a trim
    # still gives every free page back.
    live, reserved = pieces(vpool, vsim)
    big = vpool.allocate(5 * PAGE)
    again = vpool.allocate(3 * PAGE)                # the holes are unmapped: one is mapped
    assert vsim.mapped(again.ptr, 3 * PAGE)
    del big, again
    vpool.trim()
    assert check_invariants(vpool).reserved_bytes == vsim.device_bytes
    assert vpool.stats().reserved_bytes <= (len(live) + 1) * PAGE


def test_a_regions_own_cold_cached_blocks_move_to_its_growth(vpool, vsim):
    # The pieces are cached by the region; a later entry's request that grows the segment
    # takes their pages (they leave the region's cache), as it would the pool's: a region per
    # step then reserves what the pool alone would (bench/fragmentation.py).
    region = gpupool.Region(pool=vpool, collect=None)
    with region:
        live, _ = pieces(vpool, vsim, churn=0)
    for _ in range(COLD_ALLOCS):                    # the churn, outside the region
        vpool.allocate(512)                         # (freed at once)
    reserved = vpool.stats().reserved_bytes
    cached = region.stats().cached_bytes
    assert cached >= 6 * PAGE
    vsim.calls.clear()
    with region:
        big = vpool.allocate(5 * PAGE)
        assert names(vsim, "synchronize", "unmap", "map") == ["synchronize", "unmap", "unmap",
                                                              "map"]
        assert region.stats().cached_bytes == cached - 6 * PAGE
    stats = check_invariants(vpool)
    assert stats.reserved_bytes == reserved - PAGE == vsim.device_bytes
    assert vsim.mapped(big.ptr, 5 * PAGE)
    for i, b in enumerate(live[:3]):                # the live blocks' pages and data stay
        assert vsim.mapped(b.ptr, PAGE) and (b.copy_to_host() == i + 1).all()


@pytest.mark.parametrize("case", ["recent", "too_few", "capturing", "region", "other_stream"])
def test_growth_adds_pages_when_no_cold_free_pages_cover_it(vpool, vsim, case):
    s = vsim.create_stream() if case == "other_stream" else None
    churn = COLD_ALLOCS // 2 if case == "recent" else COLD_ALLOCS
    if case == "region":                            # the pieces are the region's cache
        with gpupool.Region(pool=vpool, collect=None):
            live, reserved = pieces(vpool, vsim, s, churn=0)
        live, reserved = live + pieces(vpool, vsim, s, count=0, churn=churn)[0], \
            vpool.stats().reserved_bytes
    else:
        live, reserved = pieces(vpool, vsim, s, churn=churn)
    request = 7 * PAGE if case == "too_few" else 5 * PAGE
    vsim.calls.clear()
    if case == "capturing":
        vsim.capturing.add(0)                       # the legacy stream's handle
    big = vpool.allocate(request)                   # other_stream: on the legacy stream
    vsim.capturing.clear()
    # Nothing moved: no synchronize (a capture would have been invalidated), no unmap.
    assert names(vsim, "synchronize", "unmap") == []
    assert vpool.stats().peak_reserved_bytes > reserved
    assert vsim.mapped(big.ptr, request)
    if case == "capturing":
        assert ("stream_capturing", (0,)) in vsim.calls
    check_invariants(vpool)


# (5) A segment per stream --------------------------------------------------------------------

def test_each_stream_grows_a_segment_of_its_own(vpool, vsim):
    s1, s2 = vsim.create_stream(), vsim.create_stream()
    x1 = vpool.allocate(PAGE, stream=s1)
    x2 = vpool.allocate(PAGE, stream=s2)
    assert len(vsim.calls_named("reserve")) == 2
    assert abs(x1.ptr - x2.ptr) >= vsim.va_bytes          # two ranges
    y1 = vpool.allocate(2 * PAGE, stream=s1)
    y2 = vpool.allocate(2 * PAGE, stream=s2)
    assert (y1.ptr, y2.ptr) == (x1.ptr + PAGE, x2.ptr + PAGE)   # each at its own end
    assert vsim.calls_named("map")[-2:] == [(x1.ptr + PAGE, 2 * PAGE), (x2.ptr + PAGE, 2 * PAGE)]
    assert len(vsim.calls_named("reserve")) == 2


# (6) Stream order ---------------------------------------------------------------------------

def test_a_block_freed_on_a_busy_stream_reaches_another_only_behind_its_event(vpool, vsim):
    a, b = vsim.create_stream(), vsim.create_stream()
    x = vpool.allocate(4 * PAGE, stream=a)
    wall = vpool.allocate(PAGE, stream=a)           # x is not the free end of a's segment
    ptr = x.ptr
    vsim.launch(a)
    del x
    held = [vpool.allocate(4 * PAGE, stream=b)]     # no event on x yet: b's own segment
    assert not ptr <= held[0].ptr < ptr + 5 * PAGE
    assert vsim.calls_named("event_record") == [] and vsim.calls_named("stream_wait_event") == []
    held.append(vpool.allocate(8 * PAGE, stream=a))     # a allocates (at its end): x's event
    assert [args[1] for args in vsim.calls_named("event_record")] == [a]
    queued = vsim._queued[a]
    y = vpool.allocate(4 * PAGE, stream=b)          # a is still busy: b waits on the GPU
    assert y.ptr == ptr
    assert [args[0] for args in vsim.calls_named("stream_wait_event")] == [b]
    assert vsim.pending(a) and vsim.ordered(b, a, queued)
    assert names(vsim, "synchronize") == []
    del wall



def test_a_stream_that_cuts_its_own_marked_block_keeps_the_event_on_the_rest(vpool, vsim):
    # The GPU test's order: a's free block is its segment's free end, and a's next request
    # is cut from that very block (the one its event was recorded on).
    a, b = vsim.create_stream(), vsim.create_stream()
    small = vpool.allocate(256, stream=a)
    x = vpool.allocate(4 * PAGE, stream=a)
    ptr = x.ptr
    vsim.launch(a)
    del x
    first = vpool.allocate(4 * PAGE, stream=b)      # no event on x yet: b's own segment
    assert not ptr <= first.ptr < ptr + 4 * PAGE
    del small
    kept = vpool.allocate(256, stream=a)            # a allocates: an event marks its work
    assert [args[1] for args in vsim.calls_named("event_record")] == [a]
    y = vpool.allocate(4 * PAGE, stream=b)          # the rest of a's block, behind that event
    assert y.ptr == ptr
    assert [args[0] for args in vsim.calls_named("stream_wait_event")] == [b]
    assert vsim.ordered(b, a, vsim._queued[a])
    del kept, first, y



def test_a_pool_s_end_waits_for_queued_work_before_unmapping(vsim):
    # cuMemUnmap does not wait for the device's work as cuMemFree does: a kernel still
    # running on a freed block would fault on the unmapped pages.
    pool = gpupool.Pool(upstream=vsim)
    s = vsim.create_stream()
    x = pool.allocate(PAGE, stream=s)
    vsim.launch(s)                                  # still running when the pool ends
    del x
    vsim.calls.clear()
    del pool
    gc.collect()
    assert names(vsim, "synchronize", "unmap", "unreserve")[:2] == ["synchronize", "unmap"]
    assert vsim.errors == []


# (7) The out-of-memory ladder -------------------------------------------------------------

def test_out_of_memory_unmaps_free_pages_and_the_retry_maps_elsewhere():
    sim = SimulatedDevice(capacity=16 * PAGE, virtual_memory=True, page=PAGE)
    pool = gpupool.Pool(upstream=sim)
    f1, l1 = pool.allocate(4 * PAGE), pool.allocate(2 * PAGE)
    f2, l2 = pool.allocate(4 * PAGE), pool.allocate(2 * PAGE)
    f3 = pool.allocate(4 * PAGE)
    base = f1.ptr
    assert sim.used == sim.capacity                 # the device is full
    del f1, f2, f3                                  # 12 pages free, no 6 of them in a row
    sim.calls.clear()
    x = pool.allocate(6 * PAGE)
    # Mapping 6 more pages failed; the ladder's trim synchronized, unmapped the free pages
    # (two holes and the segment's end), and the retry mapped 6 pages in a new range.
    assert pool.stats().oom_retries == 1
    calls = names(sim, "synchronize", "map", "unmap")
    assert calls.index("synchronize") < calls.index("unmap")
    assert sorted(sim.calls_named("unmap")) == [(base, 4 * PAGE), (base + 6 * PAGE, 4 * PAGE),
                                                 (base + 12 * PAGE, 4 * PAGE)]
    assert calls[-1] == "map" and sim.calls_named("map")[-1] == (x.ptr, 6 * PAGE)
    assert not base <= x.ptr < base + 16 * PAGE
    assert all(sim.mapped(b.ptr, b.nbytes) for b in (x, l1, l2))
    assert check_invariants(pool).reserved_bytes == sim.used == 10 * PAGE
    x.memset(3)
    assert (x.copy_to_host() == 3).all()
    assert sim.errors == []


def test_out_of_memory_after_the_ladder_when_the_live_bytes_leave_no_room():
    sim = SimulatedDevice(capacity=16 * PAGE, virtual_memory=True, page=PAGE)
    pool = gpupool.Pool(upstream=sim)
    keep = [pool.allocate(4 * PAGE), pool.allocate(8 * PAGE)]
    pool.allocate(4 * PAGE).close()
    with pytest.raises(gpupool.OutOfMemoryError):
        pool.allocate(5 * PAGE)                     # 12 pages live: 4 free at the most
    assert pool.stats().reserved_bytes == sim.used == 12 * PAGE     # the free end unmapped
    assert [sim.mapped(b.ptr, b.nbytes) for b in keep] == [True, True]
    assert sim.errors == []


# (8) Choosing the upstream from the environment ---------------------------------------------

def test_a_bad_gpupool_upstream_raises_naming_the_variable(monkeypatch):
    monkeypatch.setenv("GPUPOOL_UPSTREAM", "bogus")
    with pytest.raises(ValueError, match="GPUPOOL_UPSTREAM='bogus'") as info:
        gpupool.Pool(upstream=None)
    assert all(name in str(info.value) for name in ("driver", "async", "vmm"))
    with pytest.raises(ValueError, match="GPUPOOL_UPSTREAM"):
        gpupool.Pool()                              # upstream=None is the default
    sim = SimulatedDevice(capacity=MIB, virtual_memory=True, page=PAGE)
    assert gpupool.Pool(upstream=sim).allocate(10).nbytes == 10     # an explicit one wins


def test_an_empty_gpupool_upstream_is_unset(monkeypatch):
    monkeypatch.setenv("GPUPOOL_UPSTREAM", "")
    try:
        pool = gpupool.Pool()                   # the default upstream, as without the variable
    except gpupool.NoDeviceError:
        return                                  # no driver here: not the ValueError of a name
    assert isinstance(pool.upstream, (gpupool.VmmUpstream, gpupool.DriverUpstream))


# Random operations ---------------------------------------------------------------------------

class VmmPoolMachine(PoolMachine):
    """The state machine of test_state_machine.py over expandable segments, on the legacy
    stream only (its three "streams" are one); also every live buffer's pages stay mapped
    and the reserved bytes are the mapped ones."""

    def __init__(self):
        RuleBasedStateMachine.__init__(self)
        self.sim = SimulatedDevice(capacity=128 * MIB, virtual_memory=True, page=PAGE)
        self.pool = gpupool.Pool(upstream=self.sim)
        self.region = gpupool.Region(pool=self.pool)
        self.streams = self.machine_streams()
        self.live = []
        self.freed = []
        self.max_in_use = 0

    def machine_streams(self):
        return [0, 0, 0]

    @invariant()
    def live_buffers_are_mapped(self):
        for buf, _ in self.live:
            assert self.sim.mapped(buf.ptr, buf.nbytes), f"live buffer {buf!r} unmapped"
        assert self.pool.stats().reserved_bytes == self.sim.device_bytes


class VmmStreamsPoolMachine(VmmPoolMachine):
    """The same over three streams, and no misuse of the simulated device (no unmap while a
    stream has work pending)."""

    def machine_streams(self):
        return [0] + [self.sim.create_stream() for _ in range(2)]

    @invariant()
    def no_misuse(self):
        assert self.sim.errors == []


VmmPoolMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40,
                                            deadline=None)
VmmStreamsPoolMachine.TestCase.settings = VmmPoolMachine.TestCase.settings
TestVmmPoolOnOneStream = VmmPoolMachine.TestCase
TestVmmPoolOnThreeStreams = VmmStreamsPoolMachine.TestCase


# Regressions: core bugs found by these tests, each a minimal reproduction -------------------

def test_trim_unmaps_a_free_page_of_a_reservation_aligned_to_the_host_page_only():
    big = 64 * KIB
    held, spacers = [], []
    for _ in range(64):
        sim = SimulatedDevice(capacity=4 * big, virtual_memory=True, page=big)
        pool = gpupool.Pool(upstream=sim)
        buf = pool.allocate(big)
        base = buf.ptr
        del buf
        if base % big:
            break
        held.append(pool)           # keeps its range, and a host page next to it shifts the
        spacers.append(mmap.mmap(-1, mmap.PAGESIZE))        # next reservation off alignment
    else:
        pytest.skip("every reservation happened to be aligned to 64 KiB")
    assert pool.trim() == big                       # 0: no whole page found in the block
    assert sim.calls_named("unmap") == [(base, big)] and sim.errors == []


def test_growth_behind_a_free_end_bound_to_another_stream_succeeds():
    vsim, vpool = vmm()
    a, b = vsim.create_stream(), vsim.create_stream()
    x = vpool.allocate(4 * PAGE, stream=a)
    y = vpool.allocate(4 * PAGE, stream=a)
    y.stream = b
    del y                                   # free on b, at the end of a's segment
    z = vpool.allocate(6 * PAGE, stream=a)  # OutOfMemoryError, 64 MiB free
    assert z.nbytes == 6 * PAGE
    del x


def test_the_legacy_stream_allocates_after_another_stream_took_its_free_end():
    vsim, vpool = vmm()
    s = vsim.create_stream()
    vpool.allocate(1).close()           # a page; its free rest on the legacy stream
    x = vpool.allocate(1, stream=s)     # s takes it (the legacy stream's event is recorded at
    y = vpool.allocate(1)               # once); its rest is now on s: ValueError, map of 0 B
    assert y.nbytes == 1 and vsim.errors == []
    del x


def test_a_hole_next_to_a_block_free_on_another_stream_is_mapped_for_the_request():
    vsim, vpool = vmm()
    a, b = vsim.create_stream(), vsim.create_stream()
    x = vpool.allocate(4 * PAGE, stream=a)
    h = vpool.allocate(4 * PAGE, stream=a)
    w = vpool.allocate(PAGE, stream=a)
    del h
    assert vpool.trim() == 4 * PAGE         # a hole between x and w
    w.stream = b
    del w                                   # free on b, next to the hole
    z = vpool.allocate(4 * PAGE, stream=a)  # OutOfMemoryError
    assert z.ptr == x.ptr + 4 * PAGE
    del x


def test_a_trim_after_merge_streams_does_not_unmap_while_a_stream_is_busy():
    vsim, vpool = vmm()
    keep = vpool.allocate(PAGE)
    vpool.allocate(2 * PAGE).close()
    vpool.merge_streams()                   # the free pages: free for any stream, unbound
    vsim.launch(0)                          # work on keep
    assert vpool.trim() == 2 * PAGE         # 0: the unmap was refused as a misuse
    assert vsim.errors == []
    del keep


def test_requests_larger_than_the_device_leave_no_reservations_behind():
    sim = SimulatedDevice(capacity=16 * PAGE, virtual_memory=True, page=PAGE)
    pool = gpupool.Pool(upstream=sim)
    for _ in range(3):
        with pytest.raises(gpupool.OutOfMemoryError):
            pool.allocate(17 * PAGE)
    pool.trim()
    assert len(sim.calls_named("reserve")) == len(sim.calls_named("unreserve"))


def test_a_regions_free_end_grows_with_its_bytes_counted():
    sim, pool = vmm()
    region = gpupool.Region(pool=pool)
    with region:
        a = pool.allocate(6 * PAGE)
        del a                               # the region's free end of the segment
        b = pool.allocate(10 * PAGE)        # maps 4 pages more, joined with it
        assert region.stats().cached_bytes == 0
        del b
    assert region.stats().cached_bytes == pool.stats().cached_bytes == 10 * PAGE
    region.release()
    assert region.stats().cached_bytes == 0
    check_invariants(pool)


def test_an_ignored_upstream_error_does_not_keep_the_callers_buffers_alive():
    vsim, vpool = vmm()
    a = vsim.create_stream()
    x = vpool.allocate(PAGE, stream=a)
    del x                                   # free on a, no event yet
    vpool.allocate(PAGE)                    # the legacy stream wants it: a is asked for one

    def failing_record(event, stream):
        raise RuntimeError("simulated cuEventRecord failure")

    vsim._event_record = failing_record

    def step():
        buf = vpool.allocate(PAGE, stream=a)    # a allocates: its event cannot be recorded
        return buf.nbytes

    assert step() == PAGE                   # the pool falls back (no event: no hand-off)
    del vsim._event_record
    gc.collect()
    # Kept, the exception's traceback would hold step's frame, and its buffer, alive.
    assert vpool.stats().in_use_bytes == 0


class FailingUnmap(SimulatedDevice):
    """A device whose unmaps fail (a driver error): a trim keeps the pages and goes on."""

    def _unmap(self, va, nbytes):
        raise RuntimeError("simulated driver failure")


def test_a_refused_unmap_in_a_trim_does_not_keep_the_callers_buffers_alive():
    sim = FailingUnmap(capacity=64 * MIB, virtual_memory=True, page=PAGE)
    pool = gpupool.Pool(upstream=sim)
    pool.allocate(4 * PAGE).close()

    def step():
        buf = pool.allocate(2 * PAGE)   # cut from the free pages: 2 of them stay free
        assert pool.trim() == 0         # the unmap failed: nothing given back, no error
        return buf.nbytes

    assert step() == 2 * PAGE           # buf is dead once step returns
    gc.collect()
    # Kept, the failed unmap's traceback would hold step's frame, and its buffer, alive.
    assert pool.stats().in_use_bytes == 0
    check_invariants(pool)


def test_pages_of_a_range_not_aligned_to_the_page_size_are_found():
    page = 3 * 512 * KIB                    # not a divisor of the host's mmap alignment
    sim = SimulatedDevice(capacity=64 * MIB, virtual_memory=True, page=page)
    pool = gpupool.Pool(upstream=sim)
    buf = pool.allocate(2 * page)
    buf.copy_from_host(np.ones(2 * page, np.uint8))
    assert sim.mapped(buf.ptr, buf.nbytes) and (buf.copy_to_host() == 1).all()
    assert sim.errors == []


# On a real device (marked gpu): gpupool.VmmUpstream (upstream "vmm") over the driver's
# virtual memory API.

@pytest.fixture
def gpu_pool():
    gpu_pool = gpupool.Pool(device=0, upstream="vmm")
    yield gpu_pool
    gpu_pool.trim()


def device_used(gpu_pool):
    free, total = gpu_pool.mem_info()
    return total - free


@pytest.mark.gpu
def test_the_upstream_maps_pages_of_its_granularity(gpu_pool):
    upstream = gpu_pool.upstream
    assert isinstance(upstream, gpupool.VmmUpstream) and upstream.expandable
    assert upstream.granularity >= 64 << 10 and upstream.granularity % 512 == 0
    assert upstream.va_bytes >= gpu_pool.mem_info()[1]
    buf = gpu_pool.allocate(3 * MIB + 17)
    pages = -(-(3 * MIB + 17) // upstream.granularity)
    assert upstream.mapped_bytes == gpu_pool.stats().reserved_bytes == pages * upstream.granularity
    del buf


@pytest.mark.gpu
def test_memory_of_every_size_holds_data_across_pages(gpu_pool):
    rng = np.random.default_rng(0)
    kept = []
    for nbytes in (1, 256, 4097, 300_000, 3 * MIB + 5, 64 * MIB, 256 * MIB + 4096):
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        buf = gpu_pool.allocate(nbytes)
        assert buf.ptr % 256 == 0
        buf.copy_from_host(data)
        kept.append((buf, data))
    for buf, data in kept:
        assert np.array_equal(buf.copy_to_host(), data)
    big = gpu_pool.allocate(kept[-1][0].nbytes)
    big.copy_from_host(kept[-1][0])                 # device to device, across pages
    assert np.array_equal(big.copy_to_host(), kept[-1][1])


@pytest.mark.gpu
def test_growth_joins_the_free_end_of_the_segment(gpu_pool):
    a = gpu_pool.allocate(64 * MIB)
    start = a.ptr
    del a                                           # the free end of the segment
    b = gpu_pool.allocate(96 * MIB)                 # maps only the 32 MiB more it needs
    assert b.ptr == start and gpu_pool.stats().reserved_bytes == 96 * MIB
    b.memset(3)
    assert (b.copy_to_host()[::MIB] == 3).all()


@pytest.mark.gpu
def test_trim_gives_whole_free_pages_back_to_the_device(gpu_pool):
    before = device_used(gpu_pool)
    keep = gpu_pool.allocate(8 * MIB)
    keep.memset(5)
    temp = gpu_pool.allocate(512 * MIB)
    temp.memset(9)
    assert device_used(gpu_pool) - before >= 520 * MIB
    del temp
    released = gpu_pool.trim()                      # synchronizes: the memset is done
    assert released >= 512 * MIB
    assert device_used(gpu_pool) - before < 64 * MIB
    assert (keep.copy_to_host() == 5).all()         # a live block's pages stay mapped
    again = gpu_pool.allocate(512 * MIB)            # maps pages again
    again.memset(1)
    assert (again.copy_to_host()[::MIB] == 1).all()


@pytest.mark.gpu
def test_growth_moves_cold_free_pages_and_the_live_pages_keep_their_data(gpu_pool):
    g = gpu_pool.upstream.granularity
    live = [gpu_pool.allocate(g)]
    holes = []
    for _ in range(2):                              # two free pieces of 3 pages between
        holes.append(gpu_pool.allocate(3 * g))      # live pages: 6 free pages, no 5 in one
        live.append(gpu_pool.allocate(g))
    small = gpu_pool.allocate(512)
    for i, buf in enumerate(live):
        buf.memset(i + 1)
    del holes
    for _ in range(200):                            # allocations that leave them cold
        del small
        small = gpu_pool.allocate(512)
    reserved, used = gpu_pool.stats().reserved_bytes, device_used(gpu_pool)
    big = gpu_pool.allocate(5 * g)                  # the 6 pages move: one fewer mapped
    assert gpu_pool.stats().reserved_bytes == reserved - g
    assert gpu_pool.stats().peak_reserved_bytes == reserved
    assert device_used(gpu_pool) <= used
    big.memset(9)
    assert (big.copy_to_host()[::4096] == 9).all()
    for i, buf in enumerate(live):
        assert (buf.copy_to_host() == i + 1).all()
    del small


@pytest.mark.gpu
def test_a_block_freed_on_a_busy_stream_reaches_another_only_behind_its_work(gpu_pool):
    cupy = pytest.importorskip("cupy")
    slow = cupy.RawKernel(r"""
    extern "C" __global__ void slow_fill(unsigned char* p, long long n, long long spins) {
        long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
        for (long long k = 0; k < spins; ++k) __nanosleep(100);
        for (; i < n; i += (long long)gridDim.x * blockDim.x) p[i] = 42;
    }""", "slow_fill")
    a = cupy.cuda.Stream(non_blocking=True)
    b = cupy.cuda.Stream(non_blocking=True)
    n = 8 * MIB
    small = gpu_pool.allocate(256, stream=a.ptr)
    buf = gpu_pool.allocate(n, stream=a.ptr)
    ptr = buf.ptr
    with a:
        slow((64,), (256,), (cupy.uint64(ptr), cupy.int64(n), cupy.int64(20_000)))
    del buf                                         # the kernel still writes it on a
    first = gpu_pool.allocate(n, stream=b.ptr)      # a's block has no event yet: another
    assert first.ptr != ptr
    del small
    kept = gpu_pool.allocate(256, stream=a.ptr)     # a allocates: an event marks its work
    second = gpu_pool.allocate(n, stream=b.ptr)     # a's block, behind a GPU-side wait
    assert second.ptr == ptr
    second.memset(7, stream=b.ptr)                  # ordered after the kernel's 42s
    assert (second.copy_to_host(stream=b.ptr) == 7).all()
    a.synchronize()
    del kept


@pytest.mark.gpu
def test_cupy_and_torch_read_vmm_memory(gpu_pool):
    cupy = pytest.importorskip("cupy")
    buf = gpu_pool.allocate(4 * MIB)
    view = cupy.from_dlpack(buf.view("float32", (1 << 20,)))
    view[:] = cupy.arange(1 << 20, dtype=cupy.float32)
    assert float(view.sum()) == float(np.arange(1 << 20, dtype=np.float64).sum())
    torch = pytest.importorskip("torch")
    tensor = torch.from_dlpack(buf.view("float32", (1 << 20,)))
    assert tensor.device.type == "cuda" and int(tensor[12345]) == 12345
