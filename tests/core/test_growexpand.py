"""Growth of expandable segments (core/growexpand.pxd) on the simulated device, and on a real
device (marked gpu): growth at the free end of the stream's segment, exact growth, holes mapped
again, cold free pages moved to the growth, a segment per stream (vmm_sim.py has the device).
"""

from contextlib import nullcontext

import pytest
from conftest import check_invariants
from vmm_sim import KIB, MIB, PAGE, device_used, names
from vmm_sim import gpu_pool, vpool, vsim  # noqa: F401 (fixtures)

import gpupool


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


def test_growth_for_another_thread_joins_no_entered_region_s_free_block(vpool, vsim):
    # The segment's free end is cached by a region entered on this thread; another thread's
    # request grows the pool: its new pages stay the pool's, where joining the region's block
    # would make them the region's, which the request then cannot take (an entered region
    # lends nothing), and the pool would run out of memory (sg_put_for: a hole mapped again
    # joins its neighbours the same way).
    import threading

    region = gpupool.Region(pool=vpool, collect=None)
    with region:
        a = vpool.allocate(PAGE)
        del a                           # cached by the region: the segment's free end
    got = []
    with region:
        thread = threading.Thread(target=lambda: got.append(vpool.allocate(PAGE).ptr))
        thread.start()
        thread.join()
    assert len(got) == 1
    assert check_invariants(vpool).reserved_bytes == 2 * PAGE


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
