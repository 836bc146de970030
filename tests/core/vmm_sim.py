"""What the tests of expandable segments share (test_growexpand.py, test_vmm.py): a pool on a
simulated device with virtual memory, and one on a real device (upstream "vmm").

``SimulatedDevice(virtual_memory=True)`` records the pool's ``reserve``, ``map``, ``unmap`` and
``unreserve`` calls, counts mapped bytes (``device_bytes``) and records an unmap made while
any stream has work pending (a misuse, ``sim.errors``). Each stream grows a segment of its
own: a range of address space whose pages are mapped as it grows, so free space at its end
joins the next request; a trim unmaps whole free pages (the end of a segment shrinks it,
pages in the middle become a hole, mapped again when a request fits it).

PAGE is 4 KiB to keep the tests small. The simulated device's ranges are host mmaps, aligned
to the host page only; the pool counts pages from a segment's start, so larger pages work too
(a regression test in test_vmm.py uses 64 KiB pages on a misaligned range).
"""

import pytest

import gpupool
from gpupool.testing import SimulatedDevice
from conftest import checked

KIB, MIB = 1 << 10, 1 << 20
PAGE = 4 * KIB                          # host pages are multiples of it: ranges align


def vmm(capacity=64 * MIB):
    """A simulated device with virtual memory and a pool on it."""
    sim = SimulatedDevice(capacity=capacity, virtual_memory=True, page=PAGE)
    return sim, gpupool.Pool(upstream=sim)


@pytest.fixture
def vsim():
    yield from checked(SimulatedDevice(capacity=64 * MIB, virtual_memory=True, page=PAGE))


@pytest.fixture
def vpool(vsim):
    return gpupool.Pool(upstream=vsim)


def names(sim, *wanted):
    """The names of the calls in sim.calls that are among wanted, in order."""
    return [name for name, _ in sim.calls if name in wanted]


# On a real device (marked gpu): gpupool.VmmUpstream (upstream "vmm") over the driver's
# virtual memory API.

@pytest.fixture
def gpu_pool():
    gpu_pool = gpupool.Pool(device=0, upstream="vmm")
    yield gpu_pool
    gpu_pool.trim()


def device_used(gpu_pool):
    free, total = gpu_pool.mem_info()
    return total - free
