"""Chunks and the kept page-locked memory of sleep and wake (Note [Sleep and wake] in
docs/design.md), on the simulated device with virtual memory: a tagged segment's growth and
its wake map one physical allocation (a chunk) each, so sleeping and waking 10 GiB takes a
constant number of upstream calls; untagged growth maps a page a chunk; an unmap never cuts a
chunk (the device refuses, ``_verify`` checks it); the page-locked chunk of an offload is kept
after wake for the next sleep until ``Pool.release_pinned`` or the pool's end."""

import gc

import numpy as np
import pytest
from conftest import check_invariants
from vmm_sim import PAGE, names
from vmm_sim import vpool, vsim  # noqa: F401 (fixtures)

import gpupool
from gpupool.testing import SimulatedDevice

GIB = 1 << 30


def test_tagged_growth_maps_one_chunk_untagged_a_page_each(vpool, vsim):
    plain = vpool.allocate(3 * PAGE)
    with gpupool.tag("weights"):
        w = vpool.allocate(3 * PAGE)
        w2 = vpool.allocate(2 * PAGE)
    assert names(vsim, "map", "map_chunk") == ["map", "map_chunk", "map_chunk"]
    assert vsim._chunks(plain.ptr, 3 * PAGE) == [(plain.ptr + i * PAGE, PAGE) for i in range(3)]
    assert vsim._chunks(w.ptr, 5 * PAGE) == [(w.ptr, 3 * PAGE), (w2.ptr, 2 * PAGE)]
    vpool.sleep("weights")
    vpool.wake("weights")
    assert vsim._chunks(w.ptr, 5 * PAGE) == [(w.ptr, 5 * PAGE)]      # one chunk at wake
    check_invariants(vpool)


def test_ten_gib_sleep_and_wake_take_a_constant_number_of_calls():
    """10 GiB of 2 MiB pages (5,120) in ten tagged buffers: the first sleep gives back one
    chunk a growth, every wake maps one, and a steady cycle unmaps and maps one."""
    sim = SimulatedDevice(capacity=12 * GIB, virtual_memory=True, page=2 << 20)
    pool = gpupool.Pool(upstream=sim)
    with gpupool.tag("kv"):
        bufs = [pool.allocate(GIB) for _ in range(10)]
    assert sim.chunks_made == 10
    sim.calls.clear()
    pool.sleep("kv")
    assert names(sim, "map", "map_chunk", "unmap") == ["unmap"]
    assert sim.chunks_released == 10 and sim.device_bytes == 0
    for _ in range(3):
        sim.calls.clear()
        made, released = sim.chunks_made, sim.chunks_released
        pool.wake("kv")
        pool.sleep("kv")
        assert names(sim, "map", "map_chunk", "unmap") == ["map_chunk", "unmap"]
        assert (sim.chunks_made - made, sim.chunks_released - released) == (1, 1)
    pool.wake("kv")
    assert sim._chunks(bufs[0].ptr, 10 * GIB) == [(bufs[0].ptr, 10 * GIB)]
    assert pool.stats().in_use_bytes == 10 * GIB
    check_invariants(pool)
    del bufs, pool
    gc.collect()
    assert sim.errors == [] and sim.device_bytes == 0


def test_the_device_refuses_an_unmap_of_part_of_a_chunk():
    sim = SimulatedDevice(capacity=1 << 24, virtual_memory=True, page=PAGE)
    va = sim._reserve()
    sim._map_chunk(va, 3 * PAGE)
    with pytest.raises(ValueError, match="part of a chunk"):
        sim._unmap(va, PAGE)
    with pytest.raises(ValueError, match="part of a chunk"):
        sim._unmap(va + PAGE, 2 * PAGE)
    assert sim._chunks(va, 3 * PAGE) == [(va, 3 * PAGE)]               # nothing unmapped
    sim.errors.clear()
    sim._unmap(va, 3 * PAGE)
    sim._unreserve(va)
    assert sim.errors == [] and sim.chunks_released == 1


def test_verify_reports_chunks_that_cross_a_run_or_untagged_chunks_of_many_pages(
        vpool, vsim, monkeypatch):
    plain = vpool.allocate(2 * PAGE)
    with gpupool.tag("weights"):
        w = vpool.allocate(3 * PAGE)
    assert vpool._verify() == []
    real = vsim._chunks

    def merged(va, nbytes):             # the untagged pages as one chunk
        return [(plain.ptr, 2 * PAGE)] if va == plain.ptr else real(va, nbytes)
    monkeypatch.setattr(vsim, "_chunks", merged, raising=False)
    assert any("chunk of" in p for p in vpool._verify())

    def short(va, nbytes):              # the tag's run mapped only in part
        return [(w.ptr, PAGE)] if va == w.ptr else real(va, nbytes)
    monkeypatch.setattr(vsim, "_chunks", short, raising=False)
    assert any("is mapped to" in p for p in vpool._verify())
    monkeypatch.undo()
    vpool.sleep("weights")
    assert vpool._verify() == []

    def stale(va, nbytes):              # a sleeping segment with memory mapped
        return [(w.ptr, 3 * PAGE)] if va == w.ptr else real(va, nbytes)
    monkeypatch.setattr(vsim, "_chunks", stale, raising=False)
    assert any("sleeps with chunks mapped" in p for p in vpool._verify())


def test_a_trim_leaves_a_tags_chunk_and_unmaps_untagged_pages(vpool, vsim):
    with gpupool.tag("weights"):
        w = vpool.allocate(4 * PAGE)
    plain = [vpool.allocate(PAGE) for _ in range(4)]
    plain[1].close()
    plain[2].close()                    # a hole of two single-page chunks
    vpool.sleep("weights")
    vpool.wake("weights")
    vsim.calls.clear()
    assert vpool.trim() == 2 * PAGE
    assert [args[1] for args in vsim.calls_named("unmap")] == [2 * PAGE]
    assert vsim._chunks(w.ptr, 4 * PAGE) == [(w.ptr, 4 * PAGE)]
    check_invariants(vpool)


def test_the_page_locked_chunk_is_kept_reused_and_released(vpool, vsim):
    with gpupool.tag("weights"):
        w = vpool.allocate(2 * PAGE)
    w.copy_from_host(np.full(2 * PAGE, 7, np.uint8))
    for _ in range(3):
        vpool.sleep("weights", offload=True)
        vpool.wake("weights")
    assert vsim.calls_named("host_alloc") == [(2 * PAGE,)]      # pinned once
    assert vsim.calls_named("host_free") == []
    assert vpool.stats().pinned_bytes == vsim.pinned_bytes == 2 * PAGE
    assert (w.copy_to_host() == 7).all()
    with gpupool.tag("weights"):
        w2 = vpool.allocate(PAGE)
    vpool.sleep("weights", offload=True)        # 3 pages: a larger chunk, the old one back
    assert vsim.calls_named("host_alloc")[-1] == (3 * PAGE,)
    assert vsim.pinned_bytes == 3 * PAGE
    vpool.wake("weights")
    assert vpool.release_pinned() == 3 * PAGE
    assert vpool.release_pinned() == 0
    assert vsim.pinned_bytes == 0 == vpool.stats().pinned_bytes
    del w2
    check_invariants(vpool)


def test_two_tags_asleep_each_hold_a_chunk_and_the_larger_is_kept(vsim):
    pool = gpupool.Pool(upstream=vsim)
    with gpupool.tag("a"):
        a = pool.allocate(PAGE)
    with gpupool.tag("b"):
        b = pool.allocate(3 * PAGE)
    pool.sleep(["a", "b"], offload=True)
    assert vsim.pinned_bytes == 4 * PAGE == pool.stats().pinned_bytes
    pool.wake(["a", "b"])
    assert vsim.pinned_bytes == 3 * PAGE == pool.stats().pinned_bytes
    vsim.calls.clear()
    pool.sleep("a", offload=True)               # the kept chunk holds a's bytes
    assert vsim.calls_named("host_alloc") == []
    check_invariants(pool)
    del a, b, pool
    gc.collect()                                # the pool's end gives every chunk back
    assert vsim.pinned_bytes == 0 and vsim.errors == []


def test_a_tags_memory_is_not_exported_page_by_page():
    sim = SimulatedDevice(capacity=1 << 24, virtual_memory=True, page=PAGE, shareable=True)
    pool = gpupool.Pool(upstream=sim)
    with gpupool.tag("weights"):
        w = pool.allocate(2 * PAGE)
    with pytest.raises(gpupool.IpcError, match="chunks of many pages"):
        w.ipc_handle()
    plain = pool.allocate(PAGE)
    plain.ipc_handle()                          # untagged pages still are
