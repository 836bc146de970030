"""What the buffer layer asks of the layers above it, which install it when they are imported.

The buffer layer imports nothing above itself: the CUDA IPC exporter (``DeviceBuffer.ipc_handle``'s
work) is installed by ``gpupool.ipc.export``, and the source of the pool that unpickled buffers
are allocated from (``gpupool.get_pool``) by ``gpupool.core.defaults``. Importing ``gpupool``
imports both, so both are installed for every user.
"""

from gpupool.errors import GpupoolError

__all__ = ["install_ipc_exporter", "install_pool_source", "ipc_exporter", "pool_source"]

_ipc_exporter = None        # export(buf, stream) -> IpcHandle
_pool_source = None         # get_pool() -> the current device's default pool


def install_ipc_exporter(export):
    """Make ``export(buf, stream)`` the work of ``DeviceBuffer.ipc_handle``."""
    global _ipc_exporter
    _ipc_exporter = export


def ipc_exporter():
    """The installed CUDA IPC exporter.

    Raises
    ------
    GpupoolError
        None is installed (``gpupool.ipc`` was not imported).
    """
    if _ipc_exporter is None:
        raise GpupoolError("no CUDA IPC exporter is installed: import gpupool (or gpupool.ipc) "
                           "before exporting a buffer")
    return _ipc_exporter


def install_pool_source(get_pool):
    """Make ``get_pool()`` the pool that ``pickle.loads`` allocates buffers from."""
    global _pool_source
    _pool_source = get_pool


def pool_source():
    """The installed source of the default pool.

    Raises
    ------
    GpupoolError
        None is installed (``gpupool.core.defaults`` was not imported).
    """
    if _pool_source is None:
        raise GpupoolError("no default pool source is installed: import gpupool before "
                           "unpickling a buffer")
    return _pool_source
