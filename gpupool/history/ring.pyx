# cython: language_level=3, boundscheck=False, wraparound=False
"""What the pools did: the memory history and the debug log (declarations: history/ring.pxd).

The memory history, while it records (``gpupool.record_memory_history``): for each device a
ring of at most ``max_entries`` trace entries (allocations, frees, segment growth and
release, out-of-memory failures) with the calling Python code's frames, and the requested
bytes and allocation frames of each live block recorded. ``gpupool.snapshot`` turns them into
PyTorch's snapshot format. The pools call the hooks with their lock held, so each device's
ring is in the order the pools acted; the ring has its own lock (taken inside a pool's, never
around one), which never waits for the GIL: frames are gathered before it is taken.

Frames are gathered only by a thread that holds the GIL (the C API called without it gets
none, unless its caller gathered them first: hist_gather, for PyTorch's entry points). Each
frame is a code object and an instruction offset, as PyTorch's history keeps them (the line,
which the interpreter finds by walking the code's line table, is looked up for snapshots
only); code objects are interned in a table that keeps a reference to each until recording
stops, so that entries overwritten by a thread without the GIL drop no reference.

The debug log: the pool's C-level code queues what the out-of-memory ladder and the trims did
(hist_log, any thread, under the pool's lock) and the queue is written to
``logging.getLogger("gpupool")`` at DEBUG with the GIL and no pool lock held: by a Python
pending call (``Py_AddPendingCall``, which the interpreter's main thread runs at its next
check, soon) scheduled when the queue's first entry comes, or at once by the Python-level
calls that report on the pool (hist_flush_log: trims, out-of-memory errors, snapshots), so
that their messages come after the queued ones. The allocation path never checks the queue.
"""
from cpython.ref cimport PyObject
from cython.operator cimport dereference as deref
from libc.stdint cimport uintptr_t, uint32_t, int32_t, int64_t
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector
from posix.time cimport clock_gettime, timespec, CLOCK_REALTIME

import itertools
import logging
import weakref

cdef extern from "gp_lock.h" nogil:
    cppclass gp_lock:
        void lock()
        void unlock()

cdef extern from "Python.h" nogil:
    ctypedef struct PyFrameObject
    ctypedef struct PyCodeObject
    int PyGILState_Check()
    int Py_IsInitialized()
    PyFrameObject* PyEval_GetFrame()                    # borrowed
    PyFrameObject* PyFrame_GetBack(PyFrameObject*)      # new reference
    PyCodeObject* PyFrame_GetCode(PyFrameObject*)       # new reference
    int PyCode_Addr2Line(PyCodeObject*, int)
    void Py_IncRef(PyObject*)
    void Py_DecRef(PyObject*)

cdef extern from "Python.h":
    int Py_AddPendingCall(int (*func)(void*) noexcept, void* arg) nogil   # func: with the GIL

# Frames gathered by hist_gather for the calling thread's next entry (packed code << 32 |
# line), with the generation of the code table they index.
cdef extern from *:
    """
    #include <vector>
    #if PY_VERSION_HEX >= 0x030B0000
    #define gp_frame_lasti(f) PyFrame_GetLasti(f)
    #else
    #include <frameobject.h>
    #define gp_frame_lasti(f) ((f)->f_lasti * (int)sizeof(_Py_CODEUNIT))
    #endif
    #if PY_VERSION_HEX >= 0x030D0000
    #define gp_py_finalizing() Py_IsFinalizing()
    #else
    #define gp_py_finalizing() _Py_IsFinalizing()
    #endif
    static thread_local std::vector<unsigned long long> gp_hist_gathered;
    static thread_local unsigned long long gp_hist_gathered_generation = 0;
    static thread_local int gp_hist_gathered_set = 0;
    """
    int gp_py_finalizing() nogil
    int gp_frame_lasti(PyFrameObject*) nogil    # the instruction's offset in bytes
    vector[unsigned long long] gp_hist_gathered
    unsigned long long gp_hist_gathered_generation
    int gp_hist_gathered_set

cdef enum:
    MAX_FRAMES = 64             # frames kept per entry, innermost first
    LOG_MAX = 256               # log entries queued before the newest are dropped

cdef cppclass Entry:
    unsigned long long seq      # order across devices and pools
    HistAction action
    uint32_t pool
    uintptr_t addr              # the device's free bytes for ACT_OOM, as PyTorch's device_free
    size_t size                 # requested bytes (allocations, frees), segment bytes
    uintptr_t stream
    int64_t time_us
    vector[Frame] frames

cdef cppclass Ring:
    vector[Entry] entries
    size_t next                 # once full: the oldest entry, overwritten next

cdef cppclass Live:
    size_t requested
    vector[Frame] frames

cdef struct LogEntry:
    LogKind kind
    int device
    size_t nbytes
    size_t released
    int status

# Under _lock: everything below but the code table.
cdef gp_lock _lock
cdef bint _recording = False
cdef vector[int*] _switches                 # the hot path's copies of _recording
cdef bint _stacks               # gather frames
cdef bint _trace                # keep trace entries ("all"), not only live blocks ("state")
cdef size_t _max_entries = 1
cdef unsigned long long _seq = 0
cdef unsigned long long _generation = 0     # of the code table: bumped when it is cleared
cdef vector[Ring] _rings                    # by device
cdef unordered_map[uintptr_t, Live] _live   # live blocks recorded, by address
cdef unordered_map[uintptr_t, vector[Frame]] _segment_frames    # plain segments, by address
cdef vector[LogEntry] _log
cdef size_t _log_dropped = 0
cdef bint _log_scheduled = False            # a pending call will write the queue
# Under the GIL: the code table.
cdef vector[PyObject*] _codes
cdef unordered_map[uintptr_t, uint32_t] _code_index     # by the code object's address

_pools = weakref.WeakValueDictionary()      # pool id -> Pool, for snapshots of every pool
_pool_ids = itertools.count(1)
_logger = logging.getLogger("gpupool")


cdef void hist_subscribe(int* switch) noexcept nogil:
    """Keep switch[0] equal to whether the history records (a module's copy, read on its hot
    path without a call)."""
    _lock.lock()
    _switches.push_back(switch)
    switch[0] = _recording
    _lock.unlock()


cdef uint32_t register_pool(object pool) except 0:
    """A new pool's id (1, 2, ...): its trace entries carry it; snapshots find it by it."""
    cdef uint32_t pool_id = next(_pool_ids)
    _pools[pool_id] = pool
    return pool_id


# Frames ------------------------------------------------------------------------------------

cdef uint32_t _intern(PyCodeObject* code) noexcept nogil:
    """The code table's index of code (GIL held; takes over the reference given)."""
    cdef PyObject* obj = <PyObject*>code
    cdef uint32_t index
    found = _code_index.find(<uintptr_t>obj)
    if found != _code_index.end():
        Py_DecRef(obj)
        return deref(found).second
    index = <uint32_t>_codes.size()
    _codes.push_back(obj)
    _code_index[<uintptr_t>obj] = index
    return index


cdef void _capture(vector[Frame]* out) noexcept nogil:
    """The calling Python code's frames, innermost first, at most MAX_FRAMES (GIL held)."""
    cdef PyFrameObject* f = PyEval_GetFrame()
    cdef PyFrameObject* back
    out.clear()
    if f == NULL:
        return
    Py_IncRef(<PyObject*>f)
    while f != NULL:
        out.push_back(Frame(_intern(PyFrame_GetCode(f)), gp_frame_lasti(f)))
        back = PyFrame_GetBack(f) if out.size() < MAX_FRAMES else NULL
        Py_DecRef(<PyObject*>f)
        f = back


cdef bint _frames_here(vector[Frame]* out, unsigned long long* generation) noexcept nogil:
    """Frames for an entry made now: the calling Python code's (GIL held), else those
    hist_gather left for this thread's call; False when there are none."""
    cdef size_t i
    cdef unsigned long long packed
    if not _stacks:
        return False
    if PyGILState_Check():
        generation[0] = _generation
        _capture(out)
        return True
    if not gp_hist_gathered_set:
        return False
    generation[0] = gp_hist_gathered_generation
    for i in range(gp_hist_gathered.size()):
        packed = gp_hist_gathered[i]
        out.push_back(Frame(<uint32_t>(packed >> 32), <int32_t><uint32_t>packed))
    return True


cdef bint hist_gather() noexcept nogil:
    """Gather the calling thread's Python frames, taking the GIL, for the entries of the
    call it is about to make (its allocation, the segment it grows): for entry points called
    without the GIL where no lock waits on it (PyTorch's global allocator). Nothing while the
    history does not gather frames. True: gathered; call hist_gathered_done after the call."""
    if not _recording or not _stacks or PyGILState_Check():
        return False
    if not Py_IsInitialized() or gp_py_finalizing():
        return False
    _gather_with_gil()
    return True


cdef void hist_gathered_done() noexcept nogil:
    """The call that hist_gather gathered frames for is over: later entries get none."""
    global gp_hist_gathered_set
    gp_hist_gathered_set = 0


cdef void _gather_with_gil() noexcept with gil:
    global gp_hist_gathered_generation, gp_hist_gathered_set
    cdef vector[Frame] frames
    cdef size_t i
    _capture(&frames)
    gp_hist_gathered.clear()
    for i in range(frames.size()):
        gp_hist_gathered.push_back((<unsigned long long>frames[i].code << 32)
                                   | <uint32_t>frames[i].lasti)
    gp_hist_gathered_generation = _generation
    gp_hist_gathered_set = 1


cdef list hist_frames(vector[Frame]* frames, dict cache):
    """frames as PyTorch's frame dicts ``{"filename", "line", "name"}``, innermost first; the
    same list object for the same frames (cache), so a pickle stores each once."""
    cdef size_t i
    cdef uint32_t code
    cdef int lasti
    key = tuple([(frames[0][i].code, frames[0][i].lasti) for i in range(frames.size())])
    found = cache.get(key)
    if found is not None:
        return found
    out = []
    for code, lasti in key:
        frame = cache.get((code, lasti))
        if frame is None:
            if code >= _codes.size():       # the table was cleared since: no name to give
                continue
            obj = <object>_codes[code]
            frame = cache[(code, lasti)] = {
                "filename": obj.co_filename,
                "line": PyCode_Addr2Line(<PyCodeObject*>_codes[code], lasti),
                "name": obj.co_name}
        out.append(frame)
    cache[key] = out
    return out


# Recording ---------------------------------------------------------------------------------

cdef int64_t _now_us() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_REALTIME, &ts)
    return <int64_t>ts.tv_sec * 1000000 + ts.tv_nsec // 1000


cdef void _append(int device, HistAction action, uint32_t pool, uintptr_t addr, size_t size,
                  uintptr_t stream, const vector[Frame]& frames) noexcept nogil:
    """A new entry of device's ring, with the calling code's frames (the oldest one overwritten
    once it is full; _lock held)."""
    global _seq
    cdef Ring* ring
    cdef Entry* e
    if device < 0:
        device = 0
    if <size_t>device >= _rings.size():
        _rings.resize(device + 1)
    ring = &_rings[device]
    if ring.entries.size() < _max_entries:
        ring.entries.resize(ring.entries.size() + 1)
        e = &ring.entries.back()
    else:
        e = &ring.entries[ring.next]
        ring.next = (ring.next + 1) % ring.entries.size()
    _seq += 1
    e.seq, e.action, e.pool, e.addr, e.size, e.stream = _seq, action, pool, addr, size, stream
    e.time_us = _now_us()
    e.frames = frames


cdef bint _lock_recording(vector[Frame]* frames) noexcept nogil:
    """For an entry: gather the calling code's frames (before the lock: it never waits for
    the GIL), then take the history's lock. Returns whether it records, with the lock held
    (the caller gives it back), or False without the lock; frames gathered before a restart
    of the recording are dropped."""
    cdef unsigned long long generation = 0
    if not _recording:
        return False
    _frames_here(frames, &generation)
    _lock.lock()
    if not _recording:
        _lock.unlock()
        return False
    if generation != _generation:
        frames.clear()
    return True


cdef void _record(int device, uint32_t pool, HistAction action, uintptr_t addr, size_t nbytes,
                  uintptr_t stream) noexcept nogil:
    """One event of the history, while it records: the frames of a live block (ACT_ALLOC,
    forgotten at its ACT_FREE_REQUESTED, whose size becomes the one requested) or of a
    segment, and the trace entry. A free is requested and completed together (the block is
    free for reuse at once, in stream order), as PyTorch records a free without
    record_stream uses."""
    cdef vector[Frame] frames
    cdef Live* live
    if not _lock_recording(&frames):
        return
    if action == ACT_ALLOC:
        live = &_live[addr]
        live.requested = nbytes
        live.frames = frames
    elif action == ACT_FREE_REQUESTED:
        found = _live.find(addr)
        if found != _live.end():
            nbytes = deref(found).second.requested
            _live.erase(found)
    elif action == ACT_SEGMENT_ALLOC:
        _segment_frames[addr] = frames
    elif action == ACT_SEGMENT_FREE:
        _segment_frames.erase(addr)
    if _trace:
        _append(device, action, pool, addr, nbytes, stream, frames)
        if action == ACT_FREE_REQUESTED:
            _append(device, ACT_FREE_COMPLETED, pool, addr, nbytes, stream, frames)
    _lock.unlock()


cdef void hist_alloc(int device, uint32_t pool, uintptr_t addr, size_t nbytes,
                     uintptr_t stream) noexcept nogil:
    _record(device, pool, ACT_ALLOC, addr, nbytes, stream)


cdef void hist_free(int device, uint32_t pool, uintptr_t addr, size_t size,
                    uintptr_t stream) noexcept nogil:
    _record(device, pool, ACT_FREE_REQUESTED, addr, size, stream)


cdef void hist_segment(int device, uint32_t pool, HistAction action, uintptr_t addr,
                       size_t nbytes, uintptr_t stream) noexcept nogil:
    _record(device, pool, action, addr, nbytes, stream)


cdef void hist_oom(int device, uint32_t pool, size_t nbytes, size_t free_bytes,
                   uintptr_t stream) noexcept nogil:
    _record(device, pool, ACT_OOM, free_bytes, nbytes, stream)


cdef unsigned long long hist_seq() noexcept nogil:
    """The last entry's sequence number: entries made later have larger ones."""
    cdef unsigned long long seq
    _lock.lock()
    seq = _seq
    _lock.unlock()
    return seq


cdef bint hist_live(uintptr_t addr, size_t* requested, vector[Frame]* frames) noexcept nogil:
    cdef bint found = False
    _lock.lock()
    it = _live.find(addr)
    if it != _live.end():
        found = True
        requested[0] = deref(it).second.requested
        frames[0] = deref(it).second.frames
    _lock.unlock()
    return found


cdef bint hist_segment_frames(uintptr_t addr, vector[Frame]* frames) noexcept nogil:
    cdef bint found = False
    _lock.lock()
    it = _segment_frames.find(addr)
    if it != _segment_frames.end():
        found = True
        frames[0] = deref(it).second
    _lock.unlock()
    return found


def _configure(bint record, bint trace=True, bint stacks=True, size_t max_entries=1):
    """Start (or change) recording, or stop it and forget everything recorded (``record``
    False). ``max_entries``: the most entries kept per device (>= 1); a smaller one keeps the
    newest."""
    cdef vector[Ring] rings
    cdef unordered_map[uintptr_t, Live] live
    cdef unordered_map[uintptr_t, vector[Frame]] segment_frames
    cdef vector[Entry] kept
    cdef size_t i, j, n
    global _recording, _stacks, _trace, _max_entries, _generation
    _lock.lock()
    if record:
        for i in range(_rings.size()):
            n = _rings[i].entries.size()
            if n > max_entries or (n and _rings[i].next):     # oldest first, then cut
                kept.clear()
                for j in range(n - max_entries if n > max_entries else 0, n):
                    kept.push_back(_rings[i].entries[(_rings[i].next + j) % n])
                _rings[i].entries.swap(kept)
                _rings[i].next = 0
        _stacks, _trace, _max_entries = stacks, trace, max_entries
        _recording = True
    else:
        _recording = _stacks = False
        _rings.swap(rings)
        _live.swap(live)
        _segment_frames.swap(segment_frames)
        _generation += 1
    for i in range(_switches.size()):
        _switches[i][0] = _recording
    _lock.unlock()
    if not record:
        # What was recorded goes with rings, live and segment_frames; the code table goes now
        # (with the GIL, which every user of the table holds).
        for i in range(_codes.size()):
            Py_DecRef(_codes[i])
        _codes.clear()
        _code_index.clear()


def _settings():
    """``(recording, trace, stacks, max_entries)``."""
    _lock.lock()
    out = (bool(_recording), _trace, _stacks, _max_entries)
    _lock.unlock()
    return out


def _last_seq():
    """The sequence number of the last entry made (0: none yet)."""
    return hist_seq()


def _entries(dict cache):
    """Every device's entries, oldest first: a list by device of ``(seq, action, pool, addr,
    size, stream, time_us, frames)`` tuples (``frames``: PyTorch's frame dicts, shared through
    ``cache`` with the snapshot's blocks)."""
    cdef vector[Ring] rings
    cdef size_t d, i, n
    cdef Entry* e
    _lock.lock()
    rings = _rings                  # a copy, made without the GIL being needed
    _lock.unlock()
    out = []
    for d in range(rings.size()):
        n = rings[d].entries.size()
        device = []
        for i in range(n):
            e = &rings[d].entries[(rings[d].next + i) % n]
            device.append((e.seq, <int>e.action, e.pool, e.addr, e.size, e.stream, e.time_us,
                           hist_frames(&e.frames, cache)))
        out.append(device)
    return out


def _pool(uint32_t pool_id):
    """The live pool of an id, or None."""
    return _pools.get(pool_id)


def _live_pools():
    """``{pool id: Pool}`` of every pool alive."""
    return dict(_pools.items())


# The debug log -----------------------------------------------------------------------------

cdef void hist_log(LogKind kind, int device, size_t nbytes, size_t released,
                   int status) noexcept nogil:
    global _log_dropped, _log_scheduled
    cdef bint schedule
    _lock.lock()
    if _log.size() < LOG_MAX:
        _log.push_back(LogEntry(kind, device, nbytes, released, status))
    else:
        _log_dropped += 1
    schedule = not _log_scheduled
    _log_scheduled = True
    _lock.unlock()
    # Py_AddPendingCall needs no GIL and takes no lock of ours; its queue may be full, or
    # the interpreter going: the entries then wait for the next entry or hist_flush_log.
    if schedule and not (Py_IsInitialized() and not gp_py_finalizing()
                         and Py_AddPendingCall(_pending_write, NULL) == 0):
        _lock.lock()
        _log_scheduled = False
        _lock.unlock()


cdef int _pending_write(void* arg) noexcept:
    """The pending call: run by the interpreter with the GIL, outside every pool's lock."""
    global _log_scheduled
    _lock.lock()
    _log_scheduled = False
    _lock.unlock()
    _write_log()
    return 0


cdef void hist_flush_log() noexcept nogil:
    """Write the queued log entries now, if the calling thread holds the GIL (else the
    pending call will). The caller holds no pool lock: a handler may do anything."""
    if not _log.empty() and PyGILState_Check():
        _write_log()


def flush_log():
    """Write the queued debug log entries to the ``"gpupool"`` logger (Python code that
    reports on pools calls it first, so their messages come in order)."""
    hist_flush_log()


_RETRY = {True: "succeeded", False: "failed"}
_MESSAGES = {
    LOG_LADDER_NOTHING: "out of memory growing the pool of device {device} for {nbytes} B "
                        "with nothing cached to give back: the ladder goes on to the on_oom "
                        "callbacks",
    LOG_LADDER_TRIM: "out of memory growing the pool of device {device} for {nbytes} B: "
                     "step 1, gave the pool's cache back ({released} B released); the retry "
                     "{retry}",
    LOG_LADDER_REGIONS: "out of memory growing the pool of device {device} for {nbytes} B: "
                        "step 2, gave every region's cache back ({released} B released); the "
                        "retry {retry}",
    LOG_CALLBACK_RETRY: "out of memory on device {device} for {nbytes} B: the retry after "
                        "the on_oom callbacks {retry}",
    LOG_SOFT_TRIM: "the pool of device {device} went above its soft limit of {nbytes} B: "
                   "trim released {released} B",
    LOG_STREAM_TRIM: "more than {nbytes} streams of device {device} wait for blocks of "
                     "streams that no longer allocate: synchronized and trimmed, {released} "
                     "B released",
    LOG_OOM: "out of memory on device {device} for {nbytes} B after the ladder: the C API "
             "returns GPUPOOL_ERROR_OUT_OF_MEMORY",
}


cdef void _write_log() noexcept with gil:
    global _log_dropped
    cdef vector[LogEntry] entries
    cdef LogEntry e
    cdef size_t i, dropped
    _lock.lock()
    entries.swap(_log)
    dropped, _log_dropped = _log_dropped, 0
    _lock.unlock()
    if not _logger.isEnabledFor(logging.DEBUG):
        return
    for i in range(entries.size()):
        e = entries[i]
        _logger.debug("gpupool: " + _MESSAGES[e.kind].format(
            device=e.device, nbytes=e.nbytes, released=e.released, retry=_RETRY[e.status == 0]))
    if dropped:
        _logger.debug("gpupool: %d more log entries were dropped (at most %d wait for a "
                      "thread with the GIL)", dropped, LOG_MAX)
