"""Memory snapshots (gpupool.snapshot) and the memory history (gpupool.history.ring): the snapshot's
segments and blocks are the pool's, traces record what the pools did with the caller's frames,
and PyTorch's own memory_viz reads the pickle. CPU tests run on the simulated device; the GPU
test (marked gpu) runs PyTorch under gpupool.torch.use() in a fresh process."""

import base64
import inspect
import json
import pickle
import pickletools
import re
import subprocess
import sys
import threading

import pytest
from conftest import TESTS, check_invariants, checked

import gpupool
from gpupool.adapters import torch_entry
from gpupool.history import ring
from gpupool.testing import SimulatedDevice

KIB, MIB = 1 << 10, 1 << 20
PAGE = 4 * KIB

pytestmark = pytest.mark.usefixtures("default_pools")


@pytest.fixture
def recording():
    """Record the memory history (all entries, Python frames) for the test; stop after."""
    gpupool.record_memory_history(max_entries=10_000)
    yield
    gpupool.record_memory_history(None)


@pytest.fixture
def vsim():
    yield from checked(SimulatedDevice(capacity=64 * MIB, virtual_memory=True, page=PAGE))


def here():
    """The caller's line number."""
    return inspect.currentframe().f_back.f_lineno


def pool_id(pool):
    """The pool's id in the memory history (its segment_pool_id is (0, id) unless default)."""
    [found] = [i for i, p in ring._live_pools().items() if p is pool]
    return found


def trace_of(snapshot, device=0):
    return snapshot["device_traces"][device]


def blocks_of(snapshot):
    return [b for s in snapshot["segments"] for b in s["blocks"]]


def replay_as_the_visualizer(snapshot, device=0):
    """Undo the device's trace from the snapshot's state, newest first, as PyTorch's visualizer
    does to draw past states (its segment view; its timeline pairs allocations with frees),
    checking what it relies on: every freed block was live, every allocated block is live
    after its allocation, every segment or mapped range given back existed and every one
    made is gone before it was made, and live blocks always lie in a segment. Returns the
    number of events undone."""
    segments = sorted([s["address"], s["total_size"], s["stream"]]
                      for s in snapshot["segments"] if s["device"] == device)
    live = {}
    for s in snapshot["segments"]:
        if s["device"] != device:
            continue
        address = s["address"]
        for b in s["blocks"]:
            assert b["address"] == address, "blocks must tile their segment"
            if b["state"] in ("active_allocated", "active_pending_free"):
                live[address] = b["size"]
            address += b["size"]
        assert address == s["address"] + s["total_size"]
    events = []
    for e in trace_of(snapshot, device):        # the visualizer's merge of a free's two halves
        if (e["action"] == "free_completed" and events
                and events[-1]["action"] == "free_requested" and events[-1]["addr"] == e["addr"]):
            events[-1] = dict(events[-1], action="free")
        else:
            events.append(e)

    def containing(addr, size):
        for i, (start, nbytes, _) in enumerate(segments):
            if start <= addr and addr + size <= start + nbytes:
                return i
        return None

    def insert(addr, size, stream):
        assert all(addr + size <= start or start + nbytes <= addr
                   for start, nbytes, _ in segments), f"{addr:#x} overlaps a segment"
        segments.append([addr, size, stream])
        segments.sort()
        i = 0
        while i + 1 < len(segments):                # mapped ranges join their neighbours
            a, b = segments[i], segments[i + 1]
            if a[0] + a[1] == b[0] and a[2] == b[2]:
                a[1] += b[1]
                del segments[i + 1]
            else:
                i += 1

    for e in reversed(events):
        action, addr, size = e["action"], e.get("addr"), e["size"]
        if action == "free":
            assert addr not in live, f"block {addr:#x} freed while it was live"
            live[addr] = size
        elif action == "free_completed":
            live[addr] = size
        elif action == "free_requested":
            assert addr in live, f"free requested of {addr:#x}, which is not live"
        elif action == "alloc":
            assert addr in live, f"block {addr:#x} allocated but not live after"
            del live[addr]
        elif action == "segment_free":
            insert(addr, size, e["stream"])
        elif action == "segment_unmap":
            insert(addr, size, e["stream"])
        elif action == "segment_alloc":
            found = [i for i, s in enumerate(segments) if s[0] == addr and s[1] == size]
            assert found, f"segment {addr:#x} of {size} B allocated, not there after"
            del segments[found[0]]
        elif action == "segment_map":
            i = containing(addr, size)
            assert i is not None, f"range {addr:#x} of {size} B mapped, not there after"
            start, nbytes, stream = segments.pop(i)
            if addr > start:
                segments.append([start, addr - start, stream])
            if addr + size < start + nbytes:
                segments.append([addr + size, start + nbytes - addr - size, stream])
            segments.sort()
        else:
            assert action == "oom", action
        for block, nbytes in live.items():
            assert containing(block, nbytes) is not None, f"block {block:#x} out of segments"
    return len(events)


# The state: segments and blocks ----------------------------------------------------------

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


# The history: traces ----------------------------------------------------------------------

def test_traces_record_allocations_frees_and_segments_with_frames(pool, recording):
    line = here() + 1
    buf = pool.allocate(1000)
    address = buf.ptr
    free_line = here() + 1
    del buf
    pool.trim()
    trace = trace_of(gpupool.memory_snapshot(pool))
    assert [e["action"] for e in trace] == ["segment_alloc", "alloc", "free_requested",
                                            "free_completed", "segment_free"]
    segment = trace[0]
    assert segment["addr"] <= address < segment["addr"] + segment["size"]
    assert segment["size"] == 2 * MIB
    assert (trace[1]["addr"], trace[1]["size"], trace[1]["stream"]) == (address, 1000, 0)
    assert [(e["addr"], e["size"]) for e in trace[2:4]] == [(address, 1000)] * 2
    assert (trace[4]["addr"], trace[4]["size"]) == (segment["addr"], segment["size"])
    assert all(e["time_us"] > 1.6e15 for e in trace)        # microseconds since the epoch
    assert [e["time_us"] for e in trace] == sorted(e["time_us"] for e in trace)
    name = "test_traces_record_allocations_frees_and_segments_with_frames"
    for e, at in zip(trace[:4], [line, line, free_line, free_line], strict=True):
        assert e["frames"][0] == {"filename": __file__, "line": at, "name": name}
    assert replay_as_the_visualizer(gpupool.memory_snapshot(pool)) == 4


def test_live_blocks_keep_their_allocation_frames(pool, recording):
    def make():
        return pool.allocate(3000)
    buf = make()
    [block] = [b for b in blocks_of(gpupool.memory_snapshot(pool)) if b["address"] == buf.ptr]
    assert block["requested_size"] == 3000 and block["size"] == gpupool.size_class(3000)
    assert [f["name"] for f in block["frames"][:2]] == [
        "make", "test_live_blocks_keep_their_allocation_frames"]
    [segment] = gpupool.memory_snapshot(pool)["segments"]
    assert segment["frames"][0]["name"] == "make"             # the segment's growth


def test_streams_are_recorded_by_handle(sim, pool, recording):
    s = sim.create_stream()
    buf = pool.allocate(1000, stream=s)
    buf.stream = 2                              # freed on the per-thread default stream
    del buf
    trace = trace_of(gpupool.memory_snapshot(pool))
    assert [(e["action"], e["stream"]) for e in trace] == [
        ("segment_alloc", s), ("alloc", s), ("free_requested", 2), ("free_completed", 2)]


def test_expandable_segments_record_maps_and_unmaps(vsim, recording):
    pool = gpupool.Pool(upstream=vsim)
    bufs = [pool.allocate(n) for n in (64 * KIB, 40 * PAGE, 64 * KIB, 300 * KIB)]
    del bufs[1]
    pool.trim()
    hole = pool.allocate(30 * PAGE)             # maps pages of the hole again
    del bufs[2]
    snapshot = gpupool.memory_snapshot(pool)
    actions = [e["action"] for e in trace_of(snapshot)]
    assert "segment_map" in actions and "segment_unmap" in actions
    assert "segment_alloc" not in actions and "segment_free" not in actions
    unmapped = [e for e in trace_of(snapshot) if e["action"] == "segment_unmap"]
    assert all(e["size"] % PAGE == 0 for e in unmapped)
    assert hole.ptr in [b["address"] for b in blocks_of(snapshot)]
    assert replay_as_the_visualizer(snapshot) == len(actions) - actions.count("free_completed")
    check_invariants(pool)


def test_a_pool_s_end_is_recorded(recording):
    sim = SimulatedDevice(device=3)
    pool = gpupool.Pool(upstream=sim)
    buf = pool.allocate(5000)
    del buf, pool
    trace = gpupool.memory_snapshot()["device_traces"][3]
    assert [e["action"] for e in trace] == ["segment_alloc", "alloc", "free_requested",
                                            "free_completed", "segment_free"]
    snapshot = gpupool.memory_snapshot()
    assert replay_as_the_visualizer(snapshot, 3) == 4


def test_out_of_memory_is_recorded(recording):
    pool = gpupool.Pool(upstream=SimulatedDevice(capacity=64 * MIB), hard_limit=4 * MIB)
    keep = pool.allocate(3 * MIB)
    with pytest.raises(gpupool.OutOfMemoryError):
        pool.allocate(2 * MIB)
    trace = trace_of(gpupool.memory_snapshot(pool))
    assert trace[-1]["action"] == "oom"
    assert trace[-1]["size"] == 2 * MIB
    assert trace[-1]["device_free"] == 4 * MIB - pool.stats().reserved_bytes
    assert trace[-1]["frames"][0]["name"] == "test_out_of_memory_is_recorded"
    assert keep.ptr in [e.get("addr") for e in trace]


def test_max_entries_bounds_the_ring(pool):
    gpupool.record_memory_history(max_entries=5)
    try:
        pool.allocate(1000)                     # segment_alloc, alloc, free x 2
        sizes = [1000 + i for i in range(10)]
        for n in sizes:
            buf = pool.allocate(n)
            del buf
        trace = trace_of(gpupool.memory_snapshot(pool))
        assert [(e["action"], e["size"]) for e in trace] == [
            ("free_requested", sizes[-2]), ("free_completed", sizes[-2]),
            ("alloc", sizes[-1]), ("free_requested", sizes[-1]), ("free_completed", sizes[-1])]
        gpupool.record_memory_history(max_entries=2)    # keeps the newest
        trace = trace_of(gpupool.memory_snapshot(pool))
        assert [e["action"] for e in trace] == ["free_requested", "free_completed"]
        gpupool.record_memory_history(max_entries=100)
        kept = pool.allocate(77)
        trace = trace_of(gpupool.memory_snapshot(pool))
        assert [(e["action"], e["size"]) for e in trace] == [
            ("free_requested", sizes[-1]), ("free_completed", sizes[-1]), ("alloc", 77)]
        assert trace[-1]["addr"] == kept.ptr
    finally:
        gpupool.record_memory_history(None)


def test_recording_off_records_nothing(pool):
    assert ring._settings()[0] is False
    buf = pool.allocate(1000)
    del buf
    keep = pool.allocate(2000)
    snapshot = gpupool.memory_snapshot(pool)
    assert snapshot["device_traces"] == [[]]
    assert all(b["frames"] == [] for b in blocks_of(snapshot))
    assert all(s["frames"] == [] for s in snapshot["segments"])
    [block] = [b for b in blocks_of(snapshot) if b["address"] == keep.ptr]
    assert block["requested_size"] == 2000      # from the buffer, not from a record


def test_stopping_forgets_everything_recorded(pool):
    gpupool.record_memory_history()
    keep = pool.allocate(1000)
    gpupool.record_memory_history(enabled=False)
    snapshot = gpupool.memory_snapshot(pool)
    assert trace_of(snapshot) == []
    assert all(b["frames"] == [] for b in blocks_of(snapshot))
    assert ring._settings()[0] is False
    del keep


def test_state_only_and_no_stacks(pool):
    gpupool.record_memory_history("state")
    try:
        keep = pool.allocate(1000)
        snapshot = gpupool.memory_snapshot(pool)
        assert trace_of(snapshot) == []
        [block] = [b for b in blocks_of(snapshot) if b["address"] == keep.ptr]
        assert block["frames"][0]["name"] == "test_state_only_and_no_stacks"
        gpupool.record_memory_history(True, stacks=None)
        other = pool.allocate(3000)
        trace = trace_of(gpupool.memory_snapshot(pool))
        assert [(e["action"], e["frames"]) for e in trace] == [("alloc", [])]
        assert trace[0]["addr"] == other.ptr
    finally:
        gpupool.record_memory_history(None)


def test_record_memory_history_refuses_bad_arguments():
    for kwargs, error in [({"enabled": "some"}, ValueError), ({"stacks": "all"}, ValueError),
                          ({"max_entries": 0}, ValueError), ({"max_entries": 2.5}, TypeError),
                          ({"max_entries": True}, TypeError)]:
        with pytest.raises(error):
            gpupool.record_memory_history(**kwargs)
    assert ring._settings()[0] is False


def test_c_api_calls_without_the_gil_have_no_frames(pool, recording):
    gpupool.set_pool(pool)
    with_gil = torch_entry._torch_malloc(1000)
    without = torch_entry._torch_malloc(2000, gil=False)
    torch_entry._torch_free(without, gil=False)
    torch_entry._torch_free(with_gil)
    trace = trace_of(gpupool.memory_snapshot(pool))
    frames = {(e["action"], e["addr"]): e["frames"] for e in trace}
    name = "test_c_api_calls_without_the_gil_have_no_frames"
    assert frames[("alloc", with_gil)][0]["name"] == name
    assert frames[("free_completed", with_gil)][0]["name"] == name
    assert frames[("alloc", without)] == [] and frames[("free_completed", without)] == []


def test_pytorch_s_global_entry_point_gathers_frames_without_the_gil(pool, recording):
    gpupool.set_pool(pool)
    ptr = torch_entry._torch_malloc_checked(4000, gil=False)
    torch_entry._torch_free(ptr, gil=False)
    trace = trace_of(gpupool.memory_snapshot(pool))
    [alloc] = [e for e in trace if e["action"] == "alloc"]
    assert alloc["addr"] == ptr and alloc["size"] == 4000
    assert alloc["frames"][0]["name"] == (
        "test_pytorch_s_global_entry_point_gathers_frames_without_the_gil")
    assert [e["frames"] for e in trace if e["action"] == "free_completed"] == [[]]


def test_threads_record_in_the_pool_s_order(pool, recording):
    def work():
        for n in range(1000, 1200):
            buf = pool.allocate(n)
            del buf
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snapshot = gpupool.memory_snapshot(pool)
    trace = trace_of(snapshot)
    assert sum(e["action"] == "alloc" for e in trace) == 800
    assert all(e["frames"][0]["name"] == "work" for e in trace if e["action"] == "alloc")
    replay_as_the_visualizer(snapshot)


def test_replay_holds_on_a_random_workload(recording):
    import random
    rng = random.Random(5)
    for sim in (SimulatedDevice(capacity=256 * MIB),
                SimulatedDevice(capacity=256 * MIB, virtual_memory=True, page=PAGE)):
        pool = gpupool.Pool(upstream=sim, hard_limit=96 * MIB)
        region = gpupool.Region(pool=pool)
        live = []
        for _ in range(300):
            roll = rng.random()
            if roll < 0.5:
                try:
                    live.append(pool.allocate(rng.choice([700, 5000, 300 * KIB, 3 * MIB,
                                                          11 * MIB])))
                except gpupool.OutOfMemoryError:
                    pass
            elif roll < 0.9 and live:
                live.pop(rng.randrange(len(live)))
            elif roll < 0.95:
                pool.trim()
            else:
                with region:
                    tmp = [pool.allocate(rng.choice([5000, MIB])) for _ in range(3)]
                    del tmp
        snapshot = gpupool.memory_snapshot(pool)
        assert replay_as_the_visualizer(snapshot) > 300
        check_invariants(pool)
        del live, region, pool


# The real client: PyTorch's memory_viz ----------------------------------------------------

# The pickle opcodes that the visualizer's own unpickler (torch/utils/viz/MemoryViz.js) reads.
VIEWER_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "DICT", "LIST",
    "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "APPEND", "APPENDS", "SETITEM", "SETITEMS",
    "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET", "BININT", "BININT1",
    "BININT2", "LONG1", "SHORT_BINUNICODE", "BINUNICODE", "BINFLOAT", "NONE", "NEWTRUE",
    "NEWFALSE",
}


@pytest.fixture
def dumped(tmp_path, recording):
    """A pool's recorded work and the pickle dump_snapshot wrote: (path, pool, buffers kept,
    the addresses and sizes of what was allocated)."""
    pool = gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 30))
    region = gpupool.Region(pool=pool, name="step")
    allocated = []

    def step():
        with region:
            tmp = [pool.allocate(n) for n in (3 * MIB, 5000, 21 * MIB)]
            allocated.extend((b.ptr, b.nbytes) for b in tmp)
            del tmp
    line = here() + 1
    kept = [pool.allocate(1000), pool.allocate(25 * MIB)]
    allocated.extend((b.ptr, b.nbytes) for b in kept)
    step()
    step()
    path = tmp_path / "snapshot.pickle"
    gpupool.dump_snapshot(path, pool)
    yield path, pool, kept, allocated, line
    region.release()                            # (alive until the test ends)


def test_the_pickle_uses_only_what_the_visualizer_reads(dumped):
    path, pool, kept, _, _ = dumped
    data = path.read_bytes()
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(data)]
    assert ops[0] == ("PROTO", 4)
    assert {name for name, _ in ops} <= VIEWER_OPCODES
    snapshot = pickle.loads(data)
    assert set(snapshot) >= {"segments", "device_traces", "allocator_settings"}
    assert snapshot == gpupool.memory_snapshot(pool)


def test_pytorch_memory_viz_reads_the_pickle(dumped):
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    path, pool, kept, allocated, line = dumped
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    stats = pool.stats()
    summary = memory_viz.segsum(snapshot)       # checks that blocks tile the segments
    assert f"segments: {len(snapshot['segments'])}" in summary
    assert f"total_reserved: {memory_viz.Bytes(stats.reserved_bytes)}" in summary
    text = memory_viz.trace(snapshot)
    for s in snapshot["segments"]:
        assert f"cudaMalloc({s['address']}, " in text
    assert len(re.findall(r"^\w+ = \w+\[\d+:", text, re.M)) == len(allocated)
    assert text.count("del ") == len(allocated) - len(kept)
    lines = memory_viz.segments(snapshot, format_flamegraph=lambda lines: lines)
    for s in snapshot["segments"]:
        assert f"seg_{s['address']};" in lines
    for buf in kept:                            # frames outermost first, then the size
        assert f";test_snapshot.py:{line}:dumped {buf.nbytes}\n" in lines
    assert ";inactive;gpupool:0:cached by region " in lines
    memory_lines = memory_viz.memory(snapshot, format_flamegraph=lambda lines: lines)
    assert sum(int(line.rsplit(" ", 1)[1]) for line in memory_lines.splitlines()) == \
        stats.reserved_bytes
    before = gpupool.memory_snapshot(pool)["segments"]
    more = pool.allocate(40 * MIB)
    after = gpupool.memory_snapshot(pool)["segments"]
    compared = memory_viz.compare(before, after, format_flamegraph=lambda lines: lines)
    assert f"only_after;stream_0;seg_{more.ptr};active_allocated" in compared
    for html in (memory_viz.segment_plot(snapshot), memory_viz.trace_plot(snapshot),
                 memory_viz.trace_plot(snapshot, plot_segments=True)):
        embedded = json.loads(re.search(r"const local_files = (\[.*\])", html).group(1))
        data = base64.b64decode(embedded[0]["base64"])
        assert pickle.loads(data.rstrip(b"\0")) == snapshot
    assert replay_as_the_visualizer(snapshot) > len(allocated)
    for ptr, nbytes in allocated:
        assert {"action": "alloc", "addr": ptr, "size": nbytes} in [
            {k: e[k] for k in ("action", "addr", "size")} for e in trace_of(snapshot)
            if e["action"] == "alloc"]


def test_pytorch_memory_viz_command_line_reads_the_pickle(dumped, tmp_path):
    pytest.importorskip("torch.cuda._memory_viz")
    path, pool, kept, allocated, line = dumped
    run = [sys.executable, "-m", "torch.cuda._memory_viz"]
    stats = subprocess.run(run + ["stats", str(path)], capture_output=True, text=True,
                           timeout=300)
    assert stats.returncode == 0, stats.stderr
    assert "total_reserved" in stats.stdout
    trace = subprocess.run(run + ["trace", str(path)], capture_output=True, text=True,
                           timeout=300)
    assert trace.returncode == 0, trace.stderr
    assert f"cudaMalloc({pickle.loads(path.read_bytes())['segments'][0]['address']}" in \
        trace.stdout
    for kind in ("segment_plot", "trace_plot"):
        out = tmp_path / f"{kind}.html"
        done = subprocess.run(run + [kind, str(path), "-o", str(out)], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert "MemoryViz.js" in out.read_text()


# On the GPU ----------------------------------------------------------------------------------

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


# On the GPU: PyTorch under gpupool.torch.use() -------------------------------------------

@pytest.mark.gpu
def test_pytorch_under_gpupool_snapshots_for_memory_viz(tmp_path):
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    path = tmp_path / "torch.pickle"
    child = subprocess.run([sys.executable, str(TESTS / "torch_child.py"),
                            "snapshot-use", str(path)],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stdout + child.stderr
    result = json.loads(child.stdout.strip().splitlines()[-1])
    snapshot = pickle.loads(path.read_bytes())
    assert {op.name for op, _, _ in pickletools.genops(path.read_bytes())} <= VIEWER_OPCODES
    blocks = {b["address"]: b for s in snapshot["segments"] for b in s["blocks"]}
    for ptr, nbytes in result["kept"]:
        assert blocks[ptr]["state"] == "active_allocated"
        assert blocks[ptr]["requested_size"] == nbytes
        assert any(f["name"] == "snapshot_use" for f in blocks[ptr]["frames"])
    allocs = {e["addr"]: e for e in snapshot["device_traces"][0] if e["action"] == "alloc"}
    for ptr, nbytes in result["kept"] + result["freed"]:
        assert allocs[ptr]["size"] == nbytes
        assert any(f["name"] == "snapshot_use" for f in allocs[ptr]["frames"])
    assert all(s["is_expandable"] == result["expandable"] for s in snapshot["segments"])
    assert sum(s["total_size"] for s in snapshot["segments"]) == result["reserved_bytes"]
    assert "total_reserved" in memory_viz.segsum(snapshot)
    assert "cudaMalloc(" in memory_viz.trace(snapshot) or result["expandable"]
    assert "MemoryViz.js" in memory_viz.segment_plot(snapshot)
    assert "MemoryViz.js" in memory_viz.trace_plot(snapshot)
    assert replay_as_the_visualizer(snapshot) > 0


