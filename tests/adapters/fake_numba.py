"""A small stand-in for the parts of numba-cuda that gpupool's Numba plugin and its IPC handle
use (``numba.cuda``, ``numba.cuda.cudadrv.driver``), over a simulated device whose memory is
host memory: for CPU tests where numba-cuda is not installed. The IPC handle and the memory
pointer keep the behaviour of numba-cuda's (``IpcHandle.open_array``, ``close``, "IpcHandle not
opened", ``MemoryPointer.view``); devices are plain ordinals whose identity is a dict.

``modules()`` gives the fake modules by name, for ``sys.modules``."""

import contextlib
import ctypes
import types
import weakref
from collections import namedtuple

MemoryInfo = namedtuple("MemoryInfo", "free total")


class CUdeviceptr(int):
    """cuda-python's device pointer: ``int()`` is the address."""


class MemoryPointer:
    def __init__(self, context, pointer, size, owner=None, finalizer=None):
        self.context, self.device_pointer, self.size = context, pointer, size
        self.handle = pointer
        self._owner = owner
        if finalizer is not None:
            self._finalizer = weakref.finalize(self, finalizer)

    def free(self):
        self._finalizer()

    @property
    def owner(self):
        return self if self._owner is None else self._owner

    @property
    def device_pointer_value(self):
        return int(self.device_pointer) or None

    def view(self, start, stop=None):
        stop = self.size if stop is None else stop
        return MemoryPointer(self.context, CUdeviceptr(int(self.device_pointer) + start),
                             stop - start, owner=self.owner)

    def read(self):
        """The bytes (simulated device memory is host memory)."""
        return ctypes.string_at(self.device_pointer_value, self.size)


class HostOnlyCUDAMemoryManager:
    def __init__(self, context=None):
        self.context = context

    @contextlib.contextmanager
    def defer_cleanup(self):
        yield

    def reset(self):
        pass


class GetIpcHandleMixin:
    def get_ipc_handle(self, memory):
        raise AssertionError("the fake has no cuIpcGetMemHandle")


class Device:
    def __init__(self, ordinal):
        self.id = ordinal

    def get_device_identity(self):
        return {"uuid": f"fake-{self.id}", "id": self.id}

    @classmethod
    def from_identity(cls, identity):
        return cls(identity["id"])


class Context:
    """A context of a device; ``memalloc`` is its memory manager's (``manager_class``)."""

    manager_class = None
    current = 0

    def __init__(self, ordinal):
        self.device = Device(ordinal)
        self.memory_manager = self.manager_class(context=self)

    def memalloc(self, size):
        return self.memory_manager.memalloc(size)


class _Devices:
    def __init__(self):
        self.contexts = {}

    def get_context(self):
        ordinal = Context.current
        if ordinal not in self.contexts:
            self.contexts[ordinal] = Context(ordinal)
        return self.contexts[ordinal]


class _Gpus:
    def __init__(self):
        self.entered = []

    @contextlib.contextmanager
    def _on(self, ordinal):
        before, Context.current = Context.current, ordinal
        self.entered.append(ordinal)
        try:
            yield
        finally:
            Context.current = before

    def __getitem__(self, ordinal):
        return self._on(ordinal)


def device_to_device(dst, src, size, stream=0):
    ctypes.memmove(dst.device_pointer_value, src.device_pointer_value, size)


class IpcHandle:
    """numba-cuda's IpcHandle, less its CUDA implementations (_CudaIpcImpl, _StagedIpcImpl)."""

    def __init__(self, base, handle, size, source_info=None, offset=0):
        self.base, self.handle, self.size = base, handle, size
        self.source_info, self.offset = source_info, offset
        self._impl = None

    def _sentry_source_info(self):
        if self.source_info is None:
            raise RuntimeError("IPC handle doesn't have source info")

    def open_direct(self, context):
        raise AssertionError("the fake has no cuIpcOpenMemHandle")

    open_staged = open = open_direct

    def open_array(self, context, shape, dtype, strides=None):
        return types.SimpleNamespace(shape=shape, dtype=dtype, gpu_data=self.open(context))

    def close(self):
        if self._impl is None:
            raise ValueError("IpcHandle not opened")
        self._impl.close()
        self._impl = None


def modules():
    """{name: module} of the fake numba, numba.cuda, numba.cuda.cudadrv and its driver."""
    driver = types.ModuleType("numba.cuda.cudadrv.driver")
    driver.binding = types.SimpleNamespace(CUdeviceptr=CUdeviceptr)
    for value in (IpcHandle, MemoryPointer, Device, device_to_device):
        setattr(driver, value.__name__, value)
    cudadrv = types.ModuleType("numba.cuda.cudadrv")
    cudadrv.driver = driver
    cuda = types.ModuleType("numba.cuda")
    for value in (GetIpcHandleMixin, HostOnlyCUDAMemoryManager, MemoryInfo, MemoryPointer):
        setattr(cuda, value.__name__, value)
    cuda.cudadrv, cuda.gpus, cuda.devices = cudadrv, _Gpus(), _Devices()
    numba = types.ModuleType("numba")
    numba.cuda = cuda
    return {"numba": numba, "numba.cuda": cuda, "numba.cuda.cudadrv": cudadrv,
            "numba.cuda.cudadrv.driver": driver}
