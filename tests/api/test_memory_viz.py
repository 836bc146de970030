"""The real client of snapshots: PyTorch's memory_viz reads the pickle that
gpupool.dump_snapshot writes (only the opcodes its own unpickler reads; its summaries, traces,
flame graphs, plots and command line). On a GPU (marked gpu): PyTorch under gpupool.torch.use()
in a fresh process (tests/torch_child.py) snapshots for memory_viz."""

import base64
import json
import pickle
import pickletools
import re
import subprocess
import sys

import pytest
from conftest import TESTS
from snapshot_peers import MIB, here, replay_as_the_visualizer, trace_of
from snapshot_peers import recording  # noqa: F401 (fixtures)

import gpupool
from gpupool.testing import SimulatedDevice

pytestmark = pytest.mark.usefixtures("default_pools")


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
        assert f";test_memory_viz.py:{line}:dumped {buf.nbytes}\n" in lines
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
