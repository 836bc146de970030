"""Which upstream a pool takes and what it refuses (core/upstreams.py): impossible devices, bad
upstream arguments, an upstream's errors and bad answers."""

import numpy as np
import pytest
from conftest import check_invariants

import gpupool
from gpupool.testing import SimulatedDevice


def test_upstream_errors_reach_the_caller(sim):
    class Broken(type(sim)):
        def _alloc(self, nbytes):
            raise RuntimeError("simulated driver failure")

    pool = gpupool.Pool(upstream=Broken())
    with pytest.raises(RuntimeError, match="simulated driver failure"):
        pool.allocate(10)
    check_invariants(pool)


@pytest.mark.parametrize("device, error", [
    (-1, ValueError), (1 << 31, ValueError), (True, TypeError), (1.5, TypeError),
    ("0", TypeError), (None, TypeError)])
@pytest.mark.parametrize("upstream", ["simulated", None, "driver"])
def test_impossible_devices_are_refused_before_any_driver_call(sim, device, error, upstream):
    # Without a driver, a driver call would raise NoDeviceError instead.
    with pytest.raises(error, match="device"):
        gpupool.Pool(device=device, upstream=sim if upstream == "simulated" else upstream)


def test_impossible_devices_of_the_simulated_device_and_the_default_pools():
    for device, error in ((-1, ValueError), (True, TypeError), (0.0, TypeError)):
        with pytest.raises(error, match="device"):
            SimulatedDevice(device=device)
    with pytest.raises(ValueError, match="non-negative device ordinal, got -1"):
        gpupool.get_pool(-1)
    with pytest.raises(ValueError, match="non-negative device ordinal, got -1"):
        gpupool.allocate(10, device=-1)
    assert gpupool.Pool(device=np.int64(3), upstream=SimulatedDevice(device=3)).device == 3


def test_impossible_devices_of_the_driver_upstreams_are_refused_before_cuinit():
    for device, error in ((True, TypeError), (-1, ValueError), (1.0, TypeError)):
        with pytest.raises(error, match="device"):
            gpupool.DriverUpstream(device)


def test_a_bool_is_not_a_device_of_the_default_pools(default_pools):
    one = gpupool.Pool(upstream=SimulatedDevice(device=1))
    gpupool.set_pool(one)
    assert gpupool.get_pool(1) is one
    with pytest.raises(TypeError, match="int device ordinal"):
        gpupool.get_pool(True)              # True == 1: it would find device 1's pool
    assert gpupool.get_pool(np.int64(1)) is one


@pytest.mark.parametrize("returned, error, match", [
    (1.5, TypeError, r"_alloc must return an int, got 1\.5"),
    ("0x1000", TypeError, "_alloc must return an int"),
    (-1, ValueError, "_alloc returned -1, not an unsigned 64-bit integer"),
    (0, ValueError, "_alloc returned address 0"),
])
def test_an_upstream_returning_no_address_is_a_clear_error(returned, error, match):
    class Bad(SimulatedDevice):
        def _alloc(self, nbytes, stream=None):
            super()._alloc(nbytes, stream)
            return returned

    pool = gpupool.Pool(upstream=Bad())
    with pytest.raises(error, match=match):
        pool.allocate(1000)
    assert pool.stats().in_use_bytes == pool.stats().reserved_bytes == 0


def test_bad_upstream_arguments():
    with pytest.raises(ValueError):
        gpupool.Pool(upstream="nonsense")
    with pytest.raises(TypeError):
        gpupool.Pool(upstream=42)
