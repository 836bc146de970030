"""Large blocks are cut from larger cached blocks and from segments, and freed pieces join.

On the simulated device: which upstream allocations are made, the addresses handed out,
the pool's cached blocks (``Pool.cached_blocks``), and that a piece cut from a block another
stream used reaches the new stream only behind that stream's work. A segment is at most an
eighth of what the pool reserves, so the tests that expect 20 MiB segments first reserve a
160 MiB block (``packed``).
"""

import pytest
from conftest import check_invariants

import gpupool

MIB = 1 << 20
SEGMENT = 20 * MIB
BALLAST = 8 * SEGMENT


@pytest.fixture
def packed(pool, sim):
    """A pool that already reserves 160 MiB (one live block), so segments are 20 MiB."""
    ballast = pool.allocate(BALLAST)
    sim.calls.clear()
    yield pool
    del ballast


def test_a_small_pool_gives_mid_sized_blocks_their_own_allocations(pool, sim):
    a = pool.allocate(4 * MIB)
    assert sim.calls_named("alloc") == [(4 * MIB,)] and pool.cached_blocks() == []
    b = pool.allocate(60 * MIB)                     # above 10 MiB: its own
    c = pool.allocate(4 * MIB)                      # 64 MiB reserved: an 8 MiB segment
    assert sim.calls_named("alloc")[-1] == (8 * MIB,)
    assert pool.cached_blocks() == [(c.ptr + 4 * MIB, 4 * MIB, True)]
    del a, b, c


def test_mid_sized_blocks_are_cut_from_one_segment(packed, sim):
    pool = packed
    a = pool.allocate(4 * MIB)
    b = pool.allocate(4 * MIB)
    assert sim.calls_named("alloc") == [(SEGMENT,)]
    assert b.ptr == a.ptr + 4 * MIB
    assert pool.cached_blocks() == [(a.ptr + 8 * MIB, 12 * MIB, True)]
    check_invariants(pool)


def test_freed_pieces_join_and_a_trim_returns_the_whole_segment(packed, sim):
    pool = packed
    a = pool.allocate(4 * MIB)
    b = pool.allocate(6 * MIB)
    base = a.ptr
    del a                                   # b still separates it from the rest
    assert len(pool.cached_blocks()) == 2
    del b
    assert pool.cached_blocks() == [(base, SEGMENT, False)]
    assert pool.trim() == SEGMENT
    assert sim.calls_named("free") == [(base,)]
    assert pool.stats().reserved_bytes == BALLAST


def test_a_live_piece_keeps_its_segment_through_a_trim(packed):
    pool = packed
    a = pool.allocate(4 * MIB)
    b = pool.allocate(4 * MIB)
    del b
    assert pool.trim() == 0
    assert pool.cached_blocks() == [(a.ptr + 4 * MIB, 16 * MIB, True)]
    assert pool.stats().reserved_bytes == BALLAST + SEGMENT
    check_invariants(pool)


def test_a_cached_large_block_is_cut_for_smaller_requests(pool, sim):
    x = pool.allocate(64 * MIB)
    base = x.ptr
    del x
    y = pool.allocate(16 * MIB)
    z = pool.allocate(40 * MIB)
    assert (y.ptr, z.ptr) == (base, base + 16 * MIB)
    assert sim.calls_named("alloc") == [(64 * MIB,)]
    assert pool.cached_blocks() == [(base + 56 * MIB, 8 * MIB, True)]
    del y, z
    assert pool.cached_blocks() == [(base, 64 * MIB, False)]
    check_invariants(pool)


def test_pieces_freed_on_two_busy_streams_join_at_a_trim(pool, sim):
    a, b = sim.create_stream(), sim.create_stream()
    x = pool.allocate(64 * MIB, stream=a)
    base = x.ptr
    del x
    y = pool.allocate(16 * MIB, stream=a)
    z = pool.allocate(48 * MIB, stream=a)
    z.stream = b
    sim.launch(a)
    sim.launch(b)
    del y, z                                # one stream each: they stay apart
    assert [size for _, size, _ in pool.cached_blocks()] == [16 * MIB, 48 * MIB]
    assert pool.trim() == 64 * MIB          # synchronizes, joins, gives the block back
    assert sim.calls_named("free") == [(base,)]


def warm(pool, *streams):
    """A small block cached on each stream (its own 2 MiB page), so that the 10-byte
    requests that make a stream allocate again are served there, not cut from the blocks
    under test (best fit: the page is the smallest free block that fits)."""
    for stream in streams:
        pool.allocate(10, stream=stream)


def test_a_piece_of_another_streams_block_waits_for_that_streams_work(pool, sim):
    a, b, c = sim.create_stream(), sim.create_stream(), sim.create_stream()
    warm(pool, a, b)
    x = pool.allocate(64 * MIB, stream=a)
    base = x.ptr
    sim.launch(a)                           # a kernel still writing x
    queued = sim._queued[a]
    del x
    held = [pool.allocate(16 * MIB, stream=b)]     # asks a for an event; a block of its own
    pool.allocate(10, stream=a)                    # a records it
    y = pool.allocate(16 * MIB, stream=b)          # cut from x, behind a GPU-side wait
    assert y.ptr == base and sim.ordered(b, a, queued)
    held.append(pool.allocate(16 * MIB, stream=c))  # the rest is b's now: asks b
    pool.allocate(10, stream=b)
    z = pool.allocate(16 * MIB, stream=c)          # behind b's event, which covers a's kernel
    assert z.ptr == base + 16 * MIB and sim.ordered(c, a, queued)
    check_invariants(pool)


def test_a_regions_freed_pieces_join_the_pools_and_release_hands_them_over(packed, sim):
    pool = packed
    region = gpupool.Region(pool=pool)
    with region:
        a = pool.allocate(4 * MIB)          # cut from a new shared segment, as outside
        base = a.ptr
        del a                               # joins the segment's rest: the region's now
    assert sim.calls_named("alloc") == [(SEGMENT,)]
    assert pool.cached_blocks() == [] and region.stats().cached_bytes == SEGMENT
    with region:
        pieces = [pool.allocate(4 * MIB) for _ in range(2)]     # the same addresses
        assert [p.ptr for p in pieces] == [base, base + 4 * MIB]
        del pieces
    region.release()
    assert pool.cached_blocks() == [(base, SEGMENT, False)]
    assert region.stats().cached_bytes == 0
    check_invariants(pool)


def test_no_room_for_a_segment_gives_a_block_of_its_own(sim):
    pool = gpupool.Pool(upstream=type(sim)(capacity=BALLAST + 8 * MIB))
    ballast = pool.allocate(BALLAST)
    a = pool.allocate(4 * MIB)              # a 20 MiB segment does not fit
    assert pool.stats().reserved_bytes == BALLAST + 4 * MIB
    assert pool.cached_blocks() == []
    del a, ballast


def test_a_segment_on_a_stream_ordered_upstream_reaches_another_stream_behind_its_allocation():
    sim = gpupool.testing.SimulatedDevice(stream_ordered=True)
    pool = gpupool.Pool(upstream=sim)
    a, b = sim.create_stream(), sim.create_stream()
    warm(pool, a)
    ballast = pool.allocate(BALLAST, stream=a)
    x = pool.allocate(4 * MIB, stream=a)    # a 20 MiB segment, allocated in a's order
    base, (stream, work) = x.ptr, sim.allocated_on[x.ptr]
    assert (base, stream) == (x.ptr, a)
    held = pool.allocate(12 * MIB, stream=b)       # asks a for an event; a block of its own
    pool.allocate(10, stream=a)                    # a records it
    y = pool.allocate(4 * MIB, stream=b)           # cut from a's segment
    assert y.ptr == base + 4 * MIB
    assert sim.ordered(b, a, work)
    del held, ballast
