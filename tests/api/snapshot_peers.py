"""What the tests of snapshots and the memory history share (test_snapshot.py,
test_memory_history.py, test_memory_viz.py): the recording fixture, a pool on a simulated
device with virtual memory, lookups in a snapshot, and the replay of a snapshot's trace as
PyTorch's visualizer does it."""

import inspect

import pytest
from conftest import checked

import gpupool
from gpupool.history import ring
from gpupool.testing import SimulatedDevice

KIB, MIB = 1 << 10, 1 << 20
PAGE = 4 * KIB


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
