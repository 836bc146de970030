"""examples/_numpy_pool.py: NumPy's array memory from a pool on the simulated device."""

import gc
import importlib.util

import numpy as np
import pytest
from conftest import REPO

import gpupool
from gpupool.testing import SimulatedDevice

_spec = importlib.util.spec_from_file_location("examples_numpy_pool",
                                               REPO / "examples" / "_numpy_pool.py")
numpy_pool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(numpy_pool)
handler_name = numpy_pool._multiarray_umath.get_handler_name


def test_arrays_made_inside_take_their_memory_from_the_pool(pool, sim):
    a_host = np.arange(12.0).reshape(3, 4)
    with numpy_pool.using_pool(pool):
        a = np.array(a_host)
        product = a @ a.T
        # The pool grew from the simulated device, whose own arrays are not the pool's.
        assert sim.used > 0 and sim.errors == []
        assert handler_name(a) == handler_name(product) == "gpupool"
        assert pool.stats().in_use_bytes >= a.nbytes + product.nbytes
    np.testing.assert_array_equal(product, a_host @ a_host.T)
    assert handler_name(np.ones(3)) == "default_allocator"
    assert handler_name() == "default_allocator"


def test_a_dead_array_returns_its_block_and_one_made_inside_outlives_the_block(pool):
    with numpy_pool.using_pool(pool):
        kept = np.ones(1000)
        temporary = np.ones(1000)
        in_use = pool.stats().in_use_bytes
        del temporary
        assert pool.stats().in_use_bytes < in_use
    assert kept.sum() == 1000 and pool.stats().in_use_bytes > 0
    del kept
    assert pool.stats().in_use_bytes == 0


def test_a_region_hands_a_step_the_same_addresses(pool):
    region = gpupool.Region(pool=pool)

    def step():
        with region:
            x = np.ones((64, 64), np.float32)
            y = x @ x + 1
            addresses = x.ctypes.data, y.ctypes.data
            del x, y            # dead inside the region: their blocks stay its cache
        return addresses

    with numpy_pool.using_pool(pool):
        first = step()
        reserved = pool.stats().reserved_bytes
        assert [step() for _ in range(3)] == [first] * 3
    assert pool.stats().reserved_bytes == reserved
    region.release()


def test_zeros_are_zero_on_a_reused_block(pool):
    with numpy_pool.using_pool(pool):
        dirty = np.full(4096, 7, np.uint8)
        address = dirty.ctypes.data
        del dirty
        zeros = np.zeros(4096, np.uint8)            # calloc: the same block, cleared
        assert zeros.ctypes.data == address
        assert not zeros.any()


def test_a_growing_array_is_moved_within_the_pool(pool):
    with numpy_pool.using_pool(pool):
        grown = np.fromiter((i for i in range(100_000)), dtype=np.int64)   # reallocs
        assert handler_name(grown) == "gpupool"
    np.testing.assert_array_equal(grown, np.arange(100_000))
    del grown
    assert pool.stats().in_use_bytes == 0


def test_out_of_memory_is_numpys_memory_error(sim):
    # 4 MiB: room for the pool's 2 MiB page (growth is rounded to it), not for the 8 MiB array
    small = gpupool.Pool(upstream=SimulatedDevice(capacity=4 << 20))
    with numpy_pool.using_pool(small):
        with pytest.raises(MemoryError):
            np.empty(8 << 20, np.uint8)
        assert np.ones(16).sum() == 16              # the pool still serves what fits


def test_nested_blocks_restore_the_outer_pool(sim):
    outer, inner = gpupool.Pool(upstream=sim), gpupool.Pool(upstream=SimulatedDevice())
    with numpy_pool.using_pool(outer):
        with numpy_pool.using_pool(inner):
            a = np.ones(100)
        b = np.ones(100)
        assert inner.stats().in_use_bytes >= a.nbytes
        assert outer.stats().in_use_bytes == gpupool.size_class(b.nbytes)
    assert handler_name() == "default_allocator"


class DeviceMemory(SimulatedDevice):
    def __init__(self):
        super().__init__()
        self._set_host_accessible(False)


def test_a_pool_of_device_memory_is_refused():
    with pytest.raises(ValueError, match="host memory"):
        with numpy_pool.using_pool(gpupool.Pool(upstream=DeviceMemory())):
            pass
    assert handler_name() == "default_allocator"


def test_arrays_in_cycles_return_their_blocks_when_collected(pool):
    class Node:
        pass

    with numpy_pool.using_pool(pool):
        node = Node()
        node.me, node.data = node, np.ones(1000)
    del node
    assert pool.stats().in_use_bytes > 0
    gc.collect()
    assert pool.stats().in_use_bytes == 0
