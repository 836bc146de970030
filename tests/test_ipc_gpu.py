"""CUDA IPC on a GPU (marked gpu), on both upstreams that export ("driver": cuIpcGetMemHandle
of the segment; "vmm": a POSIX file descriptor per page). The producer is this process, which
writes with a slow kernel through CuPy; consumers are other processes (tests/ipc_child.py)
reading through CuPy, Numba and PyTorch, which must see the kernel's final bytes; 1,000
export / open / close rounds leave both pools' accounting exact; every error path on the real
driver; torch.multiprocessing under gpupool.torch (tests/ipc_torch_child.py). The CPU twin:
tests/test_ipc.py."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SLOW_WRITE
from test_ipc import Child

import gpupool
from gpupool.ipc import export

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

MIB = 1 << 20
N = 8 * MIB
SPIN = 4_000_000_000        # clock cycles, about 2 s on an H200: longer than a consumer's open
UPSTREAMS = ["driver", "vmm"]
TORCH_CHILD = Path(__file__).resolve().parent / "ipc_torch_child.py"


@pytest.fixture(params=UPSTREAMS)
def upstream(request):
    return request.param


@pytest.fixture
def pool(upstream):
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


@pytest.mark.parametrize("framework", ["cupy", "numba", "torch"])
def test_a_consumer_process_sees_the_final_bytes_of_a_slow_kernel(pool, slow_write, framework):
    if framework != "cupy":
        pytest.importorskip("numba.cuda" if framework == "numba" else "torch")
    reader = Child(target="consume", framework=framework)
    try:
        reader.call("ready")                    # its framework and CUDA are up
        s = cupy.cuda.Stream(non_blocking=True)
        buf = pool.allocate(N, stream=s.ptr)
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


def test_1000_export_open_close_rounds_leave_both_pools_exact(pool, server):
    server.call("stats")                        # its context is made: not counted below
    export.collect()
    slots = export._stats()["used_slots"]         # other tests' exports not yet forgotten
    before_free = pool.mem_info()[0]
    for i in range(1000):
        buf = pool.allocate(4096 + 65536 * (i % 5))
        server.call("open", "r", buf.ipc_handle(), {})
        server.call("close", "r")
        del buf
    export.collect()
    stats = pool.stats()
    assert stats.in_use_bytes == 0
    assert pool.trim() == stats.reserved_bytes and pool.stats().reserved_bytes == 0
    export.collect()
    assert export._stats()["used_slots"] <= slots     # every export of the rounds forgotten
    theirs = server.call("stats")
    assert theirs["ipc"]["mappings"] == 0 and theirs["ipc"]["cached_mappings"] == 0
    assert theirs["pool"]["in_use_bytes"] == 0 and theirs["pool"]["reserved_bytes"] == 0
    # No page kept alive by a descriptor or a mapping: the device's free memory came back.
    assert pool.mem_info()[0] >= before_free - 64 * MIB


def test_a_segment_another_process_holds_open_stays(pool, server, upstream):
    buf = pool.allocate(MIB)
    buf.memset(5)
    server.call("open", "x", buf.ipc_handle(), {})
    reserved = pool.stats().reserved_bytes
    del buf
    released = pool.trim()
    if upstream == "driver":                    # the cuMemAlloc segment is still mapped there
        assert released == 0 and pool.stats().reserved_bytes == reserved
    else:                                       # the importer's mapping holds the pages
        assert pool.stats().reserved_bytes < reserved
    assert server.call("read", "x") == b"\x05" * MIB
    server.call("close", "x")
    pool.trim()
    assert pool.stats().reserved_bytes == 0


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


def test_a_cupy_array_of_gpupool_s_allocator_is_shared_through_as_buffer(pool, server):
    import gpupool.cupy

    with cupy.cuda.using_allocator(gpupool.cupy.allocator(pool)):
        x = cupy.full(MIB, 6, dtype=cupy.uint8)
    handle = gpupool.as_buffer(x, pool=pool).ipc_handle()   # the DeviceBuffer behind x
    server.call("open", "c", handle, {})
    assert server.call("read", "c") == b"\x06" * MIB
    server.call("close", "c")
    del x


# Errors on the real driver --------------------------------------------------------------

def test_a_handle_opened_in_its_own_process_is_refused(pool):
    buf = pool.allocate(1000)
    with pytest.raises(gpupool.IpcError) as info:
        gpupool.open_ipc(buf.ipc_handle())
    assert info.value.reason == "same_process"


def test_a_handle_of_a_gpu_this_process_does_not_see_is_refused(pool, server):
    buf = pool.allocate(1000)
    fields = buf.ipc_handle().fields()
    fields["device_uuid"] = bytes(16)           # no GPU has it
    reason, message = server.refused("open", "x", gpupool.IpcHandle(**fields), {})
    assert reason == "wrong_device" and "does not see" in message


def test_a_handle_opened_on_another_devices_pool_is_refused(pool, server):
    if len(gpupool.driver.calls.device_uuids()) < 2:
        pytest.skip("needs two GPUs")
    buf = pool.allocate(1000)
    reason, _ = server.refused("open", "x", buf.ipc_handle(), {"pool_device": 1})
    assert reason == "wrong_device"


def test_a_handle_opened_after_its_buffer_was_given_back_is_refused(pool, server):
    buf = pool.allocate(1000)
    handle = buf.ipc_handle()
    buf.close()
    reason, message = server.refused("open", "x", handle, {})
    assert reason == "released" and "gave this buffer back" in message


def test_a_handle_of_an_exporter_that_exited_is_refused(upstream):
    exporter = Child(target="serve", upstream=upstream)
    handle = exporter.call("export", "x", MIB, 3)
    exporter.exit()
    with pytest.raises(gpupool.IpcError) as info:
        gpupool.open_ipc(handle)
    assert info.value.reason == "exporter_exited"


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


def test_memory_gpupool_does_not_own_is_refused():
    wrapped = gpupool.as_buffer(cupy.zeros(4096, dtype=cupy.uint8))
    with pytest.raises(gpupool.IpcError) as info:
        wrapped.ipc_handle()
    assert info.value.reason == "foreign_memory"


def test_memory_of_the_async_upstream_is_refused_naming_the_alternatives():
    buf = gpupool.Pool(device=0, upstream="async").allocate(1000)
    with pytest.raises(gpupool.IpcError, match="upstream 'vmm'") as info:
        buf.ipc_handle()
    assert info.value.reason == "not_exportable" and "'driver'" in str(info.value)


def test_vmm_pages_are_requested_shareable():
    upstream = gpupool.VmmUpstream(0)
    assert upstream.shareable, upstream.ipc_refusal    # the H200 supports POSIX fds
    assert gpupool.VmmUpstream(0, shareable=False).ipc_refusal.endswith("GPUPOOL_UPSTREAM=driver")


# torch.multiprocessing under gpupool.torch ---------------------------------------------

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

