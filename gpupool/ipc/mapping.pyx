# cython: language_level=3, boundscheck=False, wraparound=False
"""The importer's side of CUDA IPC: the exporters' tables opened here, the mappings of their
memory, and the buffers opened in them (the Python API and its documentation:
``gpupool.ipc``).

Importers map the exporter's table (``ipc/table.pyx``) and check the slots before they open a
handle; while one maps a segment it holds a read lock on the segment's slot and counts itself
in it (``count_opened``). The upstream performs the driver's side (``Upstream._ipc_open``,
``_ipc_close``, ``_ipc_wait``).
"""
from cpython.ref cimport PyObject
from libc.stdint cimport uintptr_t, uint64_t
from gpupool.records.ipcslot cimport (
    gp_ipc_slot, GP_IPC_LIVE, gp_ipc_opened, gp_ipc_state, gp_ipc_serial,
)
from gpupool.core.defaults cimport registered_pool
from gpupool.core.pool cimport Pool
from gpupool.driver.calls cimport forked
from gpupool.records.streams cimport stream_handle
from gpupool.ipc.table cimport Table, table_bytes, current_own_table, made_own_table

import ctypes
import errno
import os
import weakref

from gpupool.buffer.device_buffer import wrap
from gpupool.core.defaults import get_pool
from gpupool.driver.calls import device_uuids
from gpupool.errors import FORK_MESSAGE, CudaError, GpupoolError, IpcError
from gpupool.ipc.handle import IpcHandle
from gpupool.ipc.table import count_opened, lock, uncount_opened

SYS_PIDFD_GETFD = 438                           # the same number on x86-64 and arm64

_tables = {}                    # path -> Table of another process
_mappings = {}                  # (table, segment slot, serial) -> _Mapping (mem_handle)
_live = weakref.WeakSet()       # every open _Mapping (for is_imported)



class _Mapping:
    """Memory of another process mapped here: a whole upstream allocation ("mem_handle",
    shared by the buffers opened in it) or a buffer's pages ("posix_fd")."""

    __slots__ = ("key", "upstream", "kind", "base", "size", "refs", "table", "segment",
                 "__weakref__")

    def __init__(self, key, upstream, kind, base, size, table, segment):
        self.key, self.upstream, self.kind, self.base, self.size = key, upstream, kind, base, size
        self.table, self.segment, self.refs = table, segment, 1

    def close(self):
        with lock:
            self.refs -= 1
            if self.refs:
                return
            if self.key is not None:
                _mappings.pop(self.key, None)
            _live.discard(self)
        try:
            self.upstream._ipc_close(self.kind, self.base, self.size)
        finally:
            if self.segment:
                uncount_opened(self.table, self.segment)


class Imported:
    """What a buffer opened from another process holds (its ``as_buffer`` exporter): its
    mapping."""

    __slots__ = ("mapping", "__weakref__")

    def __init__(self, mapping):
        self.mapping = mapping

    def __del__(self):
        try:
            self.mapping.close()
        except Exception:       # never raises: at interpreter shutdown the driver may be gone
            pass


cdef _check_live(Table table, size_t index, uint64_t serial, handle, str what):
    cdef gp_ipc_slot* slot = table.slot(index)
    if gp_ipc_serial(slot) == serial and gp_ipc_state(slot) == GP_IPC_LIVE:
        return
    if what == "buffer":
        raise IpcError(
            f"the exporting process (pid {handle.pid}) gave this buffer back (closed, freed, "
            f"or invalidated by its region) before it was opened here: its memory may hold "
            f"other data now. The exporter must keep an exported buffer alive until every "
            f"importer is done with it", "released")
    raise IpcError(
        f"the upstream allocation holding this buffer went back to the driver in the "
        f"exporting process (pid {handle.pid}) before it was opened here (its pool trimmed "
        f"it or was destroyed): the buffer was given back earlier", "released")


cdef Table _importer_table(handle):
    table = _tables.get(handle.table)
    if table is None:
        try:
            fd = os.open(handle.table, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise IpcError(
                f"the exporting process (pid {handle.pid}) has exited: its export table "
                f"{handle.table} is gone, and with it the memory", "exporter_exited") from None
        except PermissionError:
            raise IpcError(
                f"the export table {handle.table} of process {handle.pid} cannot be opened "
                f"(permission denied): gpupool shares memory between processes of one user",
                "open_failed") from None
        if os.fstat(fd).st_size != table_bytes():
            os.close(fd)
            raise IpcError(f"not a gpupool IPC handle: {handle.table} is not an export table",
                           "malformed")
        table = _tables[handle.table] = Table(handle.table, fd, False)
    if not table.alive():
        _tables.pop(handle.table, None)
        raise IpcError(f"the exporting process (pid {handle.pid}) has exited, and with it "
                       f"the memory", "exporter_exited")
    return table


_uuids = None                   # the UUID of every device this process sees, by ordinal


def _device_ordinal(uuid):
    """This process's ordinal of the device with ``uuid``, or None."""
    global _uuids
    if _uuids is None:
        _uuids = device_uuids()
    return _uuids.index(uuid) if uuid in _uuids else None


def _uuid_text(uuid):
    h = uuid.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def importer_pool(handle, pool):
    """The pool an opened buffer belongs to: ``pool`` checked against the handle's device,
    or the default pool of the device with the handle's UUID."""
    cdef PyObject* registered
    if pool is None:
        if handle.simulated:
            registered = registered_pool(handle.device)
            pool = <object>registered if registered != NULL else None
            if pool is None:
                raise IpcError(
                    "this handle is of a simulated device's host memory: open it with a pool "
                    "on a gpupool.testing.SimulatedDevice (open_ipc(handle, pool=pool), or "
                    "make it the default pool with gpupool.set_pool(pool))", "wrong_device")
        else:
            ordinal = _device_ordinal(handle.device_uuid)
            if ordinal is None:
                raise IpcError(
                    f"the handle's memory is on GPU {_uuid_text(handle.device_uuid)} (device "
                    f"{handle.device} of process {handle.pid}), which this process does not "
                    f"see (CUDA_VISIBLE_DEVICES?)", "wrong_device")
            pool = get_pool(ordinal)
    elif not isinstance(pool, Pool):
        raise TypeError(f"pool must be a gpupool.Pool, got {type(pool).__name__}")
    if bool(pool.upstream.host_accessible) != bool(handle.simulated):
        raise IpcError(
            "this handle is of " + ("a simulated device's host memory; the pool is on a GPU"
                                    if handle.simulated else
                                    "GPU memory; the pool is on a simulated device"),
            "wrong_device")
    uuid = pool.upstream._device_uuid()
    if uuid != handle.device_uuid:
        raise IpcError(
            f"the handle's memory is on GPU {_uuid_text(handle.device_uuid)} (device "
            f"{handle.device} of process {handle.pid}); the pool is on device {pool.device}, "
            f"GPU {_uuid_text(uuid)}: open it with the pool of that device (or pool=None)",
            "wrong_device")
    return pool


def _fetch_fds(handle):
    """The handle's page descriptors, fetched from the process holding them (pidfd_getfd)."""
    how = ("Send the handle through a multiprocessing Queue or Pipe (they pass the "
           "descriptors along), or share memory of a pool on upstream 'driver', whose handles "
           "are plain bytes")
    try:
        pidfd = os.pidfd_open(handle.fd_pid)
    except ProcessLookupError:
        raise IpcError(f"the process holding the handle's page descriptors (pid "
                       f"{handle.fd_pid}) has exited", "exporter_exited") from None
    except (OSError, AttributeError) as exc:
        raise IpcError(f"the handle's page descriptors did not travel with it (it was "
                       f"pickled with plain pickle, or sent as bytes), and pidfd_open is not "
                       f"available to fetch them ({exc}). {how}", "no_descriptors") from None
    getfd = ctypes.CDLL(None, use_errno=True).syscall
    fds = []
    try:
        for remote in handle.remote_fds:
            fd = getfd(ctypes.c_long(SYS_PIDFD_GETFD), ctypes.c_long(pidfd),
                       ctypes.c_long(remote), ctypes.c_long(0))
            if fd < 0:
                err = ctypes.get_errno()
                if err == errno.EBADF:
                    raise IpcError(f"process {handle.fd_pid} no longer holds the handle's page "
                                   f"descriptors: the exporter gave the buffer back",
                                   "released")
                raise IpcError(
                    f"the handle's page descriptors did not travel with it (it was pickled "
                    f"with plain pickle, or sent as bytes), and fetching them from process "
                    f"{handle.fd_pid} with pidfd_getfd was refused ({errno.errorcode.get(err)}"
                    f": {os.strerror(err)}; it needs permission to trace that process: the "
                    f"same user and kernel.yama.ptrace_scope 0, or CAP_SYS_PTRACE, which "
                    f"containers often withhold). {how}", "no_descriptors")
            fds.append(fd)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        os.close(pidfd)
    return fds


def _map(handle, upstream, Table table):
    """The mapping of the handle's allocation here (a new reference)."""
    if handle.kind == "mem_handle":
        key = (handle.table, handle.segment_slot, handle.segment_serial)
        mapping = _mappings.get(key)
        if mapping is not None:             # one per process (per context): any pool of
            if mapping.upstream.device != upstream.device:      # the device shares it
                raise IpcError(f"this allocation is open here on device "
                               f"{mapping.upstream.device}, not {upstream.device}",
                               "wrong_device")
            mapping.refs += 1
            return mapping
        _check_live(table, handle.segment_slot, handle.segment_serial, handle, "segment")
        count_opened(table, handle.segment_slot)
        try:
            _check_live(table, handle.segment_slot, handle.segment_serial, handle, "segment")
            base = _open(upstream, handle, handle.mem)
        except BaseException:
            uncount_opened(table, handle.segment_slot)
            raise
        mapping = _Mapping(key, upstream, handle.kind, base, handle.alloc_bytes, table,
                           handle.segment_slot)
        _mappings[key] = mapping
    else:
        fetched = [] if handle.fds else _fetch_fds(handle)
        try:
            base = _open(upstream, handle, list(handle.fds or fetched))
        finally:
            for fd in fetched:
                os.close(fd)
        mapping = _Mapping(None, upstream, handle.kind, base, handle.alloc_bytes, table, 0)
    _live.add(mapping)
    return mapping


def _open(upstream, handle, payload):
    try:
        return upstream._ipc_open(handle.kind, payload, handle.alloc_bytes)
    except CudaError as exc:
        raise IpcError(f"the driver refused to open the handle ({exc}); the exporting process "
                       f"(pid {handle.pid}) may have freed the memory or exited",
                       "open_failed") from exc


def open_handle(handle, stream=None, pool=None):
    """``gpupool.open_ipc``'s work (docs there)."""
    cdef Table table
    if isinstance(handle, (bytes, bytearray, memoryview)):
        handle = IpcHandle.from_bytes(handle)
    elif not isinstance(handle, IpcHandle):
        raise TypeError(f"open_ipc needs a gpupool.IpcHandle or its bytes, got "
                        f"{type(handle).__name__}")
    handle.check()
    if forked():
        raise GpupoolError(FORK_MESSAGE)
    own = current_own_table()
    if own is not None and handle.table == own.path:
        raise IpcError(
            "this handle was made in this process: use the buffer itself (CUDA IPC handles "
            "open in other processes only)", "same_process")
    pool = importer_pool(handle, pool)
    stream_handle(stream)                   # a bad stream is refused before anything opens
    with lock:
        table = _importer_table(handle)
        _check_live(table, handle.buffer_slot, handle.buffer_serial, handle, "buffer")
        mapping = _map(handle, pool.upstream, table)
        holder = Imported(mapping)
    buf = wrap(pool, mapping.base + handle.offset, handle.nbytes, None, stream, holder)
    pool.upstream._ipc_wait(handle.event, stream_handle(stream))
    return buf


def is_imported(uintptr_t ptr):
    """Whether ``ptr`` lies in memory this process opened from another one."""
    with lock:
        return any(m.base <= ptr < m.base + m.size for m in _live)


def mapping_counts():
    """The open mappings and the cached ones (of whole allocations), for ``ipc.export._stats``."""
    with lock:
        return len(_live), len(_mappings)


def _slot_state(path, size_t index):
    """For tests: (serial, state, opened) of a slot of a table (this process's or another's)."""
    cdef Table own = made_own_table()
    cdef Table table = own if own is not None and own.path == path else _tables.get(path)
    cdef gp_ipc_slot* slot = table.slot(index)
    return gp_ipc_serial(slot), gp_ipc_state(slot), gp_ipc_opened(slot)
