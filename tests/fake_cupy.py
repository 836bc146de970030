"""A stand-in for the parts of CuPy that ``gpupool.cupy.allocator`` calls, for CPU tests and
for timing the adapter without a GPU (``tools/profile/time_cupy_adapter.py``).

``FakeCupy()`` is a module object to put in ``sys.modules["cupy"]``; its current device and
stream are plain attributes a test sets (``fake.device = 1``, ``fake.stream_ptr = handle``).
The memory classes are cheap Python classes shaped like CuPy's.
"""

import types


class Memory:
    """``cupy.cuda.memory.Memory``: here only ever made for zero bytes."""

    __slots__ = ("ptr", "size", "device_id")

    def __init__(self, size):
        if size != 0:
            raise AssertionError("the adapter made a fake Memory of nonzero size")
        self.ptr, self.size, self.device_id = 0, 0, 0


class UnownedMemory:
    """``cupy.cuda.UnownedMemory(ptr, size, owner, device_id)``: keeps ``owner`` alive."""

    __slots__ = ("ptr", "size", "_owner", "device_id")

    def __init__(self, ptr, size, owner, device_id=-1):
        self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id


class MemoryPointer:
    """``cupy.cuda.MemoryPointer(mem, offset)``."""

    __slots__ = ("mem", "ptr", "device_id")

    def __init__(self, mem, offset):
        self.mem, self.ptr, self.device_id = mem, mem.ptr + offset, mem.device_id


class Stream:
    """A CuPy stream: only its handle, ``.ptr``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


class FakeCupy(types.ModuleType):
    """A ``cupy`` module with ``cuda.runtime.getDevice``, ``cuda.get_current_stream``,
    ``cuda.UnownedMemory``, ``cuda.MemoryPointer`` and ``cuda.memory.Memory``.

    Parameters
    ----------
    device : int
        CuPy's current device.
    stream_ptr_function : bool
        Also export ``cuda.stream.get_current_stream_ptr()`` (as a CuPy that has it would).
    """

    def __init__(self, device=0, stream_ptr_function=False):
        super().__init__("cupy")
        self.device = device
        self.stream = Stream(0)             # the current stream (CuPy keeps one object)
        stream = types.SimpleNamespace()
        if stream_ptr_function:
            stream.get_current_stream_ptr = self._current_stream_ptr
        self.cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDevice=self._get_device),
            stream=stream,
            get_current_stream=self._current_stream,
            UnownedMemory=UnownedMemory,
            MemoryPointer=MemoryPointer,
            memory=types.SimpleNamespace(Memory=Memory),
        )

    @property
    def stream_ptr(self):
        """The current stream's handle; setting it makes a stream with that handle current."""
        return self.stream.ptr

    @stream_ptr.setter
    def stream_ptr(self, handle):
        self.stream = Stream(handle)

    def _get_device(self):
        return self.device

    def _current_stream(self):
        return self.stream

    def _current_stream_ptr(self):
        return self.stream.ptr
