"""Private pools (region/privatepool.pxd) through the C API's private_* functions, on the simulated
device: memory a private pool allocated stays its own once freed (no other request gets it;
trims, the out-of-memory ladder and regions leave it), its layout can be restored block by
block (private_allocate_at), and its end gives it back to the pool."""

import ctypes

import pytest
from capi_table import allocate, call, private_allocate, private_live, private_new, stats

import gpupool
from gpupool.testing import SimulatedDevice

MiB = 1 << 20
INVALID = 1
OOM = 2

pytestmark = pytest.mark.usefixtures("default_pools")


@pytest.fixture
def sim():
    device = SimulatedDevice(capacity=64 * MiB)
    yield device
    assert device.errors == []


@pytest.fixture
def pool(sim):
    pool = gpupool.Pool(upstream=sim, device=0)
    gpupool.set_pool(pool)
    return pool


def test_freed_memory_stays_the_private_pool_s(pool):
    handle = private_new()
    ptrs = [private_allocate(handle, n)[1] for n in (1000, 4096, 70_000)]
    assert private_live(handle) == sorted(zip(ptrs, (1024, 4096, 70_144), strict=True))
    for ptr in ptrs:
        assert call("free_ptr", 0, ptr) == 0
    assert private_live(handle) == []
    assert pool.stats().in_use_bytes == 0
    pool.trim()                                         # keeps the private pool's blocks
    assert pool.stats().reserved_bytes == 2 * MiB
    other = allocate(1000)                              # the pool's: not the private memory
    assert other not in ptrs
    assert other >= ptrs[0] + 75_264                    # the rest of the segment, after it
    again = [private_allocate(handle, n)[1] for n in (1000, 4096, 70_000)]
    assert again == ptrs                                # the same requests, the same blocks
    for ptr in again + [other]:
        call("free_ptr", 0, ptr)
    assert call("private_destroy", handle) == 0
    assert pool._verify() == []
    pool.trim()
    assert pool.stats().reserved_bytes == 0


def test_the_ladder_and_regions_leave_a_private_pool_s_memory(sim):
    pool = gpupool.Pool(upstream=sim, device=0, hard_limit=4 * MiB)
    gpupool.set_pool(pool)
    handle = private_new()
    status, held = private_allocate(handle, 3 * MiB)
    assert status == 0
    call("free_ptr", 0, held)                           # cached by the private pool
    region = gpupool.Region(pool=pool)
    with region:
        buf = pool.allocate(MiB)                        # beside it, within the limit
    del buf
    region.release()
    with pytest.raises(gpupool.OutOfMemoryError):       # the ladder does not take it
        pool.allocate(2 * MiB)
    assert private_allocate(handle, 3 * MiB) == (0, held)
    call("free_ptr", 0, held)
    call("private_destroy", handle)
    pool.allocate(2 * MiB)                              # the pool's again


def test_growth_on_expandable_segments_leaves_a_private_pool_s_free_pages_mapped():
    # A captured graph reads a private pool's memory: its free blocks never give their pages
    # to growth, however long unused (the pool's and a region's own cold blocks do).
    page = 64 * 1024
    sim = SimulatedDevice(capacity=64 * MiB, virtual_memory=True, page=page)
    pool = gpupool.Pool(upstream=sim, device=0)
    gpupool.set_pool(pool)
    handle = private_new()
    pieces, walls = [], []
    for _ in range(2):                                  # two 3-page pieces between live pages
        pieces.append(private_allocate(handle, 3 * page)[1])
        walls.append(private_allocate(handle, page)[1])
    for ptr in pieces:
        call("free_ptr", 0, ptr)
    for _ in range(200):                                # pieces untouched: cold by age
        call("free_ptr", 0, allocate(512))
    sim.calls.clear()
    status, big = private_allocate(handle, 5 * page)
    assert status == 0 and big not in pieces
    assert [name for name, _ in sim.calls if name in ("synchronize", "unmap")] == []
    assert all(sim.mapped(ptr, 3 * page) for ptr in pieces)
    for ptr in walls + [big]:
        call("free_ptr", 0, ptr)
    call("private_destroy", handle)
    assert pool._verify() == [] and sim.errors == []


def test_a_private_allocation_ignores_the_thread_s_region(pool):
    handle = private_new()
    region = gpupool.Region(pool=pool)
    with region:
        status, ptr = private_allocate(handle, 5000)
    assert status == 0 and region.stats().cache_misses == 0
    assert private_live(handle) == [(ptr, 5120)]
    call("free_ptr", 0, ptr)
    with region:
        buf = pool.allocate(5000)                       # the region's request: not ptr
    assert buf.ptr != ptr
    call("private_destroy", handle)


def test_a_checkpointed_layout_is_allocated_again(pool):
    handle = private_new()
    a, b, c = (private_allocate(handle, n)[1] for n in (4096, 8192, 16384))
    for ptr in (a, b, c):
        call("free_ptr", 0, ptr)
    # Freed, the three joined into one free block; b is taken out of its middle.
    assert call("private_allocate_at", handle, b, 8192, 0) == 0
    assert private_live(handle) == [(b, 8192)]
    assert call("private_allocate_at", handle, b, 8192, 0) == INVALID      # live now
    assert call("private_allocate_at", handle, b + 8192, 1000, 0) == INVALID   # not 512s
    assert call("private_allocate_at", handle, pool.allocate(512).ptr, 512, 0) == INVALID
    assert call("private_allocate_at", handle, a, 4096, 0) == 0
    assert call("private_allocate_at", handle, c, 16384, 0) == 0
    assert private_live(handle) == [(a, 4096), (b, 8192), (c, 16384)]
    assert pool.stats().in_use_bytes == 4096 + 8192 + 16384
    assert stats()["num_allocs"] == pool.stats().num_allocs
    for ptr in (a, b, c):
        assert call("free_ptr", 0, ptr) == 0            # handed out through the C API
    assert private_allocate(handle, 28672)[1] == a      # joined again
    call("free_ptr", 0, a)
    call("private_destroy", handle)
    assert pool._verify() == []


def test_live_blocks_return_to_the_pool_after_the_end(pool):
    handle = private_new()
    status, ptr = private_allocate(handle, 1 << 16)
    call("private_destroy", handle)
    assert pool._verify() == []                         # no block is tagged any more
    call("free_ptr", 0, ptr)
    assert pool.allocate(1 << 16).ptr == ptr            # the pool's now


def test_bad_arguments_are_codes(pool):
    handle = private_new()
    assert private_allocate(handle, 0) == (INVALID, None)
    assert private_allocate(None, 10) == (INVALID, None)
    assert call("private_destroy", None) == INVALID
    assert call("private_new", 0, None) == INVALID
    count = ctypes.c_size_t()
    assert call("private_live", handle, None, None, 4, ctypes.byref(count)) == INVALID
    assert call("private_allocate_at", handle, 4096, 0, 0) == INVALID
    small = gpupool.Pool(upstream=SimulatedDevice(capacity=MiB), device=0)
    gpupool.set_pool(small)
    other = private_new()
    assert private_allocate(other, 2 * MiB)[0] == OOM
    call("private_destroy", other)
    call("private_destroy", handle)


def test_a_snapshot_shows_a_private_pool_s_blocks(pool):
    # Private pools are not registered regions: the snapshot names their blocks (it raised
    # KeyError on a cached one).
    from gpupool.snapshot import memory_snapshot

    handle = private_new()
    _, cached = private_allocate(handle, 4096)
    _, live = private_allocate(handle, 8192)
    call("free_ptr", 0, cached)                         # cached by the private pool
    snap = memory_snapshot(pool)
    blocks = {b["address"]: b for s in snap["segments"] for b in s["blocks"]}
    assert blocks[cached]["state"] == "inactive" and blocks[cached]["region"] is None
    assert blocks[cached]["frames"][0]["name"] == "cached by a private pool"
    assert blocks[live]["state"] == "active_allocated"
    assert [r for r in snap["regions"] if r["id"] is None] == [
        {"id": None, "name": "a private pool", "device": 0, "segment_pool_id": (0, 0),
         "cached_bytes": 4096, "live_bytes": 8192}]
    call("free_ptr", 0, live)
    assert call("private_destroy", handle) == 0
