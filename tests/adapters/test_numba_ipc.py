"""Numba's IPC on gpupool memory of expandable segments (upstream "vmm"): the Numba plugin's
``get_ipc_handle`` gives a subclass of Numba's ``IpcHandle`` carrying gpupool's export.

On the CPU, with the fake Numba of fake_numba.py and shareable simulated virtual memory: the
handle's fields, its pickling (plain and multiprocessing's), another process opening it (mapped
directly or staged), reading and writing the exporter's bytes, closing, and the refusals. On a
GPU (marked gpu, real numba-cuda on upstream "vmm"): the cases of numba-cuda's own test_ipc.py.
"""

import ctypes
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap

import fake_numba
import pytest

import gpupool
import gpupool.adapters
from gpupool.testing import SimulatedDevice

KIB, MIB = 1 << 10, 1 << 20
PAGE = 64 * KIB
SPAWN = multiprocessing.get_context("spawn")
SHAREABLE = dict(capacity=64 * MIB, shareable=True, virtual_memory=True, page=PAGE)
PLUGIN_MODULES = ("gpupool.adapters.numba_manager", "gpupool.adapters.numba_ipc")

needs_memfd = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd (Linux)")


@pytest.fixture
def numba_fake():
    """The fake Numba in sys.modules, the plugin imported over it; all as before afterwards."""
    names = (*fake_numba.modules(), *PLUGIN_MODULES)
    saved = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    saved_attrs = {name: getattr(gpupool.adapters, name.rsplit(".", 1)[1], None)
                   for name in PLUGIN_MODULES}
    sys.modules.update(fake_numba.modules())
    try:
        yield sys.modules["numba.cuda"]
    finally:
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
        for name, attr in saved_attrs.items():
            short = name.rsplit(".", 1)[1]
            if attr is None:
                gpupool.adapters.__dict__.pop(short, None)
            else:
                setattr(gpupool.adapters, short, attr)


def _manager_for(pool):
    import gpupool.adapters.numba_manager as plugin

    fake_numba.Context.manager_class = plugin.GpupoolNumbaManager
    context = fake_numba.Context.__new__(fake_numba.Context)
    context.device = fake_numba.Device(0)
    context.memory_manager = plugin.GpupoolNumbaManager(context=context, pool=pool)
    return context.memory_manager


@pytest.fixture
def vpool():
    return gpupool.Pool(upstream=SimulatedDevice(**SHAREABLE))


@pytest.fixture
def manager(numba_fake, vpool):
    return _manager_for(vpool)


def _filled(manager, nbytes):
    """A Numba allocation of ``nbytes`` holding bytes 0, 1, 2, ... (mod 251)."""
    pointer = manager.memalloc(nbytes)
    data = bytes(i % 251 for i in range(nbytes))
    ctypes.memmove(pointer.device_pointer_value, data, nbytes)
    return pointer, data


class Child:
    """A spawned importer (numba_ipc_child.py) with the fake Numba and a simulated device."""

    def __init__(self):
        import numba_ipc_child

        self.conn, theirs = SPAWN.Pipe()
        self.process = SPAWN.Process(target=numba_ipc_child.serve, args=(theirs, SHAREABLE),
                                     daemon=True)
        self.process.start()
        theirs.close()

    def ask(self, *command):
        self.conn.send(command)
        assert self.conn.poll(60), f"the child did not answer {command[0]!r}"
        return self.conn.recv()

    def call(self, *command):
        reply = self.ask(*command)
        assert reply[0] == "ok", reply
        return reply[1]

    def exit(self):
        self.ask("exit")
        self.process.join(30)
        assert self.process.exitcode == 0


@pytest.fixture(scope="module")
def child():
    proc = Child()
    yield proc
    proc.exit()


def test_a_vmm_pool_gives_numba_a_handle_of_gpupool_s_export(manager, numba_fake):
    from gpupool.adapters.numba_ipc import GpupoolIpcHandle

    pointer, _ = _filled(manager, 3 * PAGE)
    view = pointer.view(1000, 1000 + PAGE + 24)         # over two pages, inside the block
    handle = manager.get_ipc_handle(view)
    assert isinstance(handle, GpupoolIpcHandle)
    assert isinstance(handle, sys.modules["numba.cuda.cudadrv.driver"].IpcHandle)
    assert (handle.base, handle.size, handle.offset) == (view, PAGE + 24, 0)
    assert handle.source_info == {"uuid": "fake-0", "id": 0}
    inner = handle.pool_handle
    assert (inner.kind, inner.nbytes, len(inner.fds)) == ("posix_fd", PAGE + 24, 2)
    assert inner.offset == view.device_pointer_value % PAGE     # pages of aligned segments
    assert handle.handle.reserved == inner.to_bytes()


def test_the_handle_pickles_as_numba_s_test_asks(manager):
    pointer, _ = _filled(manager, 5000)
    handle = manager.get_ipc_handle(pointer)
    again = pickle.loads(pickle.dumps(handle))
    assert type(again) is type(handle)
    assert again.base is None and again.size == handle.size
    assert again.handle.reserved == handle.handle.reserved
    assert again.source_info == handle.source_info


@needs_memfd
@pytest.mark.parametrize("how", ["open", "open_direct", "open_staged"])
@pytest.mark.parametrize("sent", ["pipe", "pickle"])
def test_another_process_opens_reads_and_closes(manager, child, how, sent):
    pointer, data = _filled(manager, 2 * PAGE + 512)
    view = pointer.view(800, 800 + PAGE)
    handle = manager.get_ipc_handle(view)
    out = child.call("read", handle if sent == "pipe" else pickle.dumps(handle), how)
    assert out["data"] == data[800:800 + PAGE]
    assert out["again"] == "IpcHandle is already opened"
    assert (out["type"], out["base"], out["size"]) == ("GpupoolIpcHandle", None, PAGE)
    assert out["reserved"] == handle.handle.reserved
    # Mapped while open and unmapped by close(); staged: mapped on the source device
    # (entered with cuda.gpus[0]) only while copying.
    assert (out["opened"], out["after_close"]) == (0 if how == "open_staged" else 1, 0)
    assert out["gpus"] == ([0, 0] if how == "open_staged" else [])


@needs_memfd
def test_the_importer_writes_the_exporter_s_memory(manager, child):
    pointer, _ = _filled(manager, PAGE)
    child.call("write", manager.get_ipc_handle(pointer), 7)
    assert ctypes.string_at(pointer.device_pointer_value, PAGE) == b"\x07" * PAGE


@needs_memfd
def test_open_array_reads_the_shared_bytes(manager, child):
    pointer, data = _filled(manager, 800)
    assert child.call("array", manager.get_ipc_handle(pointer), ((100,), "int64")) == data


@needs_memfd
def test_a_handle_of_memory_given_back_is_refused_in_the_importer(manager, child):
    pointer, _ = _filled(manager, 4096)
    handle = manager.get_ipc_handle(pointer)
    pointer.free()          # Numba's forced free (the handle's base keeps it alive otherwise)
    reply = child.ask("read", handle, "open")
    assert reply[:2] == ("error", "IpcError") and "gave this buffer back" in reply[2], reply


def test_refusals(manager, vpool):
    from gpupool.adapters.numba_ipc import GpupoolIpcHandle

    with pytest.raises(ValueError, match="empty Numba allocation"):
        manager.get_ipc_handle(manager.memalloc(0))
    pointer, _ = _filled(manager, 4096)
    handle = manager.get_ipc_handle(pointer)
    with pytest.raises(ValueError, match="opening IpcHandle from original process"):
        handle.open(manager.context)
    with pytest.raises(ValueError, match="IpcHandle not opened"):
        handle.close()
    same = pickle.loads(pickle.dumps(handle))
    with pytest.raises(gpupool.IpcError, match="made in this process"):
        same.open_direct(manager.context)
    assert same._impl is None                       # a failed open leaves it closeable again
    with pytest.raises(TypeError, match="carries a gpupool.IpcHandle, not bytes"):
        GpupoolIpcHandle(None, b"handle", 4096)
    with pytest.raises(ValueError, match="a handle of 4096 B cannot share 100 B"):
        GpupoolIpcHandle(None, handle.pool_handle, 100)
    pointer.free()                                  # the memory given back
    with pytest.raises(gpupool.IpcError, match="no live allocation of .*freed") as info:
        manager.get_ipc_handle(pointer)
    assert info.value.reason == "foreign_memory"
    unexported = _manager_for(gpupool.Pool(upstream=SimulatedDevice(capacity=64 * MIB,
                                                                   virtual_memory=True)))
    with pytest.raises(gpupool.IpcError, match="shareable"):
        unexported.get_ipc_handle(unexported.memalloc(100))


def test_a_pool_of_plain_segments_keeps_numba_s_cuda_ipc(numba_fake):
    manager = _manager_for(gpupool.Pool(upstream=SimulatedDevice(capacity=64 * MIB,
                                                                    shareable=True)))
    with pytest.raises(AssertionError, match="the fake has no cuIpcGetMemHandle"):
        manager.get_ipc_handle(manager.memalloc(100))       # Numba's GetIpcHandleMixin's


# On a GPU with numba-cuda: the cases of numba-cuda's test_ipc.py on upstream "vmm" ----------

GPU_SCRIPT = r"""
import concurrent.futures, multiprocessing as mp, os, pickle, sys
import numpy as np
if not hasattr(np, "row_stack"):        # numba-cuda 0.30 and NumPy 2.5, as in conftest.py
    np.row_stack = np.vstack
from numba import cuda
from numba.cuda.testing import ForeignArray
from gpupool.adapters.numba_ipc import GpupoolIpcHandle
import numba_ipc_gpu

exe = concurrent.futures.ProcessPoolExecutor(mp_context=mp.get_context("spawn"))
pid = os.getpid()
for index in (None, slice(3, None), slice(3, 8), slice(None, 8)):
    for foreign in (False, True):
        devarr = cuda.to_device(np.arange(10, dtype=np.intp))
        if index is not None:
            devarr = devarr[index]
        if foreign:
            devarr = cuda.as_cuda_array(ForeignArray(devarr))
        expect = devarr.copy_to_host()
        ipch = cuda.current_context().get_ipc_handle(devarr.gpu_data)
        assert isinstance(ipch, GpupoolIpcHandle), type(ipch)
        recon = pickle.loads(pickle.dumps(ipch))
        assert recon.base is None and recon.size == ipch.size
        assert recon.handle.reserved == ipch.handle.reserved
        out = exe.submit(numba_ipc_gpu.serialized, ipch, pid).result(timeout=60)
        np.testing.assert_equal(expect, out)
        out = exe.submit(numba_ipc_gpu.array, devarr.get_ipc_handle(), pid).result(timeout=60)
        np.testing.assert_equal(expect, out)
arr = np.random.default_rng(0).integers(0, 1 << 40, 10).astype(np.intp)   # staged reads intp
devarr = cuda.to_device(arr)
ipch = cuda.current_context().get_ipc_handle(devarr.gpu_data)
for device in range(len(cuda.gpus)):
    out = exe.submit(numba_ipc_gpu.staged, ipch, device, pid).result(timeout=60)
    np.testing.assert_equal(arr, out)
    out = exe.submit(numba_ipc_gpu.staged_array, devarr.get_ipc_handle(), device,
                     pid).result(timeout=60)
    np.testing.assert_equal(arr, out)
exe.shutdown()
print("all cases passed")
"""


@pytest.mark.gpu
def test_numba_s_ipc_cases_on_expandable_segments():
    pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")
    # The script takes ForeignArray from numba-cuda's test helpers, which import filecheck
    # (a wheel the GPU machine lacks unless carried: tools/gpu/gpu-check.sh installs .whl).
    pytest.importorskip("filecheck", reason="numba.cuda.testing needs filecheck")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="gpupool.numba", GPUPOOL_UPSTREAM="vmm",
               PYTHONPATH=os.pathsep.join([here, *sys.path]))
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(GPU_SCRIPT)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all cases passed" in result.stdout
