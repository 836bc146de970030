"""CUDA IPC on the simulated device (CPU): the handle's bytes and pickling, the offsets of
blocks cut from segments and pages, the export table (a given-back buffer's handle refused, a
segment an importer holds open kept from the driver by trim), every error path, and real
second processes that open handles (tests/ipc/ipc_child.py): ``SimulatedDevice(shareable=True)``
memory is memfd files both processes map.

On a GPU (marked gpu), on both upstreams that export ("driver": cuIpcGetMemHandle of the
segment; "vmm": a POSIX file descriptor per page): the producer is this process, which writes
with a slow kernel through CuPy; consumers are other processes (tests/ipc/ipc_child.py) reading
through CuPy, Numba and PyTorch, which must see the kernel's final bytes; 1,000 export / open /
close rounds leave both pools' accounting exact; every error path on the real driver;
torch.multiprocessing under gpupool.torch (tests/ipc/ipc_torch_child.py)."""

import gc
import json
import multiprocessing
import os
import pickle
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import pytest
from conftest import SLOW_WRITE, check_invariants, checked
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpupool
from gpupool.ipc import export, mapping, table
from gpupool.ipc.handle import FIELDS
from gpupool.testing import SimulatedDevice

KIB, MIB = 1 << 10, 1 << 20
PAGE = 64 * KIB
SPAWN = multiprocessing.get_context("spawn")
RETIRED = 2                                 # gp_ipc.h's GP_IPC_RETIRED
N = 8 * MIB                 # the GPU tests' buffer
SPIN = 4_000_000_000        # clock cycles, about 2 s on an H200: longer than a consumer's open
UPSTREAMS = ["driver", "vmm"]
TORCH_CHILD = Path(__file__).resolve().parent / "ipc_torch_child.py"

try:
    import cupy  # the producer in every GPU test
except ImportError:
    cupy = None
needs_cupy = pytest.mark.skipif(cupy is None, reason="could not import 'cupy'")

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd (Linux)")


@pytest.fixture
def msim():
    yield from checked(SimulatedDevice(capacity=256 * MIB, shareable=True))


@pytest.fixture
def mpool(msim):
    return gpupool.Pool(upstream=msim)


@pytest.fixture
def vsim():
    yield from checked(SimulatedDevice(capacity=256 * MIB, shareable=True, virtual_memory=True, page=PAGE))


@pytest.fixture
def vpool(vsim):
    return gpupool.Pool(upstream=vsim)


class Child:
    """A second process (tests/ipc/ipc_child.py): ``Child(**device)`` serves commands with a pool
    on a simulated device of its own; ``Child(target=name, **kwargs)`` runs
    ``ipc_child.name(conn, **kwargs)`` (a GPU pool, a framework consumer)."""

    def __init__(self, target=None, **kwargs):
        self.conn, theirs = SPAWN.Pipe()
        import ipc_child

        if target is None:
            target, kwargs = "serve", {"device": kwargs}
        self.process = SPAWN.Process(target=getattr(ipc_child, target), args=(theirs,),
                                     kwargs=kwargs, daemon=True)
        self.process.start()
        theirs.close()

    def call(self, *command):
        """The command's value; an error reply raises AssertionError with it."""
        reply = self.ask(*command)
        assert reply[0] == "ok", reply
        return reply[1]

    def ask(self, *command):
        self.conn.send(command)
        if not self.conn.poll(60):
            raise AssertionError(f"the child did not answer {command[0]!r}")
        return self.conn.recv()

    def refused(self, *command):
        """(reason, message) of the IpcError the command raised in the child."""
        reply = self.ask(*command)
        assert reply[0] == "error" and reply[1] == "IpcError", reply
        return reply[2], reply[3]

    def exit(self, how="normal"):
        self.ask("exit", how)
        self.process.join(30)
        assert self.process.exitcode == 0


@pytest.fixture(scope="module")
def child():
    """An importer on a simulated device (the default pool's device 0)."""
    proc = Child(capacity=256 * MIB)
    yield proc
    proc.exit()


@pytest.fixture(scope="module")
def vchild():
    """An importer whose own memory is shareable virtual memory (pages of PAGE)."""
    proc = Child(capacity=256 * MIB, shareable=True, virtual_memory=True, page=PAGE)
    yield proc
    proc.exit()


def segment_base(sim, handle, buf):
    """The start of the simulated allocation the handle names (checked to be one)."""
    base = buf.ptr - handle.offset
    assert base in sim._shared and sim._arrays[base][1] == handle.alloc_bytes
    return base


# The handle: bytes and pickling ----------------------------------------------------------

def handle_fields(kind="mem_handle", npages=1):
    """A strategy of valid handle fields."""
    u64 = st.integers(1, 2**63 - 1)
    page = 2 * MIB
    alloc = st.just(page * npages) if kind == "posix_fd" else st.integers(512, 2**40)
    return st.fixed_dictionaries({
        "kind": st.just(kind), "simulated": st.booleans(), "pid": st.integers(1, 2**31 - 1),
        "fd_pid": st.integers(1, 2**31 - 1), "device": st.integers(0, 64),
        "device_uuid": st.binary(min_size=16, max_size=16), "buffer_slot": u64,
        "buffer_serial": u64, "alloc_bytes": alloc,
        "table": st.text(min_size=1, max_size=80).filter(lambda t: "\x00" not in t),
        "event": st.binary(max_size=64),
    }).flatmap(lambda f: st.fixed_dictionaries({
        **{k: st.just(v) for k, v in f.items()},
        "offset": st.integers(0, min(f["alloc_bytes"] - 1, page - 1)),
    })).flatmap(lambda f: st.fixed_dictionaries({
        **{k: st.just(v) for k, v in f.items()},
        "nbytes": st.integers(1, f["alloc_bytes"] - f["offset"]),
        "segment_slot": st.just(0) if kind == "posix_fd" else u64,
        "segment_serial": st.just(0) if kind == "posix_fd" else u64,
        "page_bytes": st.just(page if kind == "posix_fd" else 0),
        "mem": st.just(b"") if kind == "posix_fd" else st.binary(min_size=1, max_size=64),
        "remote_fds": st.lists(st.integers(0, 2**31 - 1), min_size=npages, max_size=npages)
        if kind == "posix_fd" else st.just(()),
    }))


any_handle_fields = st.one_of(handle_fields(), st.integers(1, 8).flatmap(
    lambda n: handle_fields("posix_fd", n)))


@given(any_handle_fields)
@settings(max_examples=200, deadline=None)
def test_a_handle_round_trips_through_its_bytes_and_plain_pickle(fields):
    handle = gpupool.IpcHandle(**fields)
    assert gpupool.IpcHandle.from_bytes(handle.to_bytes()) == handle
    assert pickle.loads(pickle.dumps(handle)) == handle
    assert ForkingPickler.loads(ForkingPickler.dumps(handle)) == handle
    assert set(handle.fields()) == set(FIELDS)


@given(st.binary(max_size=400))
@settings(max_examples=300, deadline=None)
def test_garbage_bytes_are_refused_as_malformed(data):
    with pytest.raises(gpupool.IpcError) as info:
        gpupool.IpcHandle.from_bytes(data)
    assert info.value.reason == "malformed"
    assert str(info.value).startswith("not a gpupool IPC handle: ")


@given(handle_fields(), st.data())
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_truncated_or_altered_handle_is_refused(fields, data):
    raw = gpupool.IpcHandle(**fields).to_bytes()
    cut = data.draw(st.integers(0, len(raw) - 1))
    flip = data.draw(st.integers(0, len(raw) - 1))
    altered = bytearray(raw)
    altered[flip] ^= data.draw(st.integers(1, 255))
    for bad in (raw[:cut], bytes(altered)):
        with pytest.raises(gpupool.IpcError) as info:
            gpupool.IpcHandle.from_bytes(bad)
        assert info.value.reason == "malformed"


def test_open_ipc_refuses_what_is_not_a_handle(mpool):
    with pytest.raises(TypeError, match="IpcHandle or its bytes"):
        gpupool.open_ipc(12345)
    with pytest.raises(gpupool.IpcError, match="not a gpupool IPC handle") as info:
        gpupool.open_ipc(b"\x00" * 300, pool=mpool)
    assert info.value.reason == "malformed"
    with pytest.raises(TypeError, match="IpcHandle needs the fields"):
        gpupool.IpcHandle(kind="mem_handle")
    handle = mpool.allocate(100).ipc_handle()
    with pytest.raises(AttributeError, match="immutable"):
        handle.nbytes = 5
    error = pickle.loads(pickle.dumps(gpupool.IpcError("why", "released")))
    assert (str(error), error.reason) == ("why", "released")


def test_a_posix_fd_handle_carries_its_descriptors_through_multiprocessings_pickler():
    fds = [os.memfd_create(f"page{i}") for i in range(3)]
    fields = dict(kind="posix_fd", simulated=True, pid=os.getpid(), fd_pid=os.getpid(),
                  device=0, device_uuid=b"u" * 16, buffer_slot=1, buffer_serial=1,
                  segment_slot=0, segment_serial=0, offset=100, nbytes=1000,
                  alloc_bytes=3 * PAGE, page_bytes=PAGE, table="t", mem=b"", event=b"",
                  remote_fds=fds)
    handle = gpupool.IpcHandle(**fields, fds=[os.dup(fd) for fd in fds])
    received = ForkingPickler.loads(ForkingPickler.dumps(handle))
    assert received == handle
    assert [os.fstat(fd).st_ino for fd in received.fds] == [os.fstat(fd).st_ino for fd in fds]
    assert set(received.fds).isdisjoint(fds) and set(received.fds).isdisjoint(handle.fds)
    owned = received.fds
    del received
    gc.collect()
    for fd in owned:                            # the handle closed what it owned
        with pytest.raises(OSError):
            os.fstat(fd)
    # Relayed with plain pickle, a handle holding descriptors names them in this process.
    relayed = pickle.loads(pickle.dumps(ForkingPickler.loads(ForkingPickler.dumps(handle))))
    assert relayed.fd_pid == os.getpid()
    for fd in fds:
        os.close(fd)


# Exports on the simulated device ------------------------------------------------------

def test_blocks_cut_from_one_segment_export_their_offsets_in_it(mpool, msim):
    bufs = [mpool.allocate(n) for n in (1000, 4096, 70_000, 512)]
    handles = [b.ipc_handle() for b in bufs]
    bases = {segment_base(msim, h, b) for h, b in zip(handles, bufs, strict=True)}
    assert len(bases) == 1                      # one shared segment holds them all
    base = bases.pop()
    assert len({(h.segment_slot, h.segment_serial, h.mem) for h in handles}) == 1
    assert len({h.buffer_slot for h in handles}) == 4
    for h, b in zip(handles, bufs, strict=True):
        assert (h.kind, h.nbytes, h.simulated, h.device) == ("mem_handle", b.nbytes, True, 0)
        assert h.offset == b.ptr - base
    assert sorted(h.offset for h in handles) == [0, 1024, 5120, 75264]
    big = mpool.allocate(30 * MIB)              # a segment of its own
    h = big.ipc_handle()
    assert h.offset == 0 and segment_base(msim, h, big) == big.ptr
    assert h.alloc_bytes >= 30 * MIB and h.segment_slot != handles[0].segment_slot


def test_blocks_of_expandable_segments_export_their_pages(vpool, vsim):
    a = vpool.allocate(100 * KIB)
    b = vpool.allocate(50 * KIB)                # starts inside a's last page
    for buf in (a, b):
        h = buf.ipc_handle()
        first = buf.ptr - h.offset
        assert h.kind == "posix_fd" and h.page_bytes == PAGE and 0 <= h.offset < PAGE
        assert (first - min(vsim._ranges)) % PAGE == 0      # pages from the range's start
        assert h.alloc_bytes == len(h.remote_fds) * PAGE >= h.offset + buf.nbytes
        assert h.alloc_bytes - PAGE < h.offset + buf.nbytes   # no page more than needed
        assert len(h.fds) == len(h.remote_fds) and set(h.fds).isdisjoint(h.remote_fds)
        assert (h.segment_slot, h.mem) == (0, b"")


def test_a_buffers_handle_is_retired_with_its_block(mpool, msim):
    region = gpupool.Region(pool=mpool, on_exit="invalidate")
    ways = {}
    ways["closed"] = mpool.allocate(1000)
    ways["freed"] = mpool.allocate(1000)
    with region:
        ways["invalidated"] = mpool.allocate(1000)
        handles = {way: buf.ipc_handle() for way, buf in ways.items()}
    ways["closed"].close()
    del ways["freed"]
    for way, h in handles.items():
        serial, state, opened = mapping._slot_state(h.table, h.buffer_slot)
        assert (serial, state, opened) == (h.buffer_serial, RETIRED, 0), way
    kept = mpool.allocate(1000)
    h = kept.ipc_handle()
    assert mapping._slot_state(h.table, h.buffer_slot)[1] == 1        # live


def test_exporting_a_buffer_again_reuses_its_slot_and_event(mpool, msim):
    buf = mpool.allocate(1000)
    s = msim.create_stream()
    first, again, on_s = buf.ipc_handle(), buf.ipc_handle(), buf.ipc_handle(stream=s)
    assert first.buffer_slot == again.buffer_slot == on_s.buffer_slot
    assert first.event == again.event
    assert len(msim.calls_named("ipc_event_create")) == 1
    records = msim.calls_named("ipc_event_record")
    assert [stream for _, stream in records] == [0, 0, s]      # the buffer's, then s


def test_collect_forgets_given_back_exports_and_reuses_their_slots(mpool, msim):
    export.collect()
    start = export._stats()
    for _ in range(300):
        buf = mpool.allocate(4096)
        buf.ipc_handle()
        buf.close()
    export.collect()
    stats = export._stats()
    assert stats["records"] - start["records"] <= 1     # the shared segment's record stays
    assert stats["used_slots"] - start["used_slots"] <= 1
    assert len(msim.calls_named("ipc_event_destroy")) >= 299
    check_invariants(mpool)
    assert mpool.stats().in_use_bytes == 0


def test_a_posix_fd_exports_descriptors_close_with_the_buffer(vpool):
    buf = vpool.allocate(3 * PAGE)
    h = buf.ipc_handle()
    remote = h.remote_fds
    os.fstat(remote[0])
    del buf
    gc.collect()
    for fd in remote:                           # the export's own descriptors are closed
        with pytest.raises(OSError):
            os.fstat(fd)
    assert len(h.fds) == 3                      # the handle's stay until it dies


def test_trim_keeps_a_segment_that_an_importer_holds_open(mpool, msim):
    buf = mpool.allocate(1000)
    h = buf.ipc_handle()
    reserved = mpool.stats().reserved_bytes
    table._add_to_slot(h.table, h.segment_slot, 1)           # what an importer's open does
    del buf
    export.collect()                                          # a live importer's count stays
    assert mpool.trim() == 0 and mpool.stats().reserved_bytes == reserved
    assert msim.calls_named("free") == []
    table._add_to_slot(h.table, h.segment_slot, -1)          # ... and its close
    assert mpool.trim() == reserved and msim.calls_named("free") != []
    assert mapping._slot_state(h.table, h.segment_slot)[1] == RETIRED
    check_invariants(mpool)


def test_a_pool_that_ends_leaves_an_imported_segment_allocated():
    sim = SimulatedDevice(shareable=True)
    pool = gpupool.Pool(upstream=sim)
    h = pool.allocate(1000).ipc_handle()
    table._add_to_slot(h.table, h.segment_slot, 1)
    del pool
    gc.collect()
    assert sim.calls_named("free") == [] and sim.errors == []
    table._add_to_slot(h.table, h.segment_slot, -1)


# Errors ------------------------------------------------------------------------------

def test_a_handle_opened_in_its_own_process_is_refused(mpool):
    h = mpool.allocate(1000).ipc_handle()
    for handle in (h, h.to_bytes()):
        with pytest.raises(gpupool.IpcError, match="made in this process") as info:
            gpupool.open_ipc(handle)
        assert info.value.reason == "same_process"


class Foreign:
    def __init__(self, array):
        self.array = array
        self.__cuda_array_interface__ = {"shape": (array.nbytes,), "typestr": "|u1",
                                         "data": (array.ctypes.data, False), "version": 3,
                                         "strides": None, "stream": None}


def test_memory_gpupool_does_not_own_is_refused(mpool):
    wrapped = gpupool.as_buffer(Foreign(np.zeros(4096, np.uint8)), pool=mpool)
    with pytest.raises(gpupool.IpcError, match="wraps memory that gpupool does not own") as info:
        wrapped.ipc_handle()
    assert info.value.reason == "foreign_memory"
    assert "copy it into a gpupool buffer" in str(info.value)
    # A wrapper of a gpupool buffer exports that buffer's memory, at its own address.
    buf = mpool.allocate(8192)
    view = gpupool.as_buffer(buf.view(np.uint8, (8192,)))
    assert view.ipc_handle().offset == buf.ipc_handle().offset


def test_an_array_of_gpupool_memory_made_by_an_adapter_exports_its_buffer(mpool):
    # As a CuPy array of gpupool.cupy's allocator: only its interface reaches as_buffer, and
    # the DeviceBuffer holding the block (the array's memory owner) is what is exported.
    buf = mpool.allocate(8192)
    array = Foreign(np.zeros(1, np.uint8))
    array.__cuda_array_interface__ = dict(buf.__cuda_array_interface__, shape=(4096,),
                                          data=(buf.ptr + 1024, False))
    h = gpupool.as_buffer(array, pool=mpool).ipc_handle()   # the wrapper may go at once
    own = buf.ipc_handle()
    assert (h.offset, h.nbytes) == (own.offset + 1024, 4096)
    assert (h.buffer_slot, h.buffer_serial) == (own.buffer_slot, own.buffer_serial)
    del array
    assert mapping._slot_state(h.table, h.buffer_slot)[1] == 1          # the buffer holds it
    buf.close()
    assert mapping._slot_state(h.table, h.buffer_slot)[1] == RETIRED


def test_an_array_of_c_api_memory_exports_while_it_lives(mpool, default_pools):
    # As a PyTorch tensor under gpupool.torch.use(): a block of the C API, no DeviceBuffer.
    gpupool.set_pool(mpool)
    from gpupool.adapters import torch_entry

    ptr = torch_entry._torch_malloc(8192, 0, 0)
    array = Foreign(np.zeros(1, np.uint8))
    array.__cuda_array_interface__ = {"shape": (8192,), "typestr": "|u1", "version": 3,
                                      "data": (ptr, False), "strides": None, "stream": None}
    h = gpupool.as_buffer(array, pool=mpool).ipc_handle()
    assert h.nbytes == 8192 and mapping._slot_state(h.table, h.buffer_slot)[1] == 1
    del array
    export.collect()                                  # the array died: its export with it
    assert mapping._slot_state(h.table, h.buffer_slot)[1] != 1
    torch_entry._torch_free(ptr, 8192, 0, 0)


def test_memory_of_an_upstream_without_ipc_is_refused_naming_the_alternative():
    for sim in (SimulatedDevice(), SimulatedDevice(stream_ordered=True)):
        buf = gpupool.Pool(upstream=sim).allocate(1000)
        with pytest.raises(gpupool.IpcError, match=r"SimulatedDevice\(shareable=True\)") as info:
            buf.ipc_handle()
        assert info.value.reason == "not_exportable"
    with pytest.raises(ValueError, match="cannot be shareable"):
        SimulatedDevice(stream_ordered=True, shareable=True)
    refusal = gpupool.upstream.mempool._ASYNC_REFUSAL           # AsyncUpstream's (a GPU's) message
    assert "'async'" in refusal and "upstream 'vmm'" in refusal and "'driver'" in refusal


def test_empty_closed_and_forked_buffers_are_refused(mpool):
    with pytest.raises(ValueError, match="empty buffer"):
        mpool.allocate(0).ipc_handle()
    buf = mpool.allocate(100)
    buf.close()
    with pytest.raises(gpupool.InvalidBufferError):
        buf.ipc_handle()


def test_a_simulated_handle_needs_a_simulated_pool(mpool, default_pools):
    h = mpool.allocate(1000).ipc_handle()
    fields = h.fields()
    fields.update(table="/nonexistent/other-process", pid=1)
    other = gpupool.IpcHandle(**fields)         # as if another process had made it
    gpupool._pools.pop(0, None)
    gpupool.core.defaults._forget(0)
    with pytest.raises(gpupool.IpcError, match="pool on a gpupool.testing.SimulatedDevice") \
            as info:
        gpupool.open_ipc(other)
    assert info.value.reason == "wrong_device"
    elsewhere = gpupool.Pool(upstream=SimulatedDevice(uuid=b"another GPU UUID"))
    with pytest.raises(gpupool.IpcError, match="GPU-") as info:
        gpupool.open_ipc(other, pool=elsewhere)
    assert info.value.reason == "wrong_device"
    with pytest.raises(TypeError, match="pool must be a gpupool.Pool"):
        gpupool.open_ipc(other, pool="pool")
    with pytest.raises(gpupool.IpcError, match="has exited") as info:
        gpupool.open_ipc(other, pool=mpool)     # no such table: its process is gone
    assert info.value.reason == "exporter_exited"


# Two processes --------------------------------------------------------------------------

def test_another_process_reads_and_writes_the_exporters_bytes(mpool, msim, child):
    a, b = mpool.allocate(100_000), mpool.allocate(5000)     # one segment
    a.memset(1)
    b.memset(2)
    assert child.call("open", "a", a.ipc_handle(), {}) == 100_000
    assert child.call("open", "b", b.ipc_handle().to_bytes(), {}) == 5000   # as bytes
    assert child.call("read", "a") == b"\x01" * 100_000
    assert child.call("sum", "b") == 2 * 5000
    child.call("write", "a", 7)
    assert (a.copy_to_host() == 7).all()        # one memory: no copy either way
    stats = child.call("stats")
    assert stats["ipc"]["cached_mappings"] == 1            # one mapping of the segment
    assert [c[0] for c in stats["calls"]].count("ipc_open") == 1
    assert len([c for c in stats["calls"] if c[0] == "ipc_wait"]) == 2
    child.call("close", "a")
    child.call("drop", "b")                     # dying does what close does
    stats = child.call("stats")
    assert stats["ipc"]["mappings"] == 0 and stats["errors"] == []
    assert [c[0] for c in stats["calls"]].count("ipc_close") == 1
    assert stats["pool"]["in_use_bytes"] == 0   # opened memory is not the importer's pool's


def test_trim_keeps_a_segment_another_process_holds_open(mpool, msim, child):
    buf = mpool.allocate(1000)
    h = buf.ipc_handle()
    child.call("open", "x", h, {})
    reserved = mpool.stats().reserved_bytes
    del buf
    assert mpool.trim() == 0                    # the child still maps the segment
    assert mpool.stats().reserved_bytes == reserved and msim.calls_named("free") == []
    assert mapping._slot_state(h.table, h.segment_slot)[2] == 1
    child.call("close", "x")
    assert mapping._slot_state(h.table, h.segment_slot)[2] == 0
    assert mpool.trim() == reserved             # now it goes back, and the sim saw no
    check_invariants(mpool)                     # free of memory still open (msim.errors)


def test_an_importer_killed_without_closing_pins_the_segment_until_collect(mpool, msim):
    importer = Child(capacity=64 * MIB)
    buf = mpool.allocate(1000)
    h = buf.ipc_handle()
    importer.call("open", "x", h, {})
    importer.process.kill()                     # no close, no exit handler
    importer.process.join(30)
    del buf
    reserved = mpool.stats().reserved_bytes
    assert mpool.trim() == 0 and mapping._slot_state(h.table, h.segment_slot)[2] == 1
    export.collect()                              # no lock backs the count: forgotten
    assert mapping._slot_state(h.table, h.segment_slot)[2] == 0
    assert mpool.trim() == reserved


def refused_after_close(pool, peer):
    """A buffer of pool exported, then closed: peer's open of the handle is refused."""
    buf = pool.allocate(1000)
    handle = buf.ipc_handle()
    buf.close()
    reason, message = peer.refused("open", "x", handle, {})
    assert reason == "released" and "gave this buffer back" in message


def test_a_handle_opened_after_its_buffer_was_given_back_is_refused(mpool, child):
    refused_after_close(mpool, child)
    buf = mpool.allocate(1000)
    h = buf.ipc_handle()
    del buf
    mpool.trim()                                # the segment went back too
    reason, _ = child.refused("open", "x", h, {})
    assert reason == "released"
    assert child.call("stats")["ipc"]["mappings"] == 0


def test_handles_of_another_device_are_refused(mpool):
    other = Child(capacity=64 * MIB, uuid=b"another GPU UUID")
    buf = mpool.allocate(100)
    try:
        reason, message = other.refused("open", "x", buf.ipc_handle(), {})
        assert reason == "wrong_device" and "GPU-" in message
    finally:
        other.exit()


def test_memory_opened_from_another_process_cannot_be_exported_again(mpool, child):
    buf = mpool.allocate(1000)                  # alive while the child uses it (the rule)
    child.call("open", "x", buf.ipc_handle(), {})
    reason, message = child.refused("reexport", "x")
    assert reason == "received" and "buf.copy()" in message
    child.call("close", "x")


@pytest.mark.parametrize("how", ["normal", "crash"])
def test_a_handle_of_an_exporter_that_exited_is_refused(how):
    exporter = Child(capacity=64 * MIB, shareable=True)
    h = exporter.call("export", "x", 4096, 5)
    exporter.exit(how)                          # "crash": no atexit, its table stays behind
    pool = gpupool.Pool(upstream=SimulatedDevice())
    with pytest.raises(gpupool.IpcError, match="has exited") as info:
        gpupool.open_ipc(h, pool=pool)
    assert info.value.reason == "exporter_exited"
    assert os.path.exists(h.table) == (how == "crash")
    table.remove_stale_tables(os.path.dirname(h.table))     # as the next exporter does
    assert not os.path.exists(h.table)


def test_pages_travel_by_descriptor_passing_and_by_pidfd(vpool, child):
    buf = vpool.allocate(3 * PAGE + 100)
    buf.memset(9)
    h = buf.ipc_handle()
    assert child.call("open", "q", h, {}) == buf.nbytes             # a Pipe: DupFd
    assert child.call("open", "p", pickle.dumps(h), {}) == buf.nbytes   # plain: pidfd_getfd
    assert child.call("read", "p") == b"\x09" * buf.nbytes
    child.call("write", "q", 4)
    assert (buf.copy_to_host() == 4).all()
    child.call("close", "q")
    child.call("close", "p")
    stats = child.call("stats")
    assert stats["ipc"]["mappings"] == 0 and stats["errors"] == []


def test_pages_whose_descriptors_cannot_be_fetched_are_refused_saying_why(vpool):
    importer = Child(capacity=64 * MIB)
    try:
        importer.call("deny_pidfd")
        buf = vpool.allocate(PAGE)
        h = buf.ipc_handle()
        reason, message = importer.refused("open", "x", pickle.dumps(h), {})
        assert reason == "no_descriptors"
        assert "pidfd_getfd" in message and "multiprocessing Queue or Pipe" in message
        assert importer.call("open", "y", h, {}) == PAGE            # the Pipe's way works
        importer.call("close", "y")
    finally:
        importer.exit()


def test_an_importer_on_virtual_memory_opens_both_kinds(mpool, vpool, vchild):
    a, b = mpool.allocate(1000), vpool.allocate(1000)
    a.memset(3)
    b.memset(4)
    vchild.call("open", "a", a.ipc_handle(), {})
    vchild.call("open", "b", b.ipc_handle(), {})
    assert vchild.call("read", "a") == b"\x03" * 1000
    assert vchild.call("read", "b") == b"\x04" * 1000
    vchild.call("close", "a")
    vchild.call("close", "b")
    assert vchild.call("stats")["errors"] == []


def test_many_export_open_close_rounds_leave_both_pools_exact(mpool, vpool, child):
    for pool in (mpool, vpool):
        before = pool.stats()
        for i in range(150):
            buf = pool.allocate(1000 + 512 * (i % 7))
            buf.memset(i % 256)
            child.call("open", "r", buf.ipc_handle(), {})
            assert child.call("sum", "r") == (i % 256) * buf.nbytes
            child.call("close", "r")
            del buf
        export.collect()
        after = check_invariants(pool)
        assert after.in_use_bytes == before.in_use_bytes == 0
        assert after.reserved_bytes == before.reserved_bytes or before.reserved_bytes == 0
        assert export._stats()["used_slots"] <= 4
        stats = child.call("stats")
        assert stats["ipc"]["mappings"] == 0 and stats["errors"] == []
        assert stats["pool"]["in_use_bytes"] == 0 and stats["pool"]["reserved_bytes"] == 0


# On a GPU (marked gpu) -----------------------------------------------------------------

@pytest.fixture(params=UPSTREAMS)
def upstream(request):
    return request.param


@pytest.fixture
def gpu_pool(upstream):
    return gpupool.Pool(device=0, upstream=upstream)


@pytest.fixture
def server(upstream):
    """Another process with a pool on GPU 0 on the same upstream."""
    proc = Child(target="serve", upstream=upstream)
    yield proc
    proc.exit()


@pytest.fixture
def slow_write():
    """``slow_write(ptr, stream)``: after about 2 s, 42 in every byte of [ptr, ptr + N)."""
    kernel = cupy.RawKernel(SLOW_WRITE, "slow_write")

    def launch(ptr, stream):
        with stream:
            kernel((64,), (256,), (cupy.uint64(ptr), cupy.int64(N), cupy.int64(SPIN)))

    return launch


@pytest.mark.gpu
@needs_cupy
@pytest.mark.parametrize("framework", ["cupy", "numba", "torch"])
def test_a_consumer_process_sees_the_final_bytes_of_a_slow_kernel(gpu_pool, slow_write, framework):
    if framework != "cupy":
        pytest.importorskip("numba.cuda" if framework == "numba" else "torch")
    reader = Child(target="consume", framework=framework)
    try:
        reader.call("ready")                    # its framework and CUDA are up
        s = cupy.cuda.Stream(non_blocking=True)
        buf = gpu_pool.allocate(N, stream=s.ptr)
        buf.memset(0, stream=s.ptr)
        slow_write(buf.ptr, s)                  # still running when the consumer reads
        handle = buf.ipc_handle()               # its event: after the kernel, on s
        reader.conn.send(("read", handle))
        assert reader.conn.poll(60) and reader.conn.recv() == ("opened", None)
        assert not s.done, "the kernel ended before the consumer opened: the test proves nothing"
        reply = reader.conn.recv()
        assert reply == ("ok", (N, N)), reply   # every byte 42: the consumer waited
        reader.call("close")
        del buf                                 # only now: the exporter's rule
    finally:
        reader.exit()


@pytest.mark.gpu
@needs_cupy
def test_1000_export_open_close_rounds_leave_both_pools_exact(gpu_pool, server):
    server.call("stats")                        # its context is made: not counted below
    export.collect()
    slots = export._stats()["used_slots"]         # other tests' exports not yet forgotten
    before_free = gpu_pool.mem_info()[0]
    for i in range(1000):
        buf = gpu_pool.allocate(4096 + 65536 * (i % 5))
        server.call("open", "r", buf.ipc_handle(), {})
        server.call("close", "r")
        del buf
    export.collect()
    stats = gpu_pool.stats()
    assert stats.in_use_bytes == 0
    assert gpu_pool.trim() == stats.reserved_bytes and gpu_pool.stats().reserved_bytes == 0
    export.collect()
    assert export._stats()["used_slots"] <= slots     # every export of the rounds forgotten
    theirs = server.call("stats")
    assert theirs["ipc"]["mappings"] == 0 and theirs["ipc"]["cached_mappings"] == 0
    assert theirs["pool"]["in_use_bytes"] == 0 and theirs["pool"]["reserved_bytes"] == 0
    # No page kept alive by a descriptor or a mapping: the device's free memory came back.
    assert gpu_pool.mem_info()[0] >= before_free - 64 * MIB


@pytest.mark.gpu
@needs_cupy
def test_a_segment_another_process_holds_open_stays(gpu_pool, server, upstream):
    buf = gpu_pool.allocate(MIB)
    buf.memset(5)
    server.call("open", "x", buf.ipc_handle(), {})
    reserved = gpu_pool.stats().reserved_bytes
    del buf
    released = gpu_pool.trim()
    if upstream == "driver":                    # the cuMemAlloc segment is still mapped there
        assert released == 0 and gpu_pool.stats().reserved_bytes == reserved
    else:                                       # the importer's mapping holds the pages
        assert gpu_pool.stats().reserved_bytes < reserved
    assert server.call("read", "x") == b"\x05" * MIB
    server.call("close", "x")
    gpu_pool.trim()
    assert gpu_pool.stats().reserved_bytes == 0


@pytest.mark.gpu
@needs_cupy
def test_pages_travel_through_a_pipe_and_by_pidfd(server, upstream):
    if upstream != "vmm":
        pytest.skip("page descriptors are the vmm upstream's")
    pool = gpupool.Pool(device=0, upstream="vmm")
    buf = pool.allocate(3 * MIB)
    buf.memset(8)
    handle = buf.ipc_handle()
    assert handle.kind == "posix_fd" and len(handle.fds) >= 2
    server.call("open", "q", handle, {})
    assert server.call("read", "q") == b"\x08" * (3 * MIB)
    reply = server.ask("open", "p", pickle.dumps(handle), {})   # plain pickle: pidfd_getfd
    if reply[0] == "ok":
        assert server.call("read", "p") == b"\x08" * (3 * MIB)
        server.call("close", "p")
    else:                                       # a container that forbids it: said so
        assert reply[2] == "no_descriptors" and "pidfd_getfd" in reply[3], reply
    server.call("close", "q")


@pytest.mark.gpu
@needs_cupy
def test_a_cupy_array_of_gpupool_s_allocator_is_shared_through_as_buffer(gpu_pool, server):
    import gpupool.cupy

    with cupy.cuda.using_allocator(gpupool.cupy.allocator(gpu_pool)):
        x = cupy.full(MIB, 6, dtype=cupy.uint8)
    handle = gpupool.as_buffer(x, pool=gpu_pool).ipc_handle()  # the DeviceBuffer behind x
    server.call("open", "c", handle, {})
    assert server.call("read", "c") == b"\x06" * MIB
    server.call("close", "c")
    del x


# Errors on the real driver --------------------------------------------------------------

@pytest.mark.gpu
@needs_cupy
def test_a_handle_opened_in_its_own_process_is_refused_on_a_gpu(gpu_pool):
    buf = gpu_pool.allocate(1000)
    with pytest.raises(gpupool.IpcError) as info:
        gpupool.open_ipc(buf.ipc_handle())
    assert info.value.reason == "same_process"


@pytest.mark.gpu
@needs_cupy
def test_a_handle_of_a_gpu_this_process_does_not_see_is_refused(gpu_pool, server):
    buf = gpu_pool.allocate(1000)
    fields = buf.ipc_handle().fields()
    fields["device_uuid"] = bytes(16)           # no GPU has it
    reason, message = server.refused("open", "x", gpupool.IpcHandle(**fields), {})
    assert reason == "wrong_device" and "does not see" in message


@pytest.mark.gpu
@needs_cupy
def test_a_handle_opened_on_another_devices_pool_is_refused(gpu_pool, server):
    if len(gpupool.driver.calls.device_uuids()) < 2:
        pytest.skip("needs two GPUs")
    buf = gpu_pool.allocate(1000)
    reason, _ = server.refused("open", "x", buf.ipc_handle(), {"pool_device": 1})
    assert reason == "wrong_device"


@pytest.mark.gpu
@needs_cupy
def test_a_handle_opened_after_its_buffer_was_given_back_is_refused_on_a_gpu(gpu_pool, server):
    refused_after_close(gpu_pool, server)


@pytest.mark.gpu
@needs_cupy
def test_a_handle_of_an_exporter_that_exited_is_refused_on_a_gpu(upstream):
    exporter = Child(target="serve", upstream=upstream)
    handle = exporter.call("export", "x", MIB, 3)
    exporter.exit()
    with pytest.raises(gpupool.IpcError) as info:
        gpupool.open_ipc(handle)
    assert info.value.reason == "exporter_exited"


@pytest.mark.gpu
@needs_cupy
def test_garbage_and_a_corrupted_driver_handle_are_refused_without_a_crash(server):
    reason, _ = server.refused("open", "x", b"\x00" * 200, {})
    assert reason == "malformed"
    pool = gpupool.Pool(device=0, upstream="driver")
    buf = pool.allocate(1000)
    fields = buf.ipc_handle().fields()
    fields["mem"] = bytes(64)                   # the slots are right, the driver's handle not
    reason, message = server.refused("open", "x", gpupool.IpcHandle(**fields), {})
    assert reason == "open_failed" and "driver refused" in message
    assert server.call("stats")["ipc"]["mappings"] == 0


@pytest.mark.gpu
@needs_cupy
def test_memory_gpupool_does_not_own_is_refused_on_a_gpu():
    wrapped = gpupool.as_buffer(cupy.zeros(4096, dtype=cupy.uint8))
    with pytest.raises(gpupool.IpcError) as info:
        wrapped.ipc_handle()
    assert info.value.reason == "foreign_memory"


@pytest.mark.gpu
@needs_cupy
def test_memory_of_the_async_upstream_is_refused_naming_the_alternatives():
    buf = gpupool.Pool(device=0, upstream="async").allocate(1000)
    with pytest.raises(gpupool.IpcError, match="upstream 'vmm'") as info:
        buf.ipc_handle()
    assert info.value.reason == "not_exportable" and "'driver'" in str(info.value)


@pytest.mark.gpu
@needs_cupy
def test_vmm_pages_are_requested_shareable():
    upstream = gpupool.VmmUpstream(0)
    assert upstream.shareable, upstream.ipc_refusal    # the H200 supports POSIX fds
    assert gpupool.VmmUpstream(0, shareable=False).ipc_refusal.endswith("GPUPOOL_UPSTREAM=driver")


# torch.multiprocessing under gpupool.torch ---------------------------------------------

@pytest.mark.gpu
@needs_cupy
@pytest.mark.parametrize("upstream_name", UPSTREAMS)
@pytest.mark.parametrize("scenario", ["use-native", "mempool-native", "use-use", "mempool-use",
                                      "native-use", "resend"])
def test_torch_multiprocessing_shares_tensors_of_gpupool_memory(scenario, upstream_name):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA GPU")
    proc = subprocess.run([sys.executable, str(TORCH_CHILD), scenario], capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "GPUPOOL_UPSTREAM": upstream_name})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    if scenario == "native-use":    # PyTorch's own handle, received under use(): said so
        assert result["error"][0] == "IpcError" and "mempool() here" in result["error"][1]
    elif scenario == "resend":
        assert result["error"][0] == "IpcError" and "clone it first" in result["error"][1]
    else:
        assert result["error"] is None and result["checks"] == [True] * 4, result

