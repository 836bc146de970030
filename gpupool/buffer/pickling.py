"""Pickling of DeviceBuffers: their bytes travel through host memory, never their address.

``DeviceBuffer.__reduce_ex__`` calls :func:`reduce_buffer`; unpickling calls
:func:`rebuild_buffer` in the receiving process, which allocates from the default pool of its
current device (``gpupool.get_pool()``, which ``gpupool.core.defaults`` installs: see
``buffer/hooks.py``). Views pickle as their buffer with their dtype, shape and strides
(``BufferView.__reduce__``).
"""

import pickle

from gpupool.buffer.hooks import pool_source

__all__ = ["rebuild_buffer", "reduce_buffer"]


def reduce_buffer(buf, protocol):
    """``(rebuild_buffer, (payload,))`` for ``buf``: its bytes copied to host memory (the
    buffer's stream is waited for), as a ``pickle.PickleBuffer`` (out of band when the pickler
    has a ``buffer_callback``) for protocol 5 or later, as ``bytes`` before."""
    data = buf.copy_to_host()
    return rebuild_buffer, (pickle.PickleBuffer(data) if protocol >= 5 else data.tobytes(),)


def rebuild_buffer(payload):
    """A new buffer of ``gpupool.get_pool()`` (legacy default stream) holding ``payload``'s
    bytes (any object with the buffer protocol).

    Raises
    ------
    NoDeviceError
        No driver and no default pool (``gpupool.set_pool`` makes one, on the simulated device
        for example).
    OutOfMemoryError
        As ``Pool.allocate``.
    """
    data = memoryview(payload).cast("B")
    buf = pool_source()().allocate(data.nbytes)
    if data.nbytes:
        buf.copy_from_host(data)
    return buf
