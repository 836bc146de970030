# cython: language_level=3, boundscheck=False, wraparound=False
"""The exporter's side of CUDA IPC: the records of exported buffers, ranges and segments, the
handles made from them, and their collection (the Python API and its documentation:
``gpupool.ipc``).

An exported buffer has a slot of this process's export table (``ipc/table.pyx``), which goes
RETIRED when the buffer gives its block back (``DeviceBuffer._ipc_retired``), so a later
open fails instead of reading memory the pool reuses. An exported upstream allocation (a plain
segment: "mem_handle" handles) has a slot whose ``opened`` counts the importers' mappings of
it: the pool does not return the segment to the driver while it is above 0
(``core/segments.pxd``), since freeing memory another process holds open through
``cuIpcOpenMemHandle`` is undefined.

The upstream performs the driver's side (``Upstream._ipc_*``: ``cuIpcGetMemHandle``,
``cuMemExportToShareableHandle``, IPC events); this module knows the pool's records (a
block's segment and its pages) and the slots.
"""
from cpython.ref cimport PyObject
from libc.stdint cimport uintptr_t
from gpupool.records.block cimport Block, Segment
from gpupool.buffer.device_buffer cimport DeviceBuffer
from gpupool.driver.calls cimport forked
from gpupool.buffer.handoff cimport recordable
from gpupool.records.ipcslot cimport (
    gp_ipc_slot, GP_IPC_LIVE, GP_IPC_RETIRED, gp_ipc_opened, gp_ipc_state, gp_ipc_serial,
    gp_ipc_retire, gp_ipc_claim, gp_ipc_free, gp_ipc_reset_opened,
)
from gpupool.core.pool cimport Pool
from gpupool.records.streams cimport stream_handle
from gpupool.ipc.table cimport SLOTS, Table, own_table, current_own_table, made_own_table

import os
import weakref

from gpupool.buffer.hooks import install_ipc_exporter
from gpupool.core.oom import on_oom
from gpupool.errors import FORK_MESSAGE, GpupoolError, IpcError
from gpupool.ipc.handle import IpcHandle
from gpupool.ipc.mapping import Imported, mapping_counts
from gpupool.ipc.table import lock, slot_locked

cdef extern from "Python.h":
    Py_ssize_t Py_REFCNT(PyObject* o)

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


def collect():
    """Free what the exports of given-back buffers still hold (their IPC events and page
    descriptors, which keep virtual-memory pages allocated), reuse their slots, and forget the
    counts of importers that died without closing a segment (no lock of theirs backs them),
    so a trim can return it. Returns the number of exports forgotten."""
    global _sweep_limit
    cdef gp_ipc_slot* slot
    cdef int opened
    cdef Table own
    forgotten = 0
    with lock:
        own = current_own_table()
        if own is None:
            return 0
        for index, record in list(_records.items()):
            slot = own.slot(index)
            if record.alive is not None and gp_ipc_state(slot) == GP_IPC_LIVE \
                    and not record.alive():
                gp_ipc_retire(slot)
            opened = gp_ipc_opened(slot)
            if record.mem is not None and opened > 0 and not slot_locked(own, index):
                # An importer locks before it counts and counts down before it unlocks: a
                # count without a lock is a dead importer's (and one counting since fails
                # the exchange, to be looked at next time).
                if gp_ipc_reset_opened(slot, opened):
                    opened = 0
            if gp_ipc_state(slot) != GP_IPC_RETIRED:
                continue
            record.free_resources()
            if record.mem is None or opened <= 0:
                del _records[index]
                _unclaim(own, slot)
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
        on_oom(_collect_on_oom)
        _collecting = True


cdef object _buffer_record(DeviceBuffer holder, Table table):
    """The export record of the gpupool buffer holding a block (made at its first export)."""
    cdef gp_ipc_slot* slot
    if holder._ipc_slot != NULL:
        return _records[table.index(holder._ipc_slot)]
    slot = _claim(table)
    record = _Record(table.index(slot), gp_ipc_serial(slot), holder.pool.upstream)
    try:
        record.event = holder.pool.upstream._ipc_event_create()
    except BaseException:
        _unclaim(table, slot)
        raise
    _records[record.index] = record
    holder._ipc_slot = slot
    # The buffer object's death frees the event and descriptors at once (close() leaves
    # them to the next collect: the buffer may be exported no more, but it is alive).
    weakref.finalize(holder, _free_record_resources, record)
    return record


def _free_record_resources(record):
    with lock:
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
    cdef DeviceBuffer base
    cdef uintptr_t handle
    cdef bint found = False
    if forked():
        raise GpupoolError(FORK_MESSAGE)
    if buf._nbytes == 0:
        raise ValueError("an empty buffer has no memory to share (ipc_handle needs nbytes > 0)")
    base = buf if buf._blk != NULL else buf._base
    handle = stream_handle(stream) if stream is not None else recordable(buf._stream)
    if base is None or base._blk == NULL:
        if isinstance(buf._exporter, Imported):
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
            base = holder
        elif found:
            return export_range(buf.pool, buf._ptr, buf._nbytes, handle, _alive(buf))
        else:
            raise IpcError(
                f"this buffer wraps memory that gpupool does not own "
                f"({type(buf._exporter).__name__} through gpupool.as_buffer; no block of "
                f"{buf.pool!r} holds it): only memory of a gpupool pool can be exported. Share "
                f"the memory through its allocator's IPC (CuPy: cupy.cuda.runtime.ipcGetMemHandle, "
                f"PyTorch: torch.multiprocessing), or copy it into a gpupool buffer first "
                f"(pool.allocate(n).copy_from_host(array))", "foreign_memory")
    with lock:
        table = own_table()
        _maybe_collect()
        record = _buffer_record(base, table)
        return _export(base.pool, base._blk, buf._ptr, buf._nbytes, handle, record, table)


def _alive(DeviceBuffer wrapper):
    """Whether the memory of an ``as_buffer`` wrapper is still held: its exporter (the array)
    is alive, or where that takes no weak reference, the wrapper."""
    try:
        ref = weakref.ref(wrapper._exporter)
    except TypeError:
        ref = weakref.ref(wrapper)
    return lambda: ref() is not None


cdef Block* _find_block(Pool pool, uintptr_t ptr, size_t nbytes) noexcept nogil:
    """The live block of pool holding [ptr, ptr + nbytes), or NULL (Pool.find_live)."""
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
    ``alive()`` says whether the memory is still held (an open after it stops fails,
    as for a buffer given back). For ``gpupool.torch``.

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
    blk = _find_block(pool, ptr, nbytes)        # not under lock: the pool's lock is taken
    if blk == NULL:
        raise IpcError(f"{nbytes} B at {ptr:#x} are not in one live block of {pool!r}",
                       "foreign_memory")
    with lock:                                  # the caller holds the memory: blk lives
        table = own_table()
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


def _stats():
    """For tests: the exporter's records and free slots, the importer's mappings."""
    cdef Table own
    with lock:
        own = made_own_table()
        mappings, cached_mappings = mapping_counts()
        return {"records": len(_records), "free_slots": len(_free_slots),
                "used_slots": _next_slot - 1 - len(_free_slots),
                "mappings": mappings, "cached_mappings": cached_mappings,
                "table": None if own is None else own.path}


install_ipc_exporter(export_buffer)
