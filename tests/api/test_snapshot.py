"""Memory snapshots (gpupool.memory_snapshot): the snapshot's segments and blocks are the
pool's (their states, expandable segments as their mapped runs, a region's blocks, every pool
of every device). On a GPU (marked gpu): a device pool's snapshot is its state and history."""


import pytest
from conftest import check_invariants
from snapshot_peers import KIB, MIB, PAGE, blocks_of, pool_id, replay_as_the_visualizer, trace_of
from snapshot_peers import recording, vsim  # noqa: F401 (fixtures)

import gpupool
from gpupool.testing import SimulatedDevice

pytestmark = pytest.mark.usefixtures("default_pools")


def test_segments_and_blocks_are_the_pool_s(pool):
    sizes = [1000, 5000, 3 * MIB, 40 * KIB, 12 * MIB, 700]
    bufs = [pool.allocate(n) for n in sizes]
    del bufs[1], bufs[3]                        # 5000 and 12 MiB freed
    cached = pool.cached_blocks()               # puts parked blocks back first
    snapshot = gpupool.memory_snapshot(pool)
    stats = check_invariants(pool)
    segments = snapshot["segments"]
    assert [s["address"] for s in segments] == sorted(s["address"] for s in segments)
    assert sum(s["total_size"] for s in segments) == stats.reserved_bytes
    assert sum(s["allocated_size"] for s in segments) == stats.in_use_bytes
    assert sum(s["active_size"] for s in segments) == stats.in_use_bytes
    for s in segments:
        assert s["device"] == 0 and s["stream"] == 0 and not s["is_expandable"]
        assert s["segment_pool_id"] == (0, pool_id(pool))
        assert s["segment_type"] == ("large" if s["total_size"] > MIB else "small")
        assert s["total_size"] == sum(b["size"] for b in s["blocks"])
        assert s["requested_size"] == sum(b["requested_size"] for b in s["blocks"]
                                          if b["state"] == "active_allocated")
    live = sorted((b["address"], b["size"], b["requested_size"])
                  for b in blocks_of(snapshot) if b["state"] == "active_allocated")
    assert live == sorted((b.ptr, gpupool.size_class(b.nbytes), b.nbytes) for b in bufs)
    free = [(b["address"], b["size"]) for b in blocks_of(snapshot) if b["state"] == "inactive"]
    assert sorted(free) == [(ptr, size) for ptr, size, _ in cached]
    assert {b["state"] for b in blocks_of(snapshot)} == {"active_allocated", "inactive"}
    assert all(b["frames"] == [] and b["region"] is None for b in blocks_of(snapshot))


def test_the_default_pool_is_pytorch_s_default_pool_id(sim):
    pool = gpupool.Pool(upstream=sim)
    gpupool.set_pool(pool)
    buf = pool.allocate(1000)
    snapshot = gpupool.memory_snapshot(pool)
    assert [s["segment_pool_id"] for s in snapshot["segments"]] == [(0, 0)]
    assert buf.ptr in [b["address"] for b in blocks_of(snapshot)]


def test_parked_and_record_stream_blocks_have_their_states(sim, pool):
    s = sim.create_stream()
    a, b = pool.allocate(1000), pool.allocate(2000)
    address_b = b.ptr
    b.record_stream(s)
    del a, b                                    # a parked; b waits on s's event
    states = {blk["address"]: blk["state"]
              for blk in blocks_of(gpupool.memory_snapshot(pool))}
    assert states[address_b] == "active_pending_free"
    assert "inactive" in states.values()
    check_invariants(pool)                      # the snapshot changed nothing


def test_expandable_segments_are_their_mapped_runs(vsim):
    pool = gpupool.Pool(upstream=vsim)
    keep = [pool.allocate(64 * KIB) for _ in range(4)]
    gone = pool.allocate(40 * PAGE)
    last = pool.allocate(64 * KIB)
    del gone
    pool.trim()                                 # the pages of the middle block: a hole
    snapshot = gpupool.memory_snapshot(pool)
    stats = check_invariants(pool)
    segments = snapshot["segments"]
    assert len(segments) == 2 and all(s["is_expandable"] for s in segments)
    assert sum(s["total_size"] for s in segments) == stats.reserved_bytes
    assert sum(s["allocated_size"] for s in segments) == stats.in_use_bytes
    first, second = segments
    assert first["address"] + first["total_size"] < second["address"]     # the hole
    assert vsim.mapped(first["address"], first["total_size"])
    assert vsim.mapped(second["address"], second["total_size"])
    assert not vsim.mapped(first["address"] + first["total_size"])
    live = {b["address"] for b in blocks_of(snapshot) if b["state"] == "active_allocated"}
    assert live == {b.ptr for b in keep + [last]}


def test_a_region_s_blocks_show_as_the_region_s(pool):
    region = gpupool.Region(pool=pool, name="step")
    outside = pool.allocate(3000)
    with region:
        inside = pool.allocate(5000)
        scratch = pool.allocate(MIB)
        del scratch                             # cached by the region
        snapshot = gpupool.memory_snapshot(pool)
    [info] = [r for r in snapshot["regions"] if r["name"] == "step"]
    assert info["live_bytes"] == gpupool.size_class(5000)
    assert info["device"] == 0 and info["segment_pool_id"] == (0, pool_id(pool))
    blocks = {b["address"]: b for b in blocks_of(snapshot)}
    assert blocks[inside.ptr]["region"] == info["id"]
    assert blocks[inside.ptr]["state"] == "active_allocated"
    assert blocks[outside.ptr]["region"] is None
    snapshot = gpupool.memory_snapshot(pool)    # after the exit: inside escaped to the pool
    [info] = [r for r in snapshot["regions"] if r["name"] == "step"]
    assert info["cached_bytes"] == region.stats().cached_bytes > 0
    assert info["live_bytes"] == 0
    blocks = {b["address"]: b for b in blocks_of(snapshot)}
    assert blocks[inside.ptr]["region"] is None
    cached = [b for b in blocks.values() if b["region"] == info["id"]]
    assert sum(b["size"] for b in cached) == info["cached_bytes"]
    for b in cached:
        assert b["state"] == "inactive"
        assert b["frames"] == [{"filename": "gpupool", "line": 0,
                                "name": f"cached by region {info['id']} step"}]
    assert all(b["frames"] == [] for b in blocks.values()
               if b["state"] == "inactive" and b["region"] is None)
    region.release()
    snapshot = gpupool.memory_snapshot(pool)
    assert all(b["region"] is None for b in blocks_of(snapshot)
               if b["state"] == "inactive")


def test_every_pool_of_every_device(recording):
    pools = [gpupool.Pool(upstream=SimulatedDevice(device=d)) for d in (0, 2)]
    bufs = [p.allocate(1000) for p in pools]
    snapshot = gpupool.memory_snapshot()
    assert len(snapshot["device_traces"]) >= 3
    for p, buf in zip(pools, bufs, strict=True):
        mine = [s for s in snapshot["segments"] if s["segment_pool_id"] == (0, pool_id(p))]
        assert [s["device"] for s in mine] == [p.device]
        assert buf.ptr in [b["address"] for s in mine for b in s["blocks"]]
        assert ("alloc", buf.ptr) in [(e["action"], e.get("addr"))
                                      for e in snapshot["device_traces"][p.device]]
    assert gpupool.memory_snapshot(pools[1])["device_traces"][0] == []


def test_memory_snapshot_refuses_what_is_not_a_pool():
    with pytest.raises(TypeError, match="gpupool.Pool"):
        gpupool.memory_snapshot(pool="mine")


@pytest.mark.gpu
def test_a_device_pool_s_snapshot_is_its_state_and_history(recording):
    pool = gpupool.Pool(device=0)               # the default upstream: vmm where it can
    keep = [pool.allocate(n) for n in (1000, 3 * MIB, 300 * KIB)]
    gone = pool.allocate(64 * MIB)
    del gone
    pool.trim()
    again = pool.allocate(5 * MIB)
    snapshot = gpupool.memory_snapshot(pool)
    stats = check_invariants(pool)
    assert sum(s["total_size"] for s in snapshot["segments"]) == stats.reserved_bytes
    assert sum(s["allocated_size"] for s in snapshot["segments"]) == stats.in_use_bytes
    assert all(s["is_expandable"] == pool.upstream.expandable for s in snapshot["segments"])
    live = {b["address"] for b in blocks_of(snapshot) if b["state"] == "active_allocated"}
    assert live == {b.ptr for b in keep + [again]}
    actions = {e["action"] for e in trace_of(snapshot)}
    grown = {"segment_map", "segment_unmap"} if pool.upstream.expandable else \
        {"segment_alloc", "segment_free"}
    assert grown <= actions
    assert replay_as_the_visualizer(snapshot) > 0
