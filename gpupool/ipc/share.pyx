# cython: language_level=3, boundscheck=False, wraparound=False
"""CUDA IPC of gpupool memory: the export table shared with importers, the exporter's records
and the importer's mappings (the Python API and its documentation: ``gpupool.ipc``).

The export table is a file of shared memory made by the exporting process (in ``/dev/shm``,
mode 0600, an exclusive ``flock`` held for its life, unlinked at exit) of 16-byte slots
(``src/gp_ipc.h``). An exported buffer has a slot, which goes RELEASED when the buffer gives
its block back (``DeviceBuffer._ipc_released``), so a later open fails instead of reading
memory the pool reuses. An exported upstream allocation (a plain segment: "mem_handle"
handles) has a slot whose ``opened`` counts the importers' mappings of it: the pool does not
return the segment to the driver while it is above 0 (``core/segments.pxd``), since freeing memory
another process holds open through ``cuIpcOpenMemHandle`` is undefined. Importers map the
exporter's table and check the slots before they open a handle; while one maps a segment it
holds a read lock on the segment's slot (an open-file-description lock: the kernel drops it
when the process ends, even killed) and counts itself in it, so the exporter's ``collect``
forgets the count of an importer that died without closing.

The upstream performs the driver's side (``Upstream._ipc_*``: ``cuIpcGetMemHandle``,
``cuMemExportToShareableHandle``, their opening and closing, IPC events); this module knows
the pool's records (a block's segment and its pages) and the slots.
"""
from libc.errno cimport errno as c_errno
from cpython.ref cimport PyObject
from libc.stdint cimport uintptr_t, uint64_t
from posix.mman cimport mmap, munmap, PROT_READ, PROT_WRITE, MAP_SHARED, MAP_FAILED
from gpupool.records.block cimport Block, Segment, LIVE
from gpupool.buffer.device_buffer cimport DeviceBuffer
from gpupool.driver.calls cimport forked
from gpupool.buffer.handoff cimport recordable
from gpupool.records.ipcslot cimport (
    gp_ipc_slot, GP_IPC_LIVE, GP_IPC_RELEASED, gp_ipc_opened, gp_ipc_add_opened,
    gp_ipc_state, gp_ipc_serial, gp_ipc_release, gp_ipc_claim, gp_ipc_free,
    gp_ipc_reset_opened,
)
from gpupool.core.pool cimport Pool
from gpupool.records.streams cimport stream_handle

import atexit
import ctypes
import errno
import fcntl
import glob
import os
import secrets
import struct
import tempfile
import threading
import weakref

from gpupool.buffer.device_buffer import _wrap
from gpupool.driver.calls import device_uuids
from gpupool.ipc.handle import IpcHandle
from gpupool.errors import FORK_MESSAGE, GpupoolError, IpcError

cdef size_t SLOTS = 1 << 20                     # slots of a table: 16 MiB, sparse
cdef size_t TABLE_BYTES = SLOTS * sizeof(gp_ipc_slot)
PREFIX = "gpupool-ipc-"
SYS_PIDFD_GETFD = 438                           # the same number on x86-64 and arm64

cdef extern from "Python.h":
    Py_ssize_t Py_REFCNT(PyObject* o)

_lock = threading.RLock()       # the registry and the mappings (exports and opens)


def _table_dir():
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
        else tempfile.gettempdir()


cdef class Table:
    """An export table mapped in this process: the exporter's own (``own``) or another
    process's, opened to check and count its slots."""
    cdef readonly str path
    cdef readonly int fd
    cdef readonly bint own
    cdef gp_ipc_slot* slots

    def __cinit__(self, str path, int fd, bint own):
        cdef void* base = mmap(NULL, TABLE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if base == MAP_FAILED:
            err = c_errno
            os.close(fd)
            raise OSError(err, f"mmap of the IPC export table {path}")
        self.path, self.fd, self.own, self.slots = path, fd, own, <gp_ipc_slot*>base

    def __dealloc__(self):
        # The exporter's own stays mapped for the process's life: buffers and segments that
        # die later (at interpreter shutdown, after this module) still write their slots.
        if self.slots != NULL and not self.own:
            munmap(self.slots, TABLE_BYTES)

    cdef gp_ipc_slot* slot(self, size_t index) except NULL:
        if index == 0 or index >= SLOTS:
            raise IpcError(f"not a gpupool IPC handle: slot {index} of a table of {SLOTS}",
                           "malformed")
        return &self.slots[index]

    cdef size_t index(self, gp_ipc_slot* slot) noexcept:
        return <size_t>(slot - self.slots)

    def alive(self):
        """Whether the exporting process still holds the table (its exclusive lock)."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return False


def _remove_stale_tables(directory):
    """Unlink the tables of processes that died without their exit handler (no lock held)."""
    for path in glob.glob(os.path.join(directory, PREFIX + "*")):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
        except OSError:
            pass
        finally:
            os.close(fd)


cdef Table _make_own_table():
    directory = _table_dir()
    _remove_stale_tables(directory)
    path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, TABLE_BYTES)
        fcntl.flock(fd, fcntl.LOCK_EX)          # held for life: importers see it alive
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    table = Table(path, fd, True)
    atexit.register(_unlink_own, path)
    return table


def _unlink_own(path):
    try:
        os.unlink(path)
    except OSError:
        pass


# The exporter's side ------------------------------------------------------------------

cdef Table _own = None          # this process's table, made at its first export
_own_pid = 0
_free_slots = []
_next_slot = 1
_serial = 0
_records = {}                   # slot index -> _Record
_sweep_limit = 64
_collecting = False             # the on_oom callback is registered


class _Record:
    """What the exporter keeps for one slot: a buffer's (its IPC event, the page descriptors
    it exported), a range's (a PyTorch storage: its event, descriptors and whether it is
    alive) or a segment's (the driver's handle of the allocation)."""

    __slots__ = ("index", "serial", "upstream", "event", "fds", "mem", "alive", "__weakref__")

    def __init__(self, index, serial, upstream, alive=None):
        self.index, self.serial, self.upstream, self.alive = index, serial, upstream, alive
        self.event = None
        self.fds = {}           # (first page, end) -> descriptors of those pages
        self.mem = None

    def free_resources(self):
        """Destroy the event and close the descriptors: nobody can open the handle now."""
        event, self.event = self.event, None
        fds, self.fds = self.fds, {}
        if event is not None:
            self.upstream._ipc_event_destroy(event)
        for group in fds.values():
            for fd in group:
                os.close(fd)


cdef Table _exporter_table():
    global _own, _own_pid
    if _own is None or _own_pid != os.getpid():
        _own = _make_own_table()
        _own_pid = os.getpid()
    return _own


cdef gp_ipc_slot* _claim(Table table) except NULL:
    global _next_slot, _serial
    if _free_slots:
        index = _free_slots.pop()
    elif _next_slot < SLOTS:
        index = _next_slot
        _next_slot += 1
    else:
        raise IpcError(f"this process has {SLOTS - 1} exports open (buffers still alive, or "
                       f"importers that never closed them): no export slot is left",
                       "not_exportable")
    _serial += 1
    gp_ipc_claim(table.slot(index), _serial)
    return table.slot(index)


cdef void _unclaim(Table table, gp_ipc_slot* slot):
    gp_ipc_free(slot)
    _free_slots.append(table.index(slot))


_FLOCK = struct.Struct("hh4xqqi4x")    # struct flock (x86-64 and arm64 Linux)


def _lock_slot(Table table, size_t index, bint lock):
    """Take (or drop) the importer's read lock on a slot's 16 bytes (F_OFD_SETLK)."""
    fcntl.fcntl(table.fd, fcntl.F_OFD_SETLK,
                _FLOCK.pack(fcntl.F_RDLCK if lock else fcntl.F_UNLCK, os.SEEK_SET,
                            index * sizeof(gp_ipc_slot), sizeof(gp_ipc_slot), 0))


def _slot_locked(Table table, size_t index):
    """Whether some importer holds a lock on a slot (F_OFD_GETLK)."""
    found = fcntl.fcntl(table.fd, fcntl.F_OFD_GETLK,
                        _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, index * sizeof(gp_ipc_slot),
                                    sizeof(gp_ipc_slot), 0))
    return _FLOCK.unpack(found)[0] != fcntl.F_UNLCK


def collect():
    """Free what the exports of given-back buffers still hold (their IPC events and page
    descriptors, which keep virtual-memory pages allocated), reuse their slots, and forget the
    counts of importers that died without closing a segment (no lock of theirs backs them),
    so a trim can return it. Returns the number of exports forgotten."""
    global _sweep_limit
    cdef gp_ipc_slot* slot
    cdef int opened
    forgotten = 0
    with _lock:
        if _own is None or _own_pid != os.getpid():
            return 0
        for index, record in list(_records.items()):
            slot = _own.slot(index)
            if record.alive is not None and gp_ipc_state(slot) == GP_IPC_LIVE \
                    and not record.alive():
                gp_ipc_release(slot)
            opened = gp_ipc_opened(slot)
            if record.mem is not None and opened > 0 and not _slot_locked(_own, index):
                # An importer locks before it counts and counts down before it unlocks: a
                # count without a lock is a dead importer's (and one counting since fails
                # the exchange, to be looked at next time).
                if gp_ipc_reset_opened(slot, opened):
                    opened = 0
            if gp_ipc_state(slot) != GP_IPC_RELEASED:
                continue
            record.free_resources()
            if record.mem is None or opened <= 0:
                del _records[index]
                _unclaim(_own, slot)
                forgotten += 1
        _sweep_limit = max(64, 2 * len(_records))
    return forgotten


def _collect_on_oom(nbytes):
    collect()


cdef _maybe_collect():
    """At an export: collect now and then; at the first, make an allocation that runs out of
    memory collect before it is retried (page descriptors of given-back buffers hold their
    pages, and a dead importer's count its segment)."""
    global _collecting
    if len(_records) < 1024 or len(_records) >= _sweep_limit:
        collect()
    if not _collecting:
        from gpupool.core.pool import on_oom

        on_oom(_collect_on_oom)
        _collecting = True


cdef object _buffer_record(DeviceBuffer owner, Table table):
    """The export record of a gpupool buffer (made at its first export)."""
    cdef gp_ipc_slot* slot
    if owner._ipc_slot != NULL:
        return _records[table.index(owner._ipc_slot)]
    slot = _claim(table)
    record = _Record(table.index(slot), gp_ipc_serial(slot), owner.pool.upstream)
    try:
        record.event = owner.pool.upstream._ipc_event_create()
    except BaseException:
        _unclaim(table, slot)
        raise
    _records[record.index] = record
    owner._ipc_slot = slot
    # The buffer object's death frees the event and descriptors at once (close() leaves
    # them to the next collect: the buffer may be exported no more, but it is alive).
    weakref.finalize(owner, _free_record_resources, record)
    return record


def _free_record_resources(record):
    with _lock:
        record.free_resources()


cdef object _segment_record(Segment* seg, object upstream, Table table):
    """The export record of a plain segment (its driver handle; made at its first export)."""
    cdef gp_ipc_slot* slot
    if seg.ipc != NULL:
        return _records[table.index(seg.ipc)]
    mem = upstream._ipc_export(seg.base, seg.nbytes)
    slot = _claim(table)
    record = _Record(table.index(slot), gp_ipc_serial(slot), upstream)
    record.mem = bytes(mem)
    _records[record.index] = record
    seg.ipc = slot                  # read by the trim path once the segment is wholly free
    return record


cdef object _export(object pool, Block* blk, uintptr_t ptr, size_t nbytes, uintptr_t stream,
                    object record, Table table):
    """The handle of [ptr, ptr + nbytes), inside live block blk of pool, with record's event
    recorded on stream handle ``stream``."""
    cdef Segment* seg = blk.segment
    cdef uintptr_t first, end
    cdef size_t g
    upstream = pool.upstream
    kind = upstream.ipc_kind
    if kind is None:
        raise IpcError(upstream.ipc_refusal, "not_exportable")
    uuid = upstream._device_uuid()
    event = upstream._ipc_event_record(record.event, stream)
    fields = dict(kind=kind, simulated=bool(upstream.host_accessible), pid=os.getpid(),
                  fd_pid=os.getpid(), device=pool.device, device_uuid=uuid,
                  buffer_slot=record.index, buffer_serial=record.serial, nbytes=nbytes,
                  table=table.path, event=bytes(event))
    if kind == "mem_handle":
        if seg.va_bytes:
            raise IpcError("an expandable segment has no memory handle", "not_exportable")
        segment = _segment_record(seg, upstream, table)
        fields.update(segment_slot=segment.index, segment_serial=segment.serial,
                      offset=ptr - seg.base, alloc_bytes=seg.nbytes, page_bytes=0,
                      mem=segment.mem, remote_fds=())
        return IpcHandle(**fields)
    if not seg.va_bytes:
        raise IpcError("page descriptors name pages of an expandable segment",
                       "not_exportable")
    g = upstream.granularity
    first = seg.base + (ptr - seg.base) // g * g
    end = seg.base + (ptr + nbytes - seg.base + g - 1) // g * g
    fds = record.fds.get((first, end))
    if fds is None:
        fds = record.fds[(first, end)] = tuple(upstream._ipc_export(first, end - first))
    fields.update(segment_slot=0, segment_serial=0, offset=ptr - first,
                  alloc_bytes=end - first, page_bytes=g, mem=b"", remote_fds=fds)
    own = []
    try:
        for fd in fds:              # the handle's own: it may be pickled after a collect
            own.append(os.dup(fd))
    except BaseException:
        for fd in own:
            os.close(fd)
        raise
    return IpcHandle(**fields, fds=own)


def export_buffer(DeviceBuffer buf, stream=None):
    """``DeviceBuffer.ipc_handle``'s work: the handle of ``buf``'s memory (docs there)."""
    cdef DeviceBuffer owner
    cdef uintptr_t handle
    cdef bint found = False
    if forked():
        raise GpupoolError(FORK_MESSAGE)
    if buf._nbytes == 0:
        raise ValueError("an empty buffer has no memory to share (ipc_handle needs nbytes > 0)")
    owner = buf if buf._blk != NULL else buf._base
    handle = stream_handle(stream) if stream is not None else recordable(buf._stream)
    if owner is None or owner._blk == NULL:
        if isinstance(buf._exporter, _Import):
            raise IpcError(
                "this buffer's memory was opened from another process (gpupool.open_ipc): "
                "it cannot be exported again; copy it into a buffer of this process's pool "
                "first (buf.copy())", "received")
        # An array of gpupool memory made by an adapter (CuPy's, Numba's, PyTorch's
        # allocator): exported as the buffer that holds the block, or for a block of the C
        # API (PyTorch's under use()) while the array lives.
        holder = _holder_of(buf.pool, buf._ptr, buf._nbytes, &found) \
            if isinstance(buf.pool, Pool) else None
        if holder is not None:
            owner = holder
        elif found:
            return export_range(buf.pool, buf._ptr, buf._nbytes, handle, _alive(buf))
        else:
            raise IpcError(
                f"this buffer wraps memory that gpupool does not own "
                f"({type(buf._exporter).__name__} through gpupool.as_buffer; no block of "
                f"{buf.pool!r} holds it): only memory of a gpupool pool can be exported. Share "
                f"the memory with its owner's IPC (CuPy: cupy.cuda.runtime.ipcGetMemHandle, "
                f"PyTorch: torch.multiprocessing), or copy it into a gpupool buffer first "
                f"(pool.allocate(n).copy_from_host(array))", "foreign_memory")
    with _lock:
        table = _exporter_table()
        _maybe_collect()
        record = _buffer_record(owner, table)
        return _export(owner.pool, owner._blk, buf._ptr, buf._nbytes, handle, record, table)


def _alive(DeviceBuffer wrapper):
    """Whether the memory of an ``as_buffer`` wrapper is still held: its exporter (the array)
    is alive, or where that takes no weak reference, the wrapper."""
    try:
        ref = weakref.ref(wrapper._exporter)
    except TypeError:
        ref = weakref.ref(wrapper)
    return lambda: ref() is not None


cdef Block* _walk(Pool pool, uintptr_t ptr, size_t nbytes) noexcept nogil:
    """The live block of pool holding [ptr, ptr + nbytes), or NULL (Pool.find_live)."""
    return pool.find_live(ptr, nbytes)


cdef Block* _find_block(Pool pool, uintptr_t ptr, size_t nbytes) noexcept nogil:
    """The live block of pool holding [ptr, ptr + nbytes), or NULL."""
    return pool.find_live(ptr, nbytes)


cdef object _holder_of(Pool pool, uintptr_t ptr, size_t nbytes, bint* found):
    """The DeviceBuffer holding the live block of pool around [ptr, ptr + nbytes) (None for a
    block of the C API, or none); ``found``: whether there is such a block (Pool.holder_at)."""
    return pool.holder_at(ptr, nbytes, found)


def owns(Pool pool, uintptr_t ptr, size_t nbytes):
    """Whether [ptr, ptr + nbytes) lies in one live block of ``pool``."""
    return _find_block(pool, ptr, nbytes) != NULL


def export_range(Pool pool, uintptr_t ptr, size_t nbytes, stream, alive):
    """A handle of [ptr, ptr + nbytes), which lies in a live block of ``pool`` handed out
    through the C API (PyTorch's tensors), with an IPC event recorded on ``stream``;
    ``alive()`` says whether the memory's owner still holds it (an open after it stops
    fails, as for a buffer given back). For ``gpupool.torch``.

    Raises
    ------
    IpcError
        The range is not in one live block of the pool (reason "foreign_memory"), or as
        ``DeviceBuffer.ipc_handle``.
    """
    cdef Block* blk
    cdef gp_ipc_slot* slot
    if forked():
        raise GpupoolError(FORK_MESSAGE)
    blk = _find_block(pool, ptr, nbytes)        # not under _lock: the pool's lock is taken
    if blk == NULL:
        raise IpcError(f"{nbytes} B at {ptr:#x} are not in one live block of {pool!r}",
                       "foreign_memory")
    with _lock:                                 # the caller holds the memory's owner: blk lives
        table = _exporter_table()
        _maybe_collect()
        slot = _claim(table)
        record = _Record(table.index(slot), gp_ipc_serial(slot), pool.upstream, alive)
        try:
            record.event = pool.upstream._ipc_event_create()
            handle = _export(pool, blk, ptr, nbytes, stream_handle(stream), record, table)
        except BaseException:
            record.free_resources()
            _unclaim(table, slot)
            raise
        _records[record.index] = record
        return handle


# The importer's side ------------------------------------------------------------------

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

    def release(self):
        with _lock:
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
                _uncount(self.table, self.segment)


class _Import:
    """What a buffer opened from another process holds (its ``as_buffer`` exporter): its
    mapping."""

    __slots__ = ("mapping", "__weakref__")

    def __init__(self, mapping):
        self.mapping = mapping

    def __del__(self):
        try:
            self.mapping.release()
        except Exception:       # never raises: at interpreter shutdown the driver may be gone
            pass


def _count(Table table, size_t index):
    """Count this process in a segment's slot: its lock first (see the module's notes)."""
    _lock_slot(table, index, True)
    _add_opened(table, index, 1)


def _uncount(Table table, size_t index):
    _add_opened(table, index, -1)
    _lock_slot(table, index, False)


def _add_opened(Table table, size_t index, int delta):
    gp_ipc_add_opened(table.slot(index), delta)


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
        if os.fstat(fd).st_size != TABLE_BYTES:
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


def _importer_pool(handle, pool):
    """The pool an opened buffer belongs to: ``pool`` checked against the handle's device,
    or the default pool of the device with the handle's UUID."""
    from gpupool.core import defaults

    if pool is None:
        if handle.simulated:
            pool = defaults._pools.get(handle.device)
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
            pool = defaults.get_pool(ordinal)
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
        _count(table, handle.segment_slot)
        try:
            _check_live(table, handle.segment_slot, handle.segment_serial, handle, "segment")
            base = _open(upstream, handle, handle.mem)
        except BaseException:
            _uncount(table, handle.segment_slot)
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
    from gpupool.errors import CudaError

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
    if _own is not None and _own_pid == os.getpid() and handle.table == _own.path:
        raise IpcError(
            "this handle was made in this process: use the buffer itself (CUDA IPC handles "
            "open in other processes only)", "same_process")
    pool = _importer_pool(handle, pool)
    stream_handle(stream)                   # a bad stream is refused before anything opens
    with _lock:
        table = _importer_table(handle)
        _check_live(table, handle.buffer_slot, handle.buffer_serial, handle, "buffer")
        mapping = _map(handle, pool.upstream, table)
        holder = _Import(mapping)
    buf = _wrap(pool, mapping.base + handle.offset, handle.nbytes, None, stream, holder)
    pool.upstream._ipc_wait(handle.event, stream_handle(stream))
    return buf


def is_imported(uintptr_t ptr):
    """Whether ``ptr`` lies in memory this process opened from another one."""
    with _lock:
        return any(m.base <= ptr < m.base + m.size for m in _live)


def _stats():
    """For tests: the exporter's records and free slots, the importer's mappings."""
    with _lock:
        return {"records": len(_records), "free_slots": len(_free_slots),
                "used_slots": _next_slot - 1 - len(_free_slots),
                "mappings": len(_live), "cached_mappings": len(_mappings),
                "table": None if _own is None else _own.path}


def _slot_state(path, size_t index):
    """For tests: (serial, state, opened) of a slot of a table (this process's or another's)."""
    cdef Table table = _own if _own is not None and _own.path == path else _tables.get(path)
    cdef gp_ipc_slot* slot = table.slot(index)
    return gp_ipc_serial(slot), gp_ipc_state(slot), gp_ipc_opened(slot)


_test_tables = {}


def _add_to_slot(path, size_t index, int delta):
    """For tests: what another process's mapping of a segment (+1) and its close (-1) do to a
    slot of this process's table, through a table opened as an importer opens it."""
    table = _test_tables.get(path)
    if table is None:
        table = _test_tables[path] = Table(path, os.open(path, os.O_RDWR | os.O_CLOEXEC), False)
    (_count if delta > 0 else _uncount)(table, index)
