"""Behaviour without a GPU: import works, driver calls raise NoDeviceError with one line."""

import pickle
import subprocess
import sys

import pytest
from conftest import gpu_available

import gpupool
from gpupool.testing import SimulatedDevice

pytestmark = pytest.mark.skipif(gpu_available(), reason="checks the no-driver path")


def test_pool_without_driver_raises_no_device_error():
    with pytest.raises(gpupool.NoDeviceError) as info:
        gpupool.Pool(device=0)
    assert "\n" not in str(info.value)
    assert "SimulatedDevice" in str(info.value)


@pytest.mark.parametrize(
    "call", [lambda: gpupool.get_pool(), lambda: gpupool.allocate(10), gpupool.pool_status,
             lambda: gpupool.Region()])
def test_default_pool_paths_raise_no_device_error(call):
    with pytest.raises(gpupool.NoDeviceError):
        call()


# A pickled buffer: loading it allocates from the default pool, which there is none of here.
PICKLED = pickle.dumps(gpupool.Pool(upstream=SimulatedDevice()).allocate(10))


@pytest.mark.parametrize("call", [lambda: gpupool.get_pool(), lambda: gpupool.allocate(10),
                                  lambda: pickle.loads(PICKLED)])
def test_without_a_driver_the_default_pool_functions_name_set_pool(call):
    with pytest.raises(gpupool.NoDeviceError) as info:
        call()
    message = str(info.value)
    assert "gpupool.set_pool(pool)" in message
    assert "gpupool.Pool(upstream=gpupool.testing.SimulatedDevice())" in message
    assert "\n" not in message


def test_import_prints_nothing():
    result = subprocess.run([sys.executable, "-c", "import gpupool, gpupool.cupy"],
                            capture_output=True, text=True)
    assert result.returncode == 0
    assert result.stdout == result.stderr == ""
