"""Memory of other array libraries as gpupool buffers (the other way round from
``DeviceBuffer``'s own exports): ``as_buffer`` wraps any CUDA Array Interface object.

The other boundaries are beside it: the CUDA Array Interface reader (``interface.py``), typed
views (``view.py``), DLPack (``_dlpack.pyx``) and stream coercion (``_streams.pxd``).
"""

from gpupool._buffer import DeviceBuffer, _wrap
from gpupool._defaults import get_pool
from gpupool.interface import read_cai

__all__ = ["as_buffer"]


def as_buffer(obj, device=None, pool=None):
    """Wrap memory exported by another library as a non-owning DeviceBuffer (no copy).

    Parameters
    ----------
    obj : object with ``__cuda_array_interface__``
        A C-contiguous device array (CuPy, Numba, PyTorch, ...); kept alive by the buffer.
    device : int, optional
        The device of the memory; default: the current device. Its default pool serves the
        buffer's copies; the memory itself stays the exporter's and is never freed by gpupool.
    pool : Pool, optional
        The pool whose upstream serves the copies instead; default: the pool of ``obj`` when
        it is a gpupool buffer or view, else ``get_pool(device)``.

    Returns
    -------
    DeviceBuffer
        ``nbytes`` = the array's bytes; ``stream`` = the interface's stream (the legacy default
        stream when it gives none).

    Raises
    ------
    TypeError
        ``obj`` exports no CUDA Array Interface.
    ValueError
        The array is not C-contiguous, or is read-only.
    """
    cai = read_cai(obj)
    if cai is None:
        raise TypeError(f"as_buffer needs an object with __cuda_array_interface__, got "
                        f"{type(obj).__name__}")
    if not cai.c_contiguous:
        raise ValueError("as_buffer needs a C-contiguous array")
    if cai.readonly:
        raise ValueError("as_buffer needs writable memory (the interface marks it read-only)")
    stream = cai.stream
    if pool is None:
        source = getattr(obj, "buffer", obj)          # a BufferView's buffer
        pool = source.pool if isinstance(source, DeviceBuffer) else get_pool(device)
    return _wrap(pool, cai.ptr, cai.nbytes, 0 if stream in (None, 1) else stream, obj)
