"""Another process for test_numba_ipc.py: with the fake Numba of fake_numba.py installed and a
default pool on a shareable simulated device, it opens gpupool's Numba IPC handles on commands
sent over a multiprocessing Pipe (so handles travel through multiprocessing's pickler, page
descriptors by descriptor passing) and answers ("ok", value) or ("error", type name, message).
"""

import ctypes
import pickle
import sys

import fake_numba

import gpupool
import gpupool.numba
from gpupool.ipc import mapping
from gpupool.testing import SimulatedDevice


def serve(conn, device):
    """Answer commands until "exit"; ``device``: the SimulatedDevice's keyword arguments. The
    fake Numba is installed here, in the child only, before any handle arrives."""
    sys.modules.update(fake_numba.modules())
    gpupool.set_pool(gpupool.Pool(upstream=SimulatedDevice(**device)))
    fake_numba.Context.manager_class = gpupool.numba.GpupoolNumbaManager
    cuda = sys.modules["numba.cuda"]
    while True:
        name, *args = conn.recv()
        if name == "exit":
            conn.send(("ok", None))
            return
        try:
            value = _run(name, args, cuda)
        except Exception as exc:
            conn.send(("error", type(exc).__name__, str(exc)))
        else:
            conn.send(("ok", value))


def _run(name, args, cuda):
    handle, how = args
    if isinstance(handle, bytes):
        handle = pickle.loads(handle)
    context = cuda.devices.get_context()
    if name == "read":          # open (how: "open", "open_direct", "open_staged"), read, close
        entered = len(cuda.gpus.entered)
        pointer = getattr(handle, how)(context)
        data = pointer.read()
        try:
            getattr(handle, how)(context)
        except ValueError as exc:
            again = str(exc)
        opened = mapping.mapping_counts()[0]
        handle.close()
        return {"data": data, "again": again, "opened": opened,
                "after_close": mapping.mapping_counts()[0], "gpus": cuda.gpus.entered[entered:],
                "type": type(handle).__name__, "base": handle.base, "size": handle.size,
                "reserved": handle.handle.reserved}
    if name == "write":         # open, write the byte how, close
        pointer = handle.open(context)
        ctypes.memset(pointer.device_pointer_value, how, pointer.size)
        handle.close()
        return None
    if name == "array":         # open_array of how (shape, dtype), read
        shape, dtype = how
        array = handle.open_array(context, shape=shape, dtype=dtype)
        data = array.gpu_data.read()
        handle.close()
        return data
    raise ValueError(f"unknown command {name!r}")
