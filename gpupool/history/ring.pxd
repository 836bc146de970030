# What the pools did, written without the GIL and read from Python: the memory history (a
# bounded ring of allocation, free and segment events per device, with Python frames, and the
# allocation frames of live blocks: gpupool.snapshot builds PyTorch's snapshot format from
# them) and the debug log of the out-of-memory ladder and of trims (queued here, written to
# logging.getLogger("gpupool") with the GIL, never under a pool's lock: by a Python pending
# call that the queue's first entry schedules, or at once by Python-level calls that report).
#
# Each module of the hot path keeps its own copy of the history's switch, a plain int that
# hist_subscribe registers and the history writes (under its lock) when recording starts or
# stops: recording off costs one predictable branch per allocation and per free (a compare
# with a global and a jump), and logging none.
from libc.stdint cimport uintptr_t, uint32_t, int32_t
from libcpp.vector cimport vector
from gpupool.records.streams cimport StreamKey

# Trace actions, named as in PyTorch's snapshots (gpupool.snapshot.ACTIONS).
cdef enum HistAction:
    ACT_ALLOC = 0
    ACT_FREE_REQUESTED = 1
    ACT_FREE_COMPLETED = 2
    ACT_SEGMENT_ALLOC = 3
    ACT_SEGMENT_FREE = 4
    ACT_SEGMENT_MAP = 5
    ACT_SEGMENT_UNMAP = 6
    ACT_OOM = 7

# Log entries (their messages are in history/ring.pyx, _MESSAGES).
cdef enum LogKind:
    LOG_LADDER_NOTHING = 0      # growth failed with nothing cached to give back
    LOG_LADDER_TRIM = 1         # ladder step 1: the pool's cache given back, retried
    LOG_LADDER_REGIONS = 2      # ladder step 2: every region's cache given back, retried
    LOG_CALLBACK_RETRY = 3      # ladder step 3: retried after the on_oom callbacks
    LOG_SOFT_TRIM = 4           # reserved bytes above the soft limit: trimmed
    LOG_STREAM_TRIM = 5         # too many streams waiting for idle streams' blocks: trimmed
    LOG_OOM = 6                 # out of memory returned to a C API caller

# A Python frame: its code object (an index into the history's table of code objects, which
# holds a reference to each) and the offset of its instruction (its line is looked up only
# when a snapshot is made: the lookup walks the code's line table).
cdef struct Frame:
    uint32_t code
    int32_t lasti

cdef void hist_subscribe(int* switch) noexcept nogil

# The hot path's test of a switch: predicted off, so the compiler lays the recording branch
# out of line and keeps the allocation path as it is without it.
cdef extern from *:
    """
    #define GP_HIST_ON(flag) __builtin_expect((flag) != 0, 0)
    """
    bint hist_on "GP_HIST_ON" (int flag) nogil
cdef uint32_t register_pool(object pool) except 0

# Recording (called while the pool's lock is held, so the ring's order is the pool's; each
# takes the history's lock itself and returns at once when the history does not record).
# pool: the pool's id (register_pool); stream: the stream's handle. Frames are the calling
# Python code's when the thread holds the GIL, else those hist_gather gathered for the
# thread's call in progress (until hist_gathered_done), else none.
cdef void hist_alloc(int device, uint32_t pool, uintptr_t addr, size_t nbytes,
                     uintptr_t stream) noexcept nogil
cdef void hist_free(int device, uint32_t pool, uintptr_t addr, size_t size,
                    uintptr_t stream) noexcept nogil
cdef void hist_segment(int device, uint32_t pool, HistAction action, uintptr_t addr,
                       size_t nbytes, uintptr_t stream) noexcept nogil
cdef void hist_oom(int device, uint32_t pool, size_t nbytes, size_t free_bytes,
                   uintptr_t stream) noexcept nogil
cdef bint hist_gather() noexcept nogil
cdef void hist_gathered_done() noexcept nogil
cdef unsigned long long hist_seq() noexcept nogil

# The debug log: queue an entry (any thread, any lock held), write the queue now (GIL held, no
# pool lock held by the caller).
cdef void hist_log(LogKind kind, int device, size_t nbytes, size_t released,
                   int status) noexcept nogil
cdef void hist_flush_log() noexcept nogil

# The snapshot's side: a live block's requested bytes and allocation frames, a plain
# segment's allocation frames, as recorded (False: none was; read under the pool's lock), and
# frames as PyTorch's frame dicts (with the GIL; cache: dicts made so far, shared).
cdef bint hist_live(uintptr_t addr, size_t* requested, vector[Frame]* frames) noexcept nogil
cdef bint hist_segment_frames(uintptr_t addr, vector[Frame]* frames) noexcept nogil
cdef list hist_frames(vector[Frame]* frames, dict cache)


cdef inline uintptr_t hist_stream(StreamKey s) noexcept nogil:
    """The stream value of a trace entry: the stream's handle (0: the legacy default)."""
    return s.handle
