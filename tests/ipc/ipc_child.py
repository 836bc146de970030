"""Another process for the IPC tests: it opens (or exports) gpupool buffers on commands sent
over a multiprocessing Pipe, so handles travel as they do between real programs (through
multiprocessing's pickler, page descriptors by descriptor passing). ``Child`` in
tests/ipc/ipc_peers.py starts it with the 'spawn' method (a fresh interpreter), on the
simulated device and on a GPU.

Each command is a tuple ``(name, *args)``; the reply is ``("ok", value)`` or ``("error",
type name, reason, message)``.
"""

import os
import pickle

import numpy as np

import gpupool
from gpupool.ipc import export, mapping
from gpupool.testing import SimulatedDevice


def serve(conn, device=None, upstream=None):
    """Answer commands until "exit". ``device``: keyword arguments of the SimulatedDevice
    the default pool is made on; None: a pool on GPU 0 on ``upstream`` ("driver", "vmm";
    None: gpupool's default)."""
    sim = None
    if device is not None:
        sim = SimulatedDevice(**device)
        gpupool.set_pool(gpupool.Pool(upstream=sim))
    elif upstream is not None:
        gpupool.set_pool(gpupool.Pool(device=0, upstream=upstream))
    pool = gpupool.get_pool(0)
    held, exported = {}, {}
    while True:
        name, *args = conn.recv()
        try:
            if name == "exit":
                conn.send(("ok", None))
                if args and args[0] == "crash":
                    os._exit(0)             # no atexit: the export table stays behind
                return
            value = _run(name, args, pool, sim, held, exported)
        except Exception as exc:
            conn.send(("error", type(exc).__name__, getattr(exc, "reason", None), str(exc)))
        else:
            conn.send(("ok", value))


def _run(name, args, pool, sim, held, exported):
    if name == "open":                  # (key, handle or its pickle, open_ipc keywords;
        key, handle, kwargs = args      # "pool_device": the default pool of that device)
        if isinstance(handle, bytes) and handle.startswith(b"\x80"):
            handle = pickle.loads(handle)
        kwargs = dict(kwargs)
        if "pool_device" in kwargs:
            kwargs["pool"] = gpupool.get_pool(kwargs.pop("pool_device"))
        held[key] = gpupool.open_ipc(handle, **kwargs)
        return held[key].nbytes
    if name == "read":                  # the bytes of an opened buffer
        return held[args[0]].copy_to_host().tobytes()
    if name == "write":                 # (key, byte value) into an opened buffer
        held[args[0]].memset(args[1])
        return None
    if name == "close":
        held.pop(args[0]).close()
        return None
    if name == "drop":                  # let the buffer die instead of closing it
        del held[args[0]]
        return None
    if name == "export":                # (key, nbytes, byte value): a buffer of this process
        key, nbytes, value = args
        buf = exported[key] = pool.allocate(nbytes)
        buf.memset(value)
        return buf.ipc_handle()
    if name == "reexport":              # an opened buffer exported again (refused)
        return held[args[0]].ipc_handle()
    if name == "free":                  # an exported buffer given back
        exported.pop(args[0]).close()
        return None
    if name == "deny_pidfd":            # as in a container that forbids pidfd_getfd
        mapping.SYS_PIDFD_GETFD = -1
        return None
    if name == "stats":
        return {"ipc": export._stats(), "pool": pool.stats().as_dict(), "mem_info": pool.mem_info(),
                "errors": list(sim.errors) if sim else [],
                "calls": [c for c in sim.calls if c[0].startswith("ipc")] if sim else []}
    if name == "sum":                   # the sum of an opened buffer's bytes, through DLPack
        return int(np.from_dlpack(held[args[0]]).sum()) if sim else None
    raise ValueError(f"unknown command {name!r}")


def consume(conn, framework):
    """A consumer on a GPU reading through ``framework`` ("cupy", "numba" or "torch"): on
    "ready" it sets the framework and CUDA up; on ("read", handle) it opens the handle on a
    stream of the framework's, answers ("opened", None) at once, then reads the bytes on that
    stream and answers ("ok", (count of bytes equal to 42, nbytes)); on "close" it lets the
    buffer go; on "exit" it returns."""
    if not hasattr(np, "row_stack"):            # numba-cuda 0.30 and NumPy 2.5 (conftest)
        np.row_stack = np.vstack
    stream, read = _framework(framework)
    gpupool.get_pool(0)
    held = None
    while True:
        name, *args = conn.recv()
        try:
            if name == "exit":
                conn.send(("ok", None))
                return
            if name == "ready":
                conn.send(("ok", None))
            elif name == "read":
                held = gpupool.open_ipc(args[0], stream=stream)
                conn.send(("opened", None))
                host = read(held)
                conn.send(("ok", (int((host == 42).sum()), host.nbytes)))
            elif name == "close":
                held = None
                conn.send(("ok", export._stats()))
        except Exception as exc:
            conn.send(("error", type(exc).__name__, getattr(exc, "reason", None), str(exc)))


def _framework(framework):
    """(stream handle, read(buf) -> numpy array) of a consumer framework, CUDA set up."""
    if framework == "cupy":
        import cupy

        s = cupy.cuda.Stream(non_blocking=True)

        def read(buf):
            with s:
                return cupy.from_dlpack(buf).get(stream=s)

        return s.ptr, read
    if framework == "numba":
        from numba import cuda

        s = cuda.stream()
        handle = getattr(s.handle, "value", None) or int(s.handle)

        def read(buf):
            array = cuda.as_cuda_array(buf)         # the CUDA Array Interface: stream s
            host = array.copy_to_host(stream=s)
            s.synchronize()
            return host

        return handle, read
    import torch

    torch.zeros(1, device="cuda")
    s = torch.cuda.Stream()

    def read(buf):
        with torch.cuda.stream(s):
            return torch.from_dlpack(buf).cpu().numpy()     # DLPack on stream s

    return s.cuda_stream, read
