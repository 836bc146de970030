"""Buffers shared between processes without copies (CUDA IPC).

::

    # the exporting process                     # another process
    buf = pool.allocate(n, stream=s)            buf = gpupool.open_ipc(handle, stream=s2)
    ...  # write it on s                        ...  # read it on s2: ordered after the writes
    queue.put(buf.ipc_handle())                 handle = queue.get()
    done.get()   # keep buf alive until then    del buf; done.put(True)

``DeviceBuffer.ipc_handle()`` gives an :class:`IpcHandle`: the driver's handle of the upstream
allocation the block lives in (``cuIpcGetMemHandle`` of the ``cuMemAlloc`` segment on upstream
"driver"; on "vmm", one ``cuMemExportToShareableHandle`` POSIX file descriptor per page of the
block), the block's offset in it, its size, the device's ordinal and UUID, and an IPC event
recorded on the buffer's stream. :func:`open_ipc` maps the memory in another process
(``cuIpcOpenMemHandle``, or ``cuMemImportFromShareableHandle`` + ``cuMemMap``), makes its stream
wait for that event (``cuStreamWaitEvent``) and returns a non-owning ``DeviceBuffer`` over it,
which CuPy, Numba, PyTorch and JAX read as any buffer (CUDA Array Interface, DLPack). The
mapping closes when the last buffer opened in it dies.

Handles pickle: through ``multiprocessing`` (queues, pipes, a pool's or a spawned process's
arguments) the file descriptors of "vmm" pages travel by descriptor passing; with plain
``pickle`` or ``to_bytes()`` the importer fetches them from the exporter with ``pidfd_getfd``,
which needs permission to trace it, and says so when refused.

The exporter's rule
-------------------
As in CUDA IPC and ``torch.multiprocessing``: **the exporter keeps an exported buffer alive,
and does not write it, until every importer is done with it** (have the consumer say so, as
``examples/ipc_pipeline.py`` does). gpupool keeps the rest:

* an importer sees the bytes written before the export on the buffer's stream (or the
  ``stream`` given to ``ipc_handle``), through the IPC event;
* a handle opened after its buffer was given back (closed, freed, invalidated by a region),
  after its upstream allocation went back to the driver, or after the exporter exited raises
  :class:`IpcError` instead of showing memory the pool reuses;
* an upstream allocation ("driver") that an importer holds open is not returned to the driver
  (``Pool.trim``, the out-of-memory ladder, the pool's end) until the importer closes it:
  freeing memory another process has mapped is undefined in CUDA IPC. The exporter's
  ``/dev/shm`` export table counts the importers' mappings; an importer that dies without
  closing (killed, crashed) holds no lock on its count any more, and :func:`collect` (run at
  exports and before an out-of-memory retry) forgets it. On "vmm" the importer's mapping
  holds the pages itself, so the exporter's trims go on (the memory stays in use on the
  device until the importer closes it).

What the exporter's pool does not do is keep the block of a buffer that was given back while
an importer still reads it: that is the rule's purpose.

Limits: memory of a pool on upstream "async" cannot be exported (``IpcError`` names the
alternatives); nor memory that gpupool does not own (``as_buffer`` wrappers) or opened from
another process (copy it first). Importer and exporter run as one user. A
``gpupool.testing.SimulatedDevice(shareable=True)`` simulates all of it with host memory,
between real processes.
"""

from gpupool.errors import IpcError
from gpupool.ipc import export, mapping
from gpupool.ipc.handle import IpcHandle

__all__ = ["IpcError", "IpcHandle", "collect", "open_ipc"]


def open_ipc(handle, stream=None, pool=None):
    """Open memory that another process exported with ``DeviceBuffer.ipc_handle()``.

    Parameters
    ----------
    handle : IpcHandle or bytes
        The handle, or its ``to_bytes()``.
    stream : int, stream object or None
        The stream the buffer is used on here (None: the legacy default stream). It is made
        to wait for the exporter's work recorded in the handle's event
        (``cuIpcOpenEventHandle``, ``cuStreamWaitEvent``): the host does not wait.
    pool : gpupool.Pool, optional
        The pool the buffer reports as its ``pool`` and whose upstream maps the memory (its
        copies and events serve the buffer); it must be on the handle's device. Default:
        the default pool of the device whose UUID the handle names (for simulated memory,
        the default pool of the handle's device ordinal, which must be on a
        ``SimulatedDevice``).

    Returns
    -------
    DeviceBuffer
        Non-owning, of ``handle.nbytes``, on ``stream``; the pool neither counts nor frees
        it. Its memory stays mapped while the buffer or anything made from it (a DLPack or
        CUDA Array Interface consumer) is alive; ``close()`` unmaps it at once. Closing the
        last buffer of a mapping waits for the device's queued work (``cuCtxSynchronize``)
        before ``cuIpcCloseMemHandle`` (or ``cuMemUnmap`` and ``cuMemAddressFree``). Opened
        allocations are cached per exporter and allocation with a count of their buffers:
        ``cuIpcOpenMemHandle`` maps an allocation once per process.

    Raises
    ------
    IpcError
        With ``reason``: "malformed" (bytes that are not a handle), "same_process" (made in
        this process), "wrong_device" (another GPU, or simulated memory on a GPU and the
        reverse), "released" (the exporter gave the buffer back, or its allocation went back
        to the driver), "exporter_exited", "no_descriptors" (page descriptors that did not
        travel and could not be fetched), "open_failed" (the driver refused).
    TypeError
        ``handle`` is neither an ``IpcHandle`` nor bytes; ``pool`` is not a ``Pool``.
    GpupoolError
        In a ``fork()`` child of a process that used gpupool.
    """
    return mapping.open_handle(handle, stream, pool)


def collect():
    """Free what the exports of buffers given back still hold (their IPC events, and on
    "vmm" the page descriptors, which keep the pages allocated until closed), reuse their
    export slots, and forget the counts of importers that died without closing a segment, so
    that a trim can return it. The exporter does it at its exports, when a buffer object dies
    (its event and descriptors), and before retrying an allocation that ran out of memory;
    call it to do it now. Returns the number of exports forgotten."""
    return export.collect()
