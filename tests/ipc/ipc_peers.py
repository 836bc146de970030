"""What the IPC tests share (test_ipc_handle.py, test_ipc_export.py, test_ipc_errors.py,
test_ipc_processes.py, test_ipc_torch.py): pools on shareable simulated devices, the second
process (``Child``, running tests/ipc/ipc_child.py) and the GPU fixtures.

``SimulatedDevice(shareable=True)`` memory is memfd files that both processes map, so the IPC
tests need memfd (Linux): each file sets ``pytestmark = needs_memfd``. On a GPU (marked gpu),
the pools are on both upstreams that export ("driver": cuIpcGetMemHandle of the segment;
"vmm": a POSIX file descriptor per page), and CuPy is the producer in every test."""

import multiprocessing
import os

import pytest
from conftest import checked

import gpupool
from gpupool.testing import SimulatedDevice

KIB, MIB = 1 << 10, 1 << 20
PAGE = 64 * KIB
SPAWN = multiprocessing.get_context("spawn")
RETIRED = 2                                 # gp_ipc.h's GP_IPC_RETIRED
UPSTREAMS = ["driver", "vmm"]

try:
    import cupy  # the producer in every GPU test
except ImportError:
    cupy = None
needs_cupy = pytest.mark.skipif(cupy is None, reason="could not import 'cupy'")
needs_memfd = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd (Linux)")


@pytest.fixture
def msim():
    yield from checked(SimulatedDevice(capacity=256 * MIB, shareable=True))


@pytest.fixture
def mpool(msim):
    return gpupool.Pool(upstream=msim)


@pytest.fixture
def vsim():
    yield from checked(SimulatedDevice(capacity=256 * MIB, shareable=True, virtual_memory=True,
                                       page=PAGE))


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
