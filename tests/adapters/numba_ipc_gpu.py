"""The importers of test_numba_ipc.py's GPU test, as in numba-cuda's test_ipc.py: run in spawned
processes (a concurrent.futures ProcessPoolExecutor) under NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba
and GPUPOOL_UPSTREAM=vmm; each returns the bytes it read as a NumPy array."""

import os

import numpy as np
from numba import cuda


def serialized(handle, parent_pid):
    """A handle sent as Process arguments: open_array, copy to the host, close."""
    assert os.getpid() != parent_pid
    dtype = np.dtype(np.intp)
    array = handle.open_array(cuda.current_context(), shape=handle.size // dtype.itemsize,
                              dtype=dtype)
    out = array.copy_to_host()
    handle.close()
    return out


def array(ipc_array, parent_pid):
    """An IpcArrayHandle: opened as a context manager; a second open is refused."""
    assert os.getpid() != parent_pid
    with ipc_array as device_array:
        out = device_array.copy_to_host()
        try:
            with ipc_array:
                pass
        except ValueError as exc:
            assert "IpcHandle is already opened" in str(exc)
        else:
            raise AssertionError("a second open was not refused")
    return out


def staged(handle, device, parent_pid):
    """open_staged on ``device``: a copy in that device's context."""
    assert os.getpid() != parent_pid
    with cuda.gpus[device]:
        pointer = handle.open_staged(cuda.devices.get_context())
        out = np.zeros(handle.size // np.dtype(np.intp).itemsize, dtype=np.intp)
        cuda.driver.device_to_host(out, pointer, size=handle.size)
        handle.close()
        return out


def staged_array(ipc_array, device, parent_pid):
    """An IpcArrayHandle opened with ``device`` current."""
    assert os.getpid() != parent_pid
    with cuda.gpus[device]:
        return array(ipc_array, parent_pid)
