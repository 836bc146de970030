"""gpupool's exceptions.

Every error gpupool raises derives from :class:`GpupoolError`. Driver failures carry the
``CUresult`` code and its name, as ``cuGetErrorName`` gives it.
"""

__all__ = [
    "CudaError",
    "GpupoolError",
    "InvalidBufferError",
    "NoDeviceError",
    "OutOfMemoryError",
]


class GpupoolError(Exception):
    """Base class of every gpupool error."""


class CudaError(GpupoolError, RuntimeError):
    """A CUDA driver call failed.

    Attributes
    ----------
    code : int
        The ``CUresult`` value the driver returned.
    name : str
        Its name (``cuGetErrorName``), for example ``"CUDA_ERROR_INVALID_VALUE"``.
    message : str
        The driver's description (``cuGetErrorString``) and the call that failed.
    """

    def __init__(self, code, name, message):
        super().__init__(f"{name} ({code}): {message}")
        self.code = code
        self.name = name
        self.message = message

    def __reduce__(self):
        return type(self), (self.code, self.name, self.message)


class OutOfMemoryError(GpupoolError, MemoryError):
    """The upstream could not provide memory, even after trimming caches and running callbacks."""


class InvalidBufferError(GpupoolError, ValueError):
    """A buffer was used after ``close()``, or after its region invalidated it."""


class NoDeviceError(GpupoolError, RuntimeError):
    """There is no CUDA driver, no device, or no such device."""
