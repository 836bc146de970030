"""The trace format of the benchmarks (bench/alloc_trace.py: live bytes, saving, loading,
synthetic traces, traces from a snapshot), trace replay on the simulated device
(bench/trace_replay.py) and record_trace's workloads by name (bench/record_trace.py)."""

import json
import os
import sys

import numpy as np
import pytest

import gpupool
from gpupool.testing import SimulatedDevice

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench"))

import alloc_trace  # noqa: E402
import trace_replay  # noqa: E402
from _peers import Context  # noqa: E402

A, F = alloc_trace.ALLOC, alloc_trace.FREE


def small_trace():
    """alloc 100 (id 0), alloc 200 on stream 1 (id 1), free 0, alloc 50 (id 2), free 1."""
    rows = [(A, 0, 100, 0), (A, 1, 200, 1), (F, 0, 100, 0), (A, 2, 50, 0), (F, 1, 200, 1)]
    return alloc_trace.Trace("small", *zip(*rows, strict=True), meta={"source": "test"})


# The trace format ------------------------------------------------------------------------

def test_live_bytes_of_a_small_trace():
    trace = small_trace()
    assert trace.live_bytes().tolist() == [100, 300, 200, 250, 50]
    assert trace.peak_live_bytes() == 300
    assert trace.summary() == {"events": 5, "allocations": 3, "streams": 2,
                               "peak_live_bytes": 300, "live_at_end_bytes": 50,
                               "allocated_bytes": 350}


def test_live_bytes_match_a_step_by_step_count():
    trace = alloc_trace.synthetic(steps=3, seed=1)
    live, sizes, expected = 0, {}, []
    for op, i, n, _ in trace.events():
        if op == A:
            sizes[i] = n
            live += n
        else:
            live -= sizes.pop(i)
        expected.append(live)
    assert trace.live_bytes().tolist() == expected
    assert trace.peak_live_bytes() == max(expected)
    assert trace.num_streams == 2 and trace.num_allocs == (len(expected) + len(sizes)) // 2


@pytest.mark.parametrize("rows, message", [
    ([(A, 0, 10, 0), (F, 1, 10, 0)], "matches no live allocation"),
    ([(A, 0, 10, 0), (F, 0, 11, 0)], "matches no live allocation"),
    ([(A, 0, 10, 0), (F, 0, 10, 1)], "matches no live allocation"),
    ([(A, 0, 10, 0), (F, 0, 10, 0), (F, 0, 10, 0)], "matches no live allocation"),
    ([(A, 0, 10, 0), (A, 0, 10, 0)], "expected 1"),
    ([(A, 0, 0, 0)], "allocation of 0 B"),
    ([(A, 0, 10, 256)], "stream 256"),
    ([(2, 0, 10, 0)], "neither ALLOC"),
])
def test_bad_traces_are_refused(rows, message):
    with pytest.raises(ValueError, match=message):
        alloc_trace.Trace("bad", *zip(*rows, strict=True))


def test_save_and_load_round_trip(tmp_path):
    trace = alloc_trace.synthetic(steps=2, seed=3)
    path = tmp_path / "sub" / "t.npz"
    alloc_trace.save(trace, str(path))
    back = alloc_trace.load(str(path))
    assert back.name == trace.name and back.meta == trace.meta
    for field in ("op", "ids", "nbytes", "stream"):
        assert np.array_equal(getattr(back, field), getattr(trace, field))
    assert alloc_trace.find(str(tmp_path / "sub")) == [str(path)]
    assert alloc_trace.find(str(tmp_path / "missing")) == []


def test_load_refuses_other_files(tmp_path):
    path = tmp_path / "x.npz"
    np.savez_compressed(path, op=np.zeros(1))
    with pytest.raises(ValueError, match="not an allocation trace"):
        alloc_trace.load(str(path))


def test_synthetic_is_deterministic_and_training_like():
    a, b = alloc_trace.synthetic(seed=5), alloc_trace.synthetic(seed=5)
    assert np.array_equal(a.nbytes, b.nbytes) and np.array_equal(a.op, b.op)
    assert not np.array_equal(a.nbytes, alloc_trace.synthetic(seed=6).nbytes)
    summary = a.summary()
    # Weights and optimizer state stay live; the steps allocate far more than their peak.
    assert 0 < summary["live_at_end_bytes"] < summary["peak_live_bytes"]
    assert summary["allocated_bytes"] > 3 * summary["peak_live_bytes"]


def test_from_snapshot_pairs_allocations_and_frees():
    entries = [
        {"action": "segment_alloc", "addr": 0x1000, "size": 2 << 20, "stream": 0},
        {"action": "free_requested", "addr": 0x9000, "size": 64, "stream": 0},  # before
        {"action": "free_completed", "addr": 0x9000, "size": 64, "stream": 0},
        {"action": "alloc", "addr": 0x1000, "size": 1000, "stream": 0},
        {"action": "alloc", "addr": 0x2000, "size": 512, "stream": 0x77},
        {"action": "free_requested", "addr": 0x1000, "size": 1000, "stream": 0},
        {"action": "free_completed", "addr": 0x1000, "size": 1000, "stream": 0},
        {"action": "alloc", "addr": 0x1000, "size": 300, "stream": 0x55},
        {"action": "free_completed", "addr": 0x2000, "size": 512, "stream": 0x77},  # no request
        {"action": "snapshot", "addr": 0, "size": 0, "stream": 0},
    ]
    snapshot = {"segments": [], "device_traces": [[], entries]}
    trace = alloc_trace.from_snapshot(snapshot, "fake", device=1, meta={"model": "m"})
    assert trace.events() == [(A, 0, 1000, 0), (A, 1, 512, 1), (F, 0, 1000, 0),
                              (A, 2, 300, 2), (F, 1, 512, 1)]
    assert trace.meta["unmatched_frees"] == 1
    assert trace.meta["stream_handles"] == [0, 0x77, 0x55]
    assert trace.meta["actions"]["alloc"] == 3 and trace.meta["model"] == "m"


def test_from_snapshot_refuses_an_alloc_over_a_live_one():
    entries = [{"action": "alloc", "addr": 0x1000, "size": 8, "stream": 0}] * 2
    with pytest.raises(ValueError, match="which is live"):
        alloc_trace.from_snapshot({"device_traces": [entries]}, "x")


# Replay ----------------------------------------------------------------------------------

class Counting:
    """A fake allocator that counts live bytes."""

    def __init__(self):
        self.live = self.peak = 0

    def alloc(self, n, stream):
        self.live += n
        self.peak = max(self.peak, self.live)
        return n

    def free(self, n, stream):
        self.live -= n


def stepped_trace():
    """A recorded run (30 steps, their starts in ``meta["step_starts"]``)."""
    return alloc_trace.load(os.path.join(os.path.dirname(alloc_trace.TRACE_DIR), "traces-real",
                                         "resnet50.npz"))


def test_first_steps_cut_a_trace_where_a_step_starts():
    trace = stepped_trace()
    starts = trace.meta["step_starts"]
    two = alloc_trace.first_steps(trace, 2)
    assert len(two) == starts[2] and two.meta["step_starts"] == starts[:2]
    assert two.meta["steps"] == 2 and two.name == trace.name
    assert (two.nbytes == trace.nbytes[:starts[2]]).all()
    assert (two.op == trace.op[:starts[2]]).all()
    assert two.summary()["live_at_end_bytes"] > 0           # the last step's tails stay live
    whole = alloc_trace.first_steps(trace, len(starts))
    assert len(whole) == len(trace) and whole.meta["step_starts"] == starts


@pytest.mark.parametrize("n, error, message", [
    (0, ValueError, "from 1 to its 30 steps, got 0"), (31, ValueError, "got 31"),
    (2.0, TypeError, "integer"), (True, TypeError, "integer")])
def test_first_steps_refuse_steps_out_of_range(n, error, message):
    with pytest.raises(error, match=message):
        alloc_trace.first_steps(stepped_trace(), n)


def test_first_steps_refuse_a_trace_without_steps():
    with pytest.raises(ValueError, match="no step starts"):
        alloc_trace.first_steps(small_trace(), 1)


def test_replay_frees_what_the_trace_frees():
    trace = alloc_trace.synthetic(steps=3)
    counter = Counting()
    left = trace_replay.replay(trace.events(), counter.alloc, counter.free)
    assert counter.peak == trace.peak_live_bytes()
    assert counter.live == sum(left.values()) == trace.summary()["live_at_end_bytes"]


def test_replay_on_the_simulated_device():
    sim = SimulatedDevice(capacity=1 << 30)
    ctx = Context(gpupool, sim=sim)
    trace = alloc_trace.synthetic()
    allocator = trace_replay.GpupoolReplay(ctx)
    cell = trace_replay._Cell(allocator, trace)
    for _ in range(2):
        allocator.reset()
        cell.batch(1)
        pool = allocator.pool
        assert pool.stats().in_use_bytes >= trace.summary()["live_at_end_bytes"]
        cell.after()
        assert pool.stats().in_use_bytes == 0 and pool.stats().reserved_bytes == 0
    reserved, in_use = cell.peaks[0]
    assert cell.peaks[0] == cell.peaks[1]          # a fresh pool each replay
    assert reserved >= in_use >= trace.peak_live_bytes()
    assert sim.used == 0 and sim.errors == []
    # Stream index 1 became a simulated stream of its own.
    handles = {s for _, _, _, s in cell.events}
    assert len(handles) == 2 and 0 in handles


def test_trace_replay_script_without_recorded_traces(tmp_path, capsys):
    out_json = tmp_path / "r.json"
    trace_replay.main(["--simulated", "--quick", "--trace-dir", str(tmp_path / "none"),
                       "--json", str(out_json)])
    printed = capsys.readouterr()
    assert "no recorded traces" in printed.err and "no recorded traces" in printed.out
    result = json.loads(out_json.read_text())
    gp = result["traces"]["synthetic"]["columns"]["gp"]
    live = result["traces"]["synthetic"]["summary"]["peak_live_bytes"]
    assert gp["peak_reserved_bytes"] >= live and gp["reserved_over_live"] >= 1
    assert gp["time_ns"]["median"] > 0
    assert set(result["skipped"]) == {"cp.pool", "cp.async", "torch", "drv.async"}


def test_trace_replay_script_with_a_trace_file(tmp_path, capsys):
    trace = small_trace()
    alloc_trace.save(trace, str(tmp_path / "small.npz"))
    out_json = tmp_path / "r.json"
    trace_replay.main(["--simulated", "--quick", "--trace-dir", str(tmp_path), "--synthetic",
                       "--columns", "gp", "--json", str(out_json)])
    result = json.loads(out_json.read_text())
    assert list(result["traces"]) == ["small", "synthetic"] and result["note"] is None
    assert "no recorded traces" not in capsys.readouterr().err


def test_record_trace_takes_the_workloads_by_name(capsys):
    import record_trace

    assert {"conv", "transformer", "gpt2-ckpt", "llama-ckpt",
            "gpt2-generate"} <= set(record_trace.KNOWN)
    with pytest.raises(SystemExit) as exc:
        record_trace.main(["--models", "gpt2-ckpt,nope"])
    assert exc.value.code == 2 and "'gpt2-generate'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        record_trace.main(["--models", "gpt2-ckpt,gpt2-generate", "--simulated"])
    assert exc.value.code == 0 and "skipped" in capsys.readouterr().out
