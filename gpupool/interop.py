"""Memory of other array libraries as gpupool buffers (the other way round from
``DeviceBuffer``'s own exports): ``as_buffer`` wraps any CUDA Array Interface object.

The other boundaries are beside it: the CUDA Array Interface reader (``buffer/interface.py``),
typed views (``buffer/view.py``), DLPack (``buffer/dlpack.pyx``) and stream coercion
(``records/streams.pxd``).
"""

from gpupool.buffer.device_buffer import DeviceBuffer, wrap
from gpupool.buffer.interface import read_cai
from gpupool.buffer.view import BufferView
from gpupool.core.defaults import get_pool

__all__ = ["as_buffer"]


def as_buffer(obj, device=None, pool=None, stream=None):
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
        it is a gpupool buffer or view, else ``get_pool(device)``. A simulated-device pool
        works as any other.
    stream : int, stream object or None
        The stream the wrapper is used on (the consumer), as for ``Pool.allocate``: None is
        the legacy default stream, as everywhere in gpupool; pass CuPy's current stream
        (``cupy.cuda.get_current_stream()``) or PyTorch's (``torch.cuda.current_stream()``)
        to consume on it. It becomes the wrapper's ``stream``.

    Returns
    -------
    DeviceBuffer
        ``nbytes`` = the array's bytes (pointer 0 for an array of no elements, whose pointer
        is never read); ``stream`` = ``stream``.

    Raises
    ------
    TypeError
        ``obj`` exports no CUDA Array Interface.
    ValueError
        The array is not C-contiguous, is read-only, or its interface's ``stream`` is 0 (CUDA
        Array Interface v3 forbids it: 1 names the legacy default stream).

    Notes
    -----
    As the CUDA Array Interface v3 asks of a consumer, ``stream`` is ordered after the
    interface's ``stream`` (the producer's): an event recorded there and a GPU-side wait
    (``cuStreamWaitEvent``), so the host does not wait; only where no event can be made is
    the device synchronized instead. A ``stream`` of None in the interface means no ordering
    is needed, and none is made. For a gpupool buffer or view, the consumer is ordered after
    the buffer's own stream (another thread's per-thread stream included), and its stream,
    like every later stream of the wrapper (``wrapper.stream = s``, ``record_stream``,
    exports, copies, memsets), counts as a use of the buffer: its block is reused only after
    that work.
    """
    cai = read_cai(obj)
    if cai is None:
        raise TypeError(f"as_buffer needs an object with __cuda_array_interface__, got "
                        f"{type(obj).__name__}")
    if not cai.c_contiguous:
        raise ValueError("as_buffer needs a C-contiguous array")
    if cai.readonly:
        raise ValueError("as_buffer needs writable memory (the interface marks it read-only)")
    if pool is None:
        source = obj.buffer if isinstance(obj, BufferView) else obj
        pool = source.pool if isinstance(source, DeviceBuffer) else get_pool(device)
    return wrap(pool, cai.ptr, cai.nbytes, cai.stream, stream, obj)
