"""The memory history (gpupool.record_memory_history, gpupool.history.ring): traces record
what the pools did (allocations, frees, segments, mapped ranges, out of memory, a pool's end)
with the caller's frames, also for the C API's calls without the GIL and for threads; the
ring's bound and its settings; a random workload's trace replays as the visualizer's."""

import threading

import pytest
from conftest import check_invariants
from snapshot_peers import KIB, MIB, PAGE, blocks_of, here, replay_as_the_visualizer, trace_of
from snapshot_peers import recording, vsim  # noqa: F401 (fixtures)

import gpupool
from gpupool.adapters import torch_entry
from gpupool.history import ring
from gpupool.testing import SimulatedDevice

pytestmark = pytest.mark.usefixtures("default_pools")


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
