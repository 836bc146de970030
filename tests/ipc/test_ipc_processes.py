"""IPC between real processes: a second process (tests/ipc/ipc_child.py) opens handles of
this one's buffers on the simulated device (CPU), reads and writes their bytes, holds segments
open against trim, is killed without closing, opens pages by descriptor passing and by pidfd,
and is refused handles it may not open (given back, another device, exported again, of an
exporter that exited).

On a GPU (marked gpu), on both upstreams that export: the producer is this process, which
writes with a slow kernel through CuPy; consumers are other processes reading through CuPy,
Numba and PyTorch, which must see the kernel's final bytes; 1,000 export / open / close rounds
leave both pools' accounting exact; the refusals on the real driver."""

import os
import pickle

import pytest
from conftest import SLOW_WRITE, check_invariants, fresh_python
from ipc_peers import MIB, PAGE, Child, cupy, needs_cupy, needs_memfd
from ipc_peers import (  # noqa: F401 (fixtures)
    gpu_pool, mpool, msim, server, upstream, vpool, vsim)

import gpupool
from gpupool.ipc import export, mapping, table
from gpupool.testing import SimulatedDevice

N = 8 * MIB                 # the GPU tests' buffer
SPIN = 4_000_000_000        # clock cycles, about 2 s on an H200: longer than a consumer's open

pytestmark = needs_memfd


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


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_fork_child_s_exit_leaves_its_parent_s_export_table():
    # The child inherits the exit handler that removes the exporter's table: it runs in the
    # child's normal exit, and must leave the parent's table (before, every later open failed).
    result = fresh_python("""
import os, sys
sys.path.insert(0, "ipc")
import gpupool
from ipc_peers import Child
from gpupool.testing import SimulatedDevice

pool = gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 26, shareable=True))
buf = pool.allocate(4096)
buf.memset(7)
h = buf.ipc_handle()
pid = os.fork()
if pid == 0:
    sys.exit(0)                         # a normal exit: atexit handlers run
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), os.path.exists(h.table))
importer = Child(capacity=1 << 26, shareable=True)
print(importer.call("open", "x", h, {}), importer.call("sum", "x"))
importer.exit()
""", "-W", "ignore::DeprecationWarning")
    assert result.stdout == f"0 True\n4096 {7 * 4096}\n", result.stdout + result.stderr


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
