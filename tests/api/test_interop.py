"""as_buffer on the simulated device: the consumer's stream ordered after the CUDA Array
Interface's, wrappers of gpupool buffers counted as uses of their blocks, arrays of no elements.

On a GPU (marked gpu), the consumer x protocol matrix: CuPy, Numba, PyTorch and JAX read a
gpupool DeviceBuffer and a typed view of it through the CUDA Array Interface v3 ("cai") and
DLPack, without a copy and with the right values, after a slow producer on another stream, and
empty.

How each consumer imports, and on which stream it reads (the consumer's stream B):

- CuPy: ``cupy.asarray`` / ``cupy.from_dlpack`` with B current; reads with ``get(stream=B)``.
- Numba: ``numba.cuda.as_cuda_array``; DLPack objects are kernel arguments (a copy kernel
  launched on B); reads with ``copy_to_host(stream=B)``.
- PyTorch: ``torch.as_tensor(..., device="cuda:0")`` / ``torch.from_dlpack`` with B current.
  Its CAI import ignores the producer's ``stream`` (torch/csrc/utils/tensor_numpy.cpp), so only
  DLPack is checked for stream order.
- JAX: ``jnp.asarray`` / ``jax.dlpack.from_dlpack``, on JAX's own stream. JAX may copy on
  import; ``unsafe_buffer_pointer()`` tells, and a copy is reported as an expected failure.
"""

import os
import traceback

import numpy as np
import pytest

import gpupool
from gpupool.testing import SimulatedDevice

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # else JAX takes 75% of the GPU

try:
    import cupy  # the producer in every GPU test
except ImportError:
    cupy = None
needs_cupy = pytest.mark.skipif(cupy is None, reason="could not import 'cupy'")

SIZE = 64 << 10


class Foreign:
    """Another library's array: nothing but its CUDA Array Interface."""

    def __init__(self, cai):
        self.__cuda_array_interface__ = cai


def foreign(buf, **changes):
    """A foreign array over buf's memory, its interface changed by ``changes``."""
    return Foreign(dict(buf.__cuda_array_interface__, **changes))


def test_the_consumer_is_ordered_after_the_interface_stream_without_a_host_wait(pool, sim):
    base = pool.allocate(SIZE)
    s, c = sim.create_stream(), sim.create_stream()
    sim.launch(s)                                  # the producer's kernel, still writing
    queued = sim.queued(s)
    wrapped = gpupool.as_buffer(foreign(base, stream=s), pool=pool)
    assert wrapped.stream == 0 and sim.ordered(0, s, queued)     # the legacy stream, default
    on_c = gpupool.as_buffer(foreign(base, stream=s), pool=pool, stream=c)
    assert on_c.stream == c and sim.ordered(c, s, queued)
    sim.launch(2)
    queued = sim.queued(2)
    gpupool.as_buffer(foreign(base, stream=2), pool=pool, stream=c)   # this thread's
    assert sim.ordered(c, 2, queued)
    assert sim.pending(s) and sim.calls_named("synchronize") == []


def test_no_ordering_for_a_stream_of_none_or_the_consumers_own(pool, sim):
    base = pool.allocate(SIZE)
    c = sim.create_stream()
    sim.launch(c)
    sim.calls.clear()
    gpupool.as_buffer(foreign(base, stream=None), pool=pool, stream=c)
    gpupool.as_buffer(foreign(base, stream=c), pool=pool, stream=c)
    gpupool.as_buffer(foreign(base, stream=1), pool=pool)             # 1 is the legacy stream
    assert sim.calls == []


def test_a_stream_of_0_is_refused(pool):
    base = pool.allocate(SIZE)
    with pytest.raises(ValueError, match="'stream'.* is 0.*forbids"):
        gpupool.as_buffer(foreign(base, stream=0), pool=pool)


def test_without_events_the_device_is_synchronized_instead():
    class NoEvents(SimulatedDevice):
        def _event_create(self):
            raise RuntimeError("no more events")

    sim = NoEvents()
    pool = gpupool.Pool(upstream=sim)
    base = pool.allocate(SIZE)
    s = sim.create_stream()
    sim.launch(s)
    gpupool.as_buffer(foreign(base, stream=s), pool=pool)
    assert sim.calls_named("synchronize") == [()] and not sim.pending(s)
    assert sim.errors == []


@pytest.mark.parametrize("through", ["buffer", "view"])
def test_a_wrapper_on_another_stream_is_a_use_of_the_gpupool_buffer(pool, sim, through):
    a, c = sim.create_stream(), sim.create_stream()
    buf = pool.allocate(SIZE, stream=a)
    ptr = buf.ptr
    sim.launch(a)
    produced = sim.queued(a)
    source = buf if through == "buffer" else buf.view(np.uint8, (SIZE,))
    wrapped = gpupool.as_buffer(source, stream=c)            # no pool=: the buffer's own
    assert wrapped.pool is pool and wrapped.stream == c and wrapped.ptr == ptr
    assert sim.ordered(c, a, produced)                       # the consumer after the producer
    sim.launch(c)
    consumed = sim.queued(c)
    del wrapped, source, buf
    again = pool.allocate(SIZE, stream=a)
    assert again.ptr == ptr and sim.ordered(a, c, consumed)


@pytest.mark.parametrize("use", ["stream", "record_stream", "dlpack", "copy", "copy_from_host",
                                 "memset"])
def test_a_wrappers_later_streams_are_uses_of_the_gpupool_buffer(pool, sim, use):
    a, d = sim.create_stream(), sim.create_stream()
    buf = pool.allocate(SIZE, stream=a)
    ptr = buf.ptr
    wrapped = gpupool.as_buffer(buf, stream=a)
    if use == "stream":
        wrapped.stream = d
    elif use == "record_stream":
        wrapped.record_stream(d)
    elif use == "dlpack":
        wrapped.__dlpack__(stream=d)
    elif use == "copy":
        pool.allocate(SIZE, stream=d).copy_from_host(wrapped)   # read on d
    elif use == "copy_from_host":
        wrapped.copy_from_host(np.zeros(SIZE, np.uint8), stream=d)
    else:
        wrapped.memset(0, stream=d)
    sim.launch(d)
    queued = sim.queued(d)
    del wrapped, buf
    again = pool.allocate(SIZE, stream=a)
    assert again.ptr == ptr and sim.ordered(a, d, queued)


def test_a_wrapper_of_foreign_memory_records_nothing(pool, sim):
    base = pool.allocate(SIZE)
    d = sim.create_stream()
    wrapped = gpupool.as_buffer(foreign(base, stream=None), pool=pool)
    wrapped.record_stream(d)
    wrapped.stream = d
    sim.calls.clear()
    del base
    assert sim.calls_named("event_record") == []


def test_arrays_of_no_elements_are_imported_without_reading_their_pointer(pool):
    # A pointer no device has: read, it would be refused.
    empty = Foreign({"data": (1 << 70, False), "shape": (0, 4), "typestr": "<f4",
                     "version": 3, "stream": 1})
    wrapped = gpupool.as_buffer(empty, pool=pool)
    assert wrapped.ptr == 0 and wrapped.nbytes == 0
    buf = pool.allocate(SIZE)
    assert gpupool.as_buffer(buf.view(np.float32, (0,))).ptr == 0
    region = gpupool.Region(pool=pool, on_exit="invalidate")
    with region:
        inside = pool.allocate(SIZE)
        view = inside.view(np.float32, (4, 0))
        assert region.keep(empty) is empty                   # no memory: nothing to keep
        assert region.keep(np.empty((0, 3))) is not None     # DLPack, a pointer NumPy made
        assert region.keep(pool.allocate(0)) is not None
        region.keep(view)                                    # a view keeps its buffer
    assert not inside.closed


# On a GPU (marked gpu): the consumer x protocol matrix.

SLOW_FILL = r"""
extern "C" __global__ void slow_fill(float* out, long long n, long long spin) {
    long long start = clock64();
    while (clock64() - start < spin) { }
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = 0.5f * (float)i + 1.0f;
    }
}
"""
SPIN_CYCLES = 400_000_000       # about 0.2 s at H200 clocks: the consumer asks long before the end
SHAPE = (256, 1024)             # float32: 1 MiB


class DLPackOnly:
    """An object exporting only DLPack, so that a consumer reading both protocols takes it."""

    def __init__(self, obj):
        self._obj = obj

    def __dlpack__(self, **kwargs):
        return self._obj.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._obj.__dlpack_device__()


class CuPyConsumer:
    def read(self, obj, protocol, stream):
        """``(array, device address or None)``: ``obj`` imported with ``stream`` current."""
        with stream:
            array = cupy.asarray(obj) if protocol == "cai" else cupy.from_dlpack(obj)
        return array, array.data.ptr

    def to_host(self, array, stream):
        return array.get(stream=stream)


class NumbaConsumer:
    def __init__(self):
        self.cuda = cuda = pytest.importorskip("numba.cuda")

        @cuda.jit
        def copy_1d(src, dst):
            i = cuda.grid(1)
            if i < src.shape[0]:
                dst[i] = src[i]

        @cuda.jit
        def copy_2d(src, dst):
            i, j = cuda.grid(2)
            if i < src.shape[0] and j < src.shape[1]:
                dst[i, j] = src[i, j]

        self.copies = {1: copy_1d, 2: copy_2d}

    def require_dlpack(self):
        from numba.cuda.cudadrv import devicearray

        if not hasattr(devicearray, "_to_strided_memory_view"):
            pytest.skip("this numba-cuda takes no DLPack objects as kernel arguments")

    def read(self, obj, protocol, stream):
        if protocol == "cai":
            array = self.cuda.as_cuda_array(obj)
            return array, array.__cuda_array_interface__["data"][0]
        # Numba reads DLPack objects as kernel arguments, on the launch's stream.
        self.require_dlpack()
        cai = obj.__cuda_array_interface__
        dst = self.cuda.device_array(cai["shape"], dtype=np.dtype(cai["typestr"]))
        self.launch(self.copies[len(dst.shape)], dst.shape, stream, DLPackOnly(obj), dst)
        return dst, None

    def launch(self, kernel, shape, stream, *args):
        if len(shape) == 1:
            grid, block = max(1, -(-shape[0] // 256)), 256
        else:
            grid, block = tuple(max(1, -(-n // 16)) for n in shape), (16, 16)
        kernel[grid, block, self.cuda.external_stream(stream.ptr)](*args)

    def to_host(self, array, stream):
        numba_stream = self.cuda.external_stream(stream.ptr)
        host = array.copy_to_host(stream=numba_stream)
        numba_stream.synchronize()
        return host


class TorchConsumer:
    def __init__(self):
        self.torch = torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("PyTorch sees no CUDA device")

    def _on(self, stream):
        return self.torch.cuda.stream(self.torch.cuda.ExternalStream(stream.ptr))

    def read(self, obj, protocol, stream):
        with self._on(stream):
            if protocol == "cai":
                tensor = self.torch.as_tensor(obj, device="cuda:0")
            else:
                tensor = self.torch.from_dlpack(obj)
        return tensor, tensor.data_ptr()

    def to_host(self, tensor, stream):
        with self._on(stream):
            return tensor.cpu().numpy()


class JaxConsumer:
    def __init__(self):
        self.jax = pytest.importorskip("jax")
        import jax.dlpack
        import jax.numpy

        if self.jax.default_backend() not in ("gpu", "cuda"):
            pytest.skip(f"JAX runs on {self.jax.default_backend()}, not a GPU")
        self.asarray, self.from_dlpack = jax.numpy.asarray, jax.dlpack.from_dlpack

    def read(self, obj, protocol, stream):
        # JAX reads on its own stream; both imports order it after the producer's.
        array = self.asarray(obj) if protocol == "cai" else self.from_dlpack(obj)
        return array, array.unsafe_buffer_pointer() if array.size else None

    def to_host(self, array, stream):
        return np.asarray(array)


CONSUMERS = {"cupy": CuPyConsumer, "numba": NumbaConsumer, "torch": TorchConsumer,
             "jax": JaxConsumer}
PROTOCOLS = ("cai", "dlpack")
UNORDERED = {("torch", "cai"): "PyTorch's CUDA Array Interface import ignores the "
                               "producer's stream; use DLPack",
             ("jax", "cai"): "JAX's CUDA Array Interface import refuses a producer stream "
                             "it did not create (GetStreamFromExternalStream); use DLPack"}
MATRIX = pytest.mark.parametrize("name, protocol",
                                 [(c, p) for c in CONSUMERS for p in PROTOCOLS])

_loaded = {}


def consumer(name):
    """The consumer ``name``, made once per session (skips if its library is missing)."""
    if name not in _loaded:
        _loaded[name] = CONSUMERS[name]()
    return _loaded[name]


@pytest.fixture
def gpu_pool():
    return gpupool.Pool(device=0)


@pytest.fixture
def stream_b():
    return cupy.cuda.Stream(non_blocking=True)


def expected_of(data, kind):
    return data.view(np.uint8).reshape(-1) if kind == "buffer" else data


def exported(buf, kind, shape):
    return buf if kind == "buffer" else buf.view("float32", shape)


@pytest.mark.gpu
@needs_cupy
@MATRIX
@pytest.mark.parametrize("kind", ["buffer", "view"])
def test_consumer_reads_gpupool_memory_without_a_copy(gpu_pool, stream_b, name, protocol, kind):
    reader = consumer(name)
    data = (np.arange(np.prod(SHAPE), dtype=np.float32) * 0.25 - 7).reshape(SHAPE)
    buf = gpu_pool.allocate(data.nbytes)
    cupy.asarray(buf.view("float32", SHAPE))[...] = cupy.asarray(data)     # CuPy fills it
    cupy.cuda.runtime.deviceSynchronize()
    array, address = reader.read(exported(buf, kind, SHAPE), protocol, stream_b)
    host = reader.to_host(array, stream_b)
    expected = expected_of(data, kind)
    assert host.dtype == expected.dtype and host.shape == expected.shape
    np.testing.assert_array_equal(host, expected)
    if address is None:             # Numba's DLPack path: see the write-through test below
        return
    if name == "jax" and address != buf.ptr:
        pytest.xfail(f"JAX copied on {protocol} import: its buffer is at {address:#x}, "
                     f"gpupool's at {buf.ptr:#x}")
    assert address == buf.ptr


@pytest.mark.gpu
@needs_cupy
def test_a_numba_kernel_writes_gpupool_memory_through_dlpack(gpu_pool):
    reader = consumer("numba")
    reader.require_dlpack()
    data = np.arange(4096, dtype=np.float32)
    buf = gpu_pool.allocate(data.nbytes)
    buf.copy_from_host(data)

    cuda = reader.cuda                      # a module: Numba types it inside the kernel

    @cuda.jit
    def double(x):
        i = cuda.grid(1)
        if i < x.shape[0]:
            x[i] *= 2

    double[16, 256](DLPackOnly(buf.view("float32", data.shape)))
    cuda.synchronize()
    np.testing.assert_array_equal(buf.copy_to_host().view(np.float32), data * 2)


@pytest.mark.gpu
@needs_cupy
@MATRIX
def test_consumer_on_another_stream_sees_the_slow_producers_final_data(gpu_pool, stream_b, name,
                                                                       protocol):
    if (name, protocol) in UNORDERED:
        pytest.skip(UNORDERED[name, protocol])
    reader = consumer(name)
    n = int(np.prod(SHAPE))
    expected = (np.arange(n, dtype=np.float32) * np.float32(0.5) + np.float32(1)).reshape(SHAPE)
    warm = gpu_pool.allocate(4 * n)         # first reads compile (Numba) or set up (JAX)
    reader.to_host(reader.read(warm.view("float32", SHAPE), protocol, stream_b)[0], stream_b)

    stream_a = cupy.cuda.Stream(non_blocking=True)
    buf = gpu_pool.allocate(4 * n, stream=stream_a.ptr)
    buf.memset(0)                           # on stream A, like the kernel
    kernel = cupy.RawKernel(SLOW_FILL, "slow_fill")
    with stream_a:
        kernel((64,), (256,), (cupy.uint64(buf.ptr), cupy.int64(n), cupy.int64(SPIN_CYCLES)))
    array, _ = reader.read(buf.view("float32", SHAPE), protocol, stream_b)
    np.testing.assert_array_equal(reader.to_host(array, stream_b), expected)
    stream_a.synchronize()


def _raised_in_gpupool(exc):
    package = os.path.dirname(gpupool.__file__)
    return any(frame.filename.startswith((package, "gpupool" + os.sep))
               for frame in traceback.extract_tb(exc.__traceback__))


@pytest.mark.gpu
@needs_cupy
@MATRIX
@pytest.mark.parametrize("case", ["empty buffer", "empty view", "zero-extent view"])
def test_consumer_reads_empty_buffers_and_views(gpu_pool, stream_b, name, protocol, case):
    reader = consumer(name)
    if case == "empty buffer":
        obj, shape, dtype = gpu_pool.allocate(0), (0,), np.uint8
    elif case == "empty view":
        obj, shape, dtype = gpu_pool.allocate(0).view("float32", (0, 4)), (0, 4), np.float32
    else:
        obj, shape, dtype = gpu_pool.allocate(1024).view("float32", (4, 0)), (4, 0), np.float32
    try:
        host = reader.to_host(reader.read(obj, protocol, stream_b)[0], stream_b)
    except Exception as exc:
        if _raised_in_gpupool(exc):
            raise
        pytest.xfail(f"{name} refuses an empty {protocol} export: {type(exc).__name__}: {exc}")
    assert host.shape == shape and host.dtype == dtype
