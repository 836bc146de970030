# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The pool: size classes, free lists, stream-ordered reuse, slabs, limits, statistics.

Policy in brief (DESIGN.md has the contract):

* A request is rounded up to a size class: multiples of 512 B up to 4 KiB, then eight classes
  per power of two, so rounding wastes at most 511 B below 4 KiB and at most 1/8 above.
* Blocks of classes up to 256 KiB are carved from shared 2 MiB slabs, so the upstream is not
  called for every small allocation; a slab goes back only when all its blocks are free.
* A larger request that finds no cached block of its class is cut from the smallest cached
  larger block (the rest stays cached; a block of at most 1.5 times the size that would
  leave less than 1 MiB serves whole) before the pool grows. Outside regions, new blocks up to
  10 MiB are cut from segments of up to 20 MiB (an eighth of the pool's reserved bytes at
  most), so that mid-sized blocks share upstream allocations and their frees can join; a
  region's blocks, reused as they are every step, are allocated exactly. A freed piece joins
  its free neighbours of the same upstream allocation (on one stream), so pieces become one
  block again; a trim gives an upstream allocation back once all of it is free.
* Free blocks are binned by (size class, stream). A block goes back to its own stream at once,
  and a free never calls the driver. Another stream takes it once an event recorded on the
  old stream after the free reports complete (``cuEventQuery``; such blocks are preferred) or
  after making the new stream wait for that event on the GPU (``cuStreamWaitEvent``); the
  allocation path never blocks the host. Events are recorded only on streams known to be
  alive: the legacy default stream and the calling thread's per-thread stream at once, any
  other stream the next time it allocates (a buffer may outlive the stream it was used on, and
  a destroyed stream must never be touched). Blocks of streams that never come back are freed
  for all by a trim.
* When the upstream fails: release this pool's cached blocks, retry; drain every region's
  cache, retry; then the caller runs the ``on_oom`` callbacks and retries once more before
  raising ``OutOfMemoryError``.

Everything here runs under the pool's mutex, taken without blocking other Python threads
(the GIL is released while waiting). A free made by the thread that holds the mutex (a
garbage collection run by a Python upstream, say) is deferred until that thread unlocks.
"""
from libc.stdint cimport uintptr_t
from libc.stdlib cimport calloc, free
from libcpp.vector cimport vector
from libcpp.algorithm cimport push_heap, pop_heap, make_heap
from gpupool._block cimport (
    Block, Slab, StreamKey, StreamBin, FreeLists, RegionCache, HeapItem,
    LIVE, FREE_POOL, FREE_REGION,
)
from gpupool._upstream cimport Upstream, DriverUpstream, AsyncUpstream
from cuda.bindings.cydriver cimport CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_INVALID_HANDLE

from gpupool.errors import GpupoolError, OutOfMemoryError
from gpupool.stats import PoolStats, format_bytes

cdef extern from "Python.h" nogil:
    ctypedef struct PyThreadState
    int PyGILState_Check()
    PyThreadState* PyEval_SaveThread()
    void PyEval_RestoreThread(PyThreadState*)

cdef extern from "<pthread.h>" nogil:
    int pthread_atfork(void (*prepare)() noexcept, void (*parent)() noexcept,
                       void (*child)() noexcept)

# The calling thread's stack of entered regions (and uncached() markers), innermost last:
# plain thread-local data, so reading it costs no TLS initialization check.
cdef extern from *:
    """
    #define GP_REGION_DEPTH_MAX 64
    static thread_local void* gp_region_stack[GP_REGION_DEPTH_MAX];
    static thread_local int gp_region_depth = 0;
    static int gp_forked = 0;
    static void gp_on_fork_child(void) { gp_forked = 1; }
    """
    int GP_REGION_DEPTH_MAX
    void* gp_region_stack[]
    int gp_region_depth
    int gp_forked
    void gp_on_fork_child() noexcept nogil

pthread_atfork(NULL, NULL, gp_on_fork_child)

# Size classes and slabs.
cdef size_t SMALL_STEP = 512            # class granularity up to SMALL_MAX
cdef size_t SMALL_MAX = 4096
cdef int SMALL_CLASSES = 8              # SMALL_MAX / SMALL_STEP
cdef size_t SLAB_BYTES = 2 << 20
cdef size_t SLAB_BLOCK_MAX = 256 << 10  # larger blocks come straight from the upstream
cdef size_t MAX_NBYTES = 1 << 50        # requests above 1 PiB are refused as absurd

cdef uintptr_t STREAM_LEGACY = 1        # CU_STREAM_LEGACY, folded into handle 0
cdef uintptr_t STREAM_PER_THREAD = 2    # CU_STREAM_PER_THREAD
cdef int FIT_CLASSES = 4               # a request may take a cached block <= 4 classes up, <= 1.5x
cdef size_t SPLIT_MIN = 1 << 20         # a cached large block is cut if this much is left
cdef size_t SEGMENT_FOR = 10 << 20      # a new block up to this size is cut from a segment
cdef size_t SEGMENT_BYTES = 20 << 20    # of at most this size
cdef size_t SEGMENT_SHARE = 8           # and at most this share of the pool's reserved bytes
cdef size_t WANTED_MAX = 256           # streams asked for events before a synchronize
cdef uintptr_t HANDLE_MAX = <uintptr_t>0xFFFFFFFFFFFFFFFF
cdef StreamKey NO_STREAM = StreamKey(HANDLE_MAX, 0)   # never used: any stream may take it

cdef buffer_factory _make_buffer = NULL
_oom_callbacks = []


cdef inline int _bit_length(size_t n) noexcept nogil:
    return 64 - __builtin_clzll(n) if n else 0

cdef extern from *:
    int __builtin_clzll(unsigned long long) nogil


cdef inline int class_index(size_t nbytes) noexcept nogil:
    """Size-class index of a request of nbytes > 0."""
    cdef int b
    cdef size_t half, step
    if nbytes <= SMALL_MAX:
        return <int>((nbytes + SMALL_STEP - 1) // SMALL_STEP) - 1
    b = _bit_length(nbytes - 1)             # 2**(b-1) < nbytes <= 2**b
    half = (<size_t>1) << (b - 1)
    step = half >> 3
    return SMALL_CLASSES + (b - 13) * 8 + <int>((nbytes - half + step - 1) // step) - 1


cdef inline size_t class_size(int cls) noexcept nogil:
    cdef int octave, k
    if cls < SMALL_CLASSES:
        return (cls + 1) * SMALL_STEP
    octave = (cls - SMALL_CLASSES) // 8
    k = (cls - SMALL_CLASSES) % 8 + 1
    return ((<size_t>1) << (12 + octave)) + k * ((<size_t>1) << (9 + octave))


cdef inline int floor_class(size_t size) noexcept nogil:
    """The largest size class no larger than size (>= SMALL_STEP): the bin of a block whose
    size is not a class's own (a piece, an exact block)."""
    cdef int cls = class_index(size)
    if class_size(cls) > size:
        cls -= 1
    return cls


def size_class(nbytes):
    """Bytes reserved for a request of ``nbytes`` (its size class); 0 for 0.

    Parameters
    ----------
    nbytes : int
        Request in bytes, 0 <= nbytes <= 2**50.
    """
    cdef size_t n = _check_nbytes(nbytes)
    return class_size(class_index(n)) if n else 0


cdef size_t _check_nbytes(object nbytes) except? 0xFFFFFFFFFFFFFFFF:
    if type(nbytes) is not int:
        if isinstance(nbytes, bool) or not hasattr(type(nbytes), "__index__"):
            raise TypeError(f"nbytes must be an integer, got {type(nbytes).__name__}")
        nbytes = nbytes.__index__()
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes > MAX_NBYTES:
        raise ValueError(f"nbytes={nbytes} is larger than any device (limit {MAX_NBYTES} B)")
    return <size_t>nbytes


cdef inline bint _same(StreamKey a, StreamKey b) noexcept nogil:
    return a.handle == b.handle and a.tag == b.tag


cdef uintptr_t stream_handle(object stream) except? 0xFFFFFFFFFFFFFFFF:
    """Raw CUstream handle of a stream given as None, an int or a stream object.

    Accepts ``__cuda_stream__`` (returns ``(version, handle)``), PyTorch's ``.cuda_stream``,
    CuPy's ``.ptr`` and Numba's or cuda.core's ``.handle``.
    """
    if stream is None:
        return 0
    if type(stream) is not int:
        if hasattr(stream, "__cuda_stream__"):
            value = stream.__cuda_stream__()
            if not (isinstance(value, tuple) and len(value) == 2):
                raise TypeError(f"__cuda_stream__() must return (version, handle), got "
                                f"{value!r}")
            stream = value[1]
        elif hasattr(stream, "cuda_stream"):
            stream = stream.cuda_stream
        elif hasattr(stream, "ptr"):
            stream = stream.ptr
        elif hasattr(stream, "handle"):
            stream = stream.handle
            stream = getattr(stream, "value", stream) or 0      # ctypes.c_void_p
        if not isinstance(stream, int) or isinstance(stream, bool):
            raise TypeError(
                f"stream must be None, an int handle or a stream object with __cuda_stream__,"
                f" .cuda_stream, .ptr or .handle; got {type(stream).__name__}")
    if stream < 0 or stream >= HANDLE_MAX:
        raise ValueError(f"invalid stream handle {stream}")
    return <uintptr_t>stream


cdef void set_buffer_factory(buffer_factory factory) noexcept:
    global _make_buffer
    _make_buffer = factory


cdef int region_push(RegionCache* rc) except -1:
    """Make rc the calling thread's innermost region (or marker)."""
    global gp_region_depth
    if gp_region_depth >= GP_REGION_DEPTH_MAX:
        raise GpupoolError(f"regions nested more than {GP_REGION_DEPTH_MAX} deep on one "
                           f"thread (uncached() counts as one)")
    gp_region_stack[gp_region_depth] = <void*>rc
    gp_region_depth += 1
    return 0


cdef void region_pop(RegionCache* rc) noexcept nogil:
    """Remove the innermost entry of rc from the calling thread's stack."""
    global gp_region_depth
    cdef int i = gp_region_depth, j
    while i:
        i -= 1
        if gp_region_stack[i] == <void*>rc:
            for j in range(i, gp_region_depth - 1):
                gp_region_stack[j] = gp_region_stack[j + 1]
            gp_region_depth -= 1
            return


# Pushed by uncached() (and by a region skipping its first entry): regions below it on the
# thread's stack do not apply. Any unique address serves as the marker.
cdef RegionCache* UNCACHED = <RegionCache*>&gp_forked


cdef RegionCache* uncached_marker() noexcept nogil:
    return UNCACHED


class uncached:
    """Context manager: allocations inside come from the pool, not from any region.

    For buffers meant to outlive the step of an enclosing region (a logged loss, a lazily
    created workspace); covers the calling thread.
    """

    def __enter__(self):
        region_push(UNCACHED)
        return self

    def __exit__(self, *exc):
        region_pop(UNCACHED)
        return False


cdef bint forked() noexcept nogil:
    return gp_forked != 0


# Free lists -------------------------------------------------------------------------------

cdef inline void _push(FreeLists* fl, Block* b) noexcept nogil:
    cdef vector[StreamBin]* bins
    cdef size_t i, n, empty
    if fl.bins.size() <= <size_t>b.cls:
        fl.bins.resize(b.cls + 1)
    bins = &fl.bins[b.cls]
    n = empty = bins.size()
    for i in range(n):
        if _same(bins[0][i].key, b.stream):
            break
        if empty == n and bins[0][i].heap.empty():
            empty = i
    else:
        # Empty bins are reused (their storage too), so streams that went idle do not
        # fragment the lists and the steady state allocates nothing.
        if empty == n:
            bins.resize(n + 1)
        i = empty
        bins[0][i].key = b.stream
    bins[0][i].heap.push_back(HeapItem(~b.rank, b))
    push_heap(bins[0][i].heap.begin(), bins[0][i].heap.end())


cdef inline Block* _pop(vector[StreamBin]* bins, size_t i) noexcept nogil:
    cdef vector[HeapItem]* heap = &bins[0][i].heap
    pop_heap(heap.begin(), heap.end())
    cdef Block* b = heap.back().second
    heap.pop_back()
    return b


cdef class Pool:
    """A caching pool of device memory on one device.

    ``Pool(device=0, upstream="driver", hard_limit=None, soft_limit=None)``

    Parameters
    ----------
    device : int
        Device ordinal (ignored when ``upstream`` is an ``Upstream`` object, whose device
        is used).
    upstream : {"driver", "async"} or gpupool.Upstream
        Where memory comes from: ``"driver"`` (``cuMemAlloc`` / ``cuMemFree`` on the
        device's primary context), ``"async"`` (a driver memory pool of the pool's own,
        ``cuMemAllocFromPoolAsync`` on the requesting stream / ``cuMemFreeAsync``, whose
        release threshold is the soft limit: see ``gpupool.AsyncUpstream``) or an
        ``Upstream`` object such as ``gpupool.testing.SimulatedDevice``.
    hard_limit, soft_limit : int or str, optional
        Bytes the pool may reserve (hard: never exceeded; soft: cached blocks are released
        when exceeded), as an int or a string such as ``"512MiB"``, ``"8GB"``, ``"50%"``.
        Default: ``GPUPOOL_HARD_LIMIT`` / ``GPUPOOL_SOFT_LIMIT`` from the environment.

    Raises
    ------
    NoDeviceError
        No driver or no such device (driver upstream).
    ValueError, TypeError
        A malformed limit or upstream.
    """

    def __cinit__(self, int device=0, upstream="driver", hard_limit=None, soft_limit=None):
        from gpupool.limits import resolve_limits
        if isinstance(upstream, Upstream):
            self.upstream = upstream
        elif upstream == "driver":
            self.upstream = DriverUpstream(device)
        elif upstream == "async":
            self.upstream = AsyncUpstream(device)
        elif isinstance(upstream, str):
            raise ValueError(f"upstream must be 'driver', 'async' or an Upstream object, "
                             f"got {upstream!r}")
        else:
            raise TypeError(f"upstream must be 'driver', 'async' or an Upstream object, "
                            f"got {type(upstream).__name__}")
        self.device = self.upstream.device
        self._hard_limit, self._soft_limit = resolve_limits(
            hard_limit, soft_limit, lambda: self.mem_info()[1])
        # A stream-ordered upstream keeps freed memory up to the soft limit for regrowth.
        self.upstream.raise_error(self.upstream.set_release_threshold(self._soft_limit),
                                  "set_release_threshold")

    def __dealloc__(self):
        # Buffers and regions hold references to their pool, so only free lists remain.
        cdef size_t i
        if gp_forked or self.upstream is None:
            return
        self._mutex.lock()
        self.release_cached()
        for i in range(self._events.size()):
            self.upstream.event_destroy(self._events[i])
        self._mutex.unlock()

    # Locking --------------------------------------------------------------------------

    cdef void lock(self) noexcept nogil:
        if not self._mutex.try_lock():
            self._wait()
        self._owner = _thread()

    cdef void _wait(self) noexcept nogil:
        # A Python thread waiting for the lock lets the others run: the holder may need the
        # GIL (a Python upstream), and must not deadlock against us.
        cdef PyThreadState* state
        if PyGILState_Check():
            state = PyEval_SaveThread()
            self._mutex.lock()
            PyEval_RestoreThread(state)
        else:
            self._mutex.lock()

    cdef void unlock(self) noexcept nogil:
        cdef Block* b
        while not self._deferred.empty():
            b = self._deferred.back()
            self._deferred.pop_back()
            self.release_locked(b, b.stream)
        self._owner = 0
        self._mutex.unlock()

    # Allocation -----------------------------------------------------------------------

    cdef StreamKey created_stream_key(self, uintptr_t handle) noexcept nogil:
        """The key of a created stream (handle > 2; pool_key() handles the default streams):
        it carries the driver's stream ID, so a handle value reused after cuStreamDestroy
        names another stream. A handle the driver refuses (not a stream, or destroyed) gets
        the tag BAD_STREAM_TAG: allocations refuse it (checked_key), frees use tag 0."""
        cdef unsigned long long sid = 0
        if self.upstream.stream_id(handle, &sid) != 0:
            return StreamKey(handle, BAD_STREAM_TAG)
        return StreamKey(handle, <uintptr_t>sid)

    cdef int stream_status(self, uintptr_t handle) noexcept nogil:
        """The driver's status for a stream handle whose key came out bad (asked again, for
        the error; CUDA_ERROR_INVALID_HANDLE should it now answer)."""
        cdef unsigned long long sid = 0
        cdef int r = self.upstream.stream_id(handle, &sid)
        return r if r != 0 else CUDA_ERROR_INVALID_HANDLE

    cdef StreamKey checked_key(self, uintptr_t handle) except *:
        """pool_key, raising the driver's error for a handle it refuses (not a stream, or a
        destroyed one): for allocations and stream changes, where a bad handle is the
        caller's mistake."""
        cdef StreamKey key = pool_key(self, handle)
        if key.tag == BAD_STREAM_TAG:
            self.upstream.raise_error(self.stream_status(handle),
                                      f"cuStreamGetId (stream handle {handle:#x})")
        return key

    cdef RegionCache* _current_region(self) noexcept nogil:
        cdef int i = gp_region_depth
        cdef RegionCache* rc
        while i:
            i -= 1
            rc = <RegionCache*>gp_region_stack[i]
            if rc == UNCACHED:
                return NULL
            if rc.pool == <void*>self:
                return rc
        return self._process_region

    cdef uintptr_t _event(self) noexcept nogil:
        """A recycled or new event; 0 when none could be created."""
        cdef uintptr_t e = 0
        if not self._events.empty():
            e = self._events.back()
            self._events.pop_back()
        elif self.upstream.event_create(&e) != 0:
            return 0
        return e

    cdef void _drop_events(self, Block* b) noexcept nogil:
        cdef size_t i
        if b.event:
            self._events.push_back(b.event)
            b.event = 0
        if b.extra_events != NULL:
            for i in range(b.extra_events.size()):
                self._events.push_back(b.extra_events[0][i])
            del b.extra_events
            b.extra_events = NULL

    cdef bint _after(self, uintptr_t event, StreamKey s, bint wait) noexcept nogil:
        """Whether work on s is ordered after event: it has completed, or (wait) s now waits
        for it on the GPU (cuStreamWaitEvent), which never blocks the host."""
        if self.upstream.event_query(event) == 0:
            return True
        return wait and self.upstream.stream_wait(s.handle, event) == 0

    cdef bint _ready(self, Block* b, StreamKey s, bint wait) noexcept nogil:
        """Whether stream s may use b now: all work on b's earlier streams, submitted before
        its free, has completed or (wait) is ordered before s's next work."""
        cdef size_t i
        if not (_same(b.stream, s) or _same(b.stream, NO_STREAM)):
            if b.event == 0:
                # The legacy stream and this thread's per-thread stream always exist: record
                # now. Another stream may be gone; ask for an event when it next allocates.
                if not (b.stream.handle == 0 or (b.stream.handle == STREAM_PER_THREAD and
                                                 b.stream.tag == _thread())):
                    self._mark_stream(b.stream)
                    return False
                b.event = self._event()
                if b.event == 0:
                    return False
                if self.upstream.event_record(b.event, b.stream.handle) != 0:
                    self._events.push_back(b.event)
                    b.event = 0
                    return False
            if not self._after(b.event, s, wait):
                return False
        if b.extra_events != NULL:
            for i in range(b.extra_events.size()):
                if not self._after(b.extra_events[0][i], s, wait):
                    return False
        self._drop_events(b)
        return True

    cdef Block* _take(self, FreeLists* fl, int cls, StreamKey s) noexcept nogil:
        cdef vector[StreamBin]* bins
        cdef size_t i, n, same, fresh
        cdef int wait
        cdef Block* b
        if <size_t>cls >= fl.bins.size():
            return NULL
        bins = &fl.bins[cls]
        n = same = fresh = bins.size()
        # Fast path, the steady state of one stream: its bin first, its oldest block free of
        # other streams' events.
        if n and _same(bins[0][0].key, s) and not bins[0][0].heap.empty():
            b = bins[0][0].heap.front().second
            if b.extra_events == NULL:          # as _ready(b, s) for its own stream
                self._drop_events(b)
                return _pop(bins, 0)
        for i in range(n):
            if bins[0][i].heap.empty():
                continue
            if _same(bins[0][i].key, s):
                same = i
            elif _same(bins[0][i].key, NO_STREAM):
                fresh = i
        # This stream's blocks first (same addresses, no wait), then never-used ones, then
        # other streams' blocks whose work has completed, then (GPU-side wait) the others.
        if same < n and self._ready(bins[0][same].heap.front().second, s, True):
            return _pop(bins, same)
        if fresh < n:
            return _pop(bins, fresh)
        for wait in range(2):
            for i in range(n):
                if i != same and not bins[0][i].heap.empty() and \
                        self._ready(bins[0][i].heap.front().second, s, wait):
                    return _pop(bins, i)
        return NULL

    cdef Block* _take_larger(self, int cls, StreamKey s) noexcept nogil:
        """A free block of one of the FIT_CLASSES next larger classes (at most 1.5 times
        the size), smallest first: cached memory serves a request before the pool grows, so
        a program whose sizes drift reserves less. (On the recorded conv and transformer
        traces, 4 classes gave the lowest peak reserved of 0, 2, 4, 8, 16 and 32.)"""
        cdef int c, last = cls + FIT_CLASSES
        cdef size_t limit = class_size(cls) + class_size(cls) // 2
        cdef Block* b
        if <size_t>last >= self._free.bins.size():
            last = <int>self._free.bins.size() - 1
        for c in range(cls + 1, last + 1):
            if class_size(c) > limit:
                break
            b = self._take(&self._free, c, s)
            if b != NULL:
                return b
        return NULL

    cdef Block* _take_split(self, int cls, size_t size, StreamKey s) noexcept nogil:
        """A large request's miss: the smallest cached block of a larger class, cut to size
        (the rest stays cached) unless what is left would be under SPLIT_MIN and the block
        is at most 1.5 times the size (then it serves whole), so cached memory serves before
        the pool grows."""
        cdef size_t c, n = self._free.bins.size()
        cdef Block* b
        for c in range(cls + 1, n):
            b = self._take(&self._free, <int>c, s)
            if b != NULL:
                if b.size - size >= SPLIT_MIN or b.size > size + size // 2:
                    self._split(b, cls, size, s)
                return b
        return NULL

    cdef void _split(self, Block* b, int cls, size_t size, StreamKey s) noexcept nogil:
        """Cut a block just taken for stream s (its earlier work is ordered before s's next)
        to size; the rest becomes a cached block of the pool, free on s."""
        cdef Block* rest = <Block*>calloc(1, sizeof(Block))
        if rest == NULL:
            return                          # no host memory: the block serves whole
        rest.ptr, rest.size = b.ptr + size, b.size - size
        rest.cls = floor_class(rest.size)
        rest.stream = NO_STREAM if _same(b.stream, NO_STREAM) else s
        rest.rank = self._ranks
        self._ranks += 1
        rest.seg_prev, rest.seg_next = b, b.seg_next
        if b.seg_next != NULL:
            b.seg_next.seg_prev = rest
        b.seg_next = rest
        b.size, b.cls = size, cls
        b.state = LIVE                      # not joinable with rest
        rest.state = FREE_POOL
        self._push_pool(rest)

    cdef bint _joinable(self, Block* a, Block* b) noexcept nogil:
        """Whether free neighbour b may join free block a: b is in the pool's free lists,
        neither waits on record_stream events, and they are free on one stream (or one was
        never used)."""
        return (b.state == FREE_POOL and a.extra_events == NULL and b.extra_events == NULL
                and (_same(a.stream, b.stream) or _same(a.stream, NO_STREAM)
                     or _same(b.stream, NO_STREAM)))

    cdef void _unbin(self, Block* b) noexcept nogil:
        """Take a block out of the pool's free lists (where a FREE_POOL block is)."""
        cdef vector[StreamBin]* bins = &self._free.bins[b.cls]
        cdef vector[HeapItem]* heap
        cdef size_t i, j
        for i in range(bins.size()):
            if not _same(bins[0][i].key, b.stream):
                continue
            heap = &bins[0][i].heap
            for j in range(heap.size()):
                if heap[0][j].second == b:
                    heap[0][j] = heap.back()
                    heap.pop_back()
                    make_heap(heap.begin(), heap.end())
                    return

    cdef void _join(self, Block* a, Block* b) noexcept nogil:
        """a, free, takes in its free right neighbour b (out of the free lists): one block
        on their stream. Two blocks of one stream drop their events: the one recorded when
        the block is next wanted elsewhere covers both."""
        if _same(a.stream, NO_STREAM):
            a.stream = b.stream
            a.event, b.event = b.event, a.event
        elif not _same(b.stream, NO_STREAM):
            self._drop_events(a)
        self._drop_events(b)
        a.size += b.size
        a.seg_next = b.seg_next
        if b.seg_next != NULL:
            b.seg_next.seg_prev = a
        free(b)

    cdef void _push_pool(self, Block* b) noexcept nogil:
        """Put a free block (state FREE_POOL) into the pool's free lists, joined first with
        its free neighbours of the same upstream allocation."""
        cdef Block* n = b.seg_prev
        if n != NULL or b.seg_next != NULL:
            if n != NULL and self._joinable(b, n):
                self._unbin(n)
                self._join(n, b)
                b = n
            n = b.seg_next
            if n != NULL and self._joinable(b, n):
                self._unbin(n)
                self._join(b, n)
            b.cls = floor_class(b.size)
        _push(&self._free, b)

    cdef int _upstream_alloc(self, size_t nbytes, StreamKey s, uintptr_t* ptr) noexcept nogil:
        cdef int r
        if self._hard_limit and self.c.reserved + nbytes > self._hard_limit:
            return CUDA_ERROR_OUT_OF_MEMORY
        r = self.upstream.alloc(nbytes, s.handle, ptr)
        if r == 0:
            self.c.reserved += nbytes
            self.c.upstream_allocs += 1
            if self.c.reserved > self.c.peak_reserved:
                self.c.peak_reserved = self.c.reserved
        return r

    cdef int _carve(self, int cls, size_t size, StreamKey s, Block** out) noexcept nogil:
        """Carve a block from the current slab, starting a new slab when it is full."""
        cdef Slab* slab = self._slab
        cdef uintptr_t ptr = 0
        cdef Block* b
        cdef int r
        if slab == NULL or slab.nbytes - slab.carved < size:
            r = self._upstream_alloc(SLAB_BYTES, s, &ptr)
            if r != 0:
                return r
            slab = <Slab*>calloc(1, sizeof(Slab))
            if slab == NULL:
                self._upstream_free(ptr, SLAB_BYTES)
                return CUDA_ERROR_OUT_OF_MEMORY
            slab.ptr, slab.nbytes, slab.stream = ptr, SLAB_BYTES, s
            self.c.cached += SLAB_BYTES
            self._slab = slab
            if self.upstream.stream_ordered:
                # The memory exists in s's order only: other streams wait for this event.
                r = self._slab_event(slab)
                if r != 0:
                    return r
        elif slab.event and not _same(slab.stream, s):
            if self.upstream.event_query(slab.event) == 0:
                self._events.push_back(slab.event)
                slab.event = 0
            else:
                r = self.upstream.stream_wait(s.handle, slab.event)
                if r != 0:
                    return r
        b = <Block*>calloc(1, sizeof(Block))
        if b == NULL:
            return CUDA_ERROR_OUT_OF_MEMORY
        b.ptr, b.size, b.cls, b.stream = slab.ptr + slab.carved, size, cls, NO_STREAM
        b.rank = self._ranks
        b.slab = slab
        b.slab_next = slab.blocks
        slab.blocks = b
        slab.carved += size
        slab.nblocks += 1
        self._ranks += 1
        out[0] = b
        return 0

    cdef int _slab_event(self, Slab* slab) noexcept nogil:
        cdef uintptr_t e = self._event()
        cdef int r
        if e == 0:
            return self.upstream.synchronize()
        r = self.upstream.event_record(e, slab.stream.handle)
        if r != 0:
            self._events.push_back(e)
            return r
        slab.event = e
        return 0

    cdef void _upstream_free(self, uintptr_t ptr, size_t nbytes) noexcept nogil:
        self.upstream.free(ptr)
        self.c.reserved -= nbytes
        self.c.cached -= nbytes
        self.c.upstream_frees += 1

    cdef void _mark_stream(self, StreamKey s) noexcept nogil:
        cdef size_t i
        for i in range(self._wanted.size()):
            if _same(self._wanted[i], s):
                return
        self._wanted.push_back(s)

    cdef void _mark_blocks(self, FreeLists* fl, StreamKey s) noexcept nogil:
        """Record one event on stream s (alive: it is allocating) for its free blocks."""
        cdef size_t c, i
        cdef Block* b
        cdef uintptr_t e = 0
        for c in range(fl.bins.size()):
            for i in range(fl.bins[c].size()):
                if not _same(fl.bins[c][i].key, s):
                    continue
                for item in fl.bins[c][i].heap:
                    b = item.second
                    if b.event == 0:
                        e = self._event()
                        if e == 0 or self.upstream.event_record(e, s.handle) != 0:
                            if e:
                                self._events.push_back(e)
                            return
                        b.event = e

    cdef int _new_block(self, int cls, size_t size, StreamKey s, Block** out) noexcept nogil:
        cdef uintptr_t ptr = 0
        cdef int r = self._upstream_alloc(size, s, &ptr)
        cdef Block* b
        if r != 0:
            return r
        self.c.cached += size
        b = <Block*>calloc(1, sizeof(Block))
        if b == NULL:
            self._upstream_free(ptr, size)
            return CUDA_ERROR_OUT_OF_MEMORY
        b.ptr, b.size, b.cls, b.stream = ptr, size, cls, NO_STREAM
        b.rank = self._ranks
        self._ranks += 1
        out[0] = b
        return 0

    cdef size_t _segment_bytes(self) noexcept nogil:
        """Bytes of the segment a new mid-sized block is cut from: an eighth of what the
        pool reserves, in 2 MiB steps, at most SEGMENT_BYTES; so the unused end of the
        latest segment stays a small share of the pool."""
        cdef size_t seg = (self.c.reserved // SEGMENT_SHARE) & ~((<size_t>2 << 20) - 1)
        return seg if seg < SEGMENT_BYTES else SEGMENT_BYTES

    cdef int _grow(self, size_t nbytes, int cls, size_t size, StreamKey s, bint pack,
                   Block** out) noexcept nogil:
        """A new block: carved from a slab (small), cut from a new segment (mid-sized, when
        pack: outside regions, whose blocks are reused as they are), or of its own."""
        cdef int r
        cdef size_t i, seg
        if size <= SLAB_BLOCK_MAX:
            r = self._carve(cls, size, s, out)
            if r != CUDA_ERROR_OUT_OF_MEMORY:
                return r
        elif pack and size <= SEGMENT_FOR:
            seg = self._segment_bytes()
            if seg >= size + SPLIT_MIN and self._new_block(floor_class(seg), seg, s, out) == 0:
                if self.upstream.stream_ordered:
                    out[0].stream = s       # the rest exists in s's order only
                self._split(out[0], cls, size, s)
                return 0
        # Memory is tight (or the block is large): ask for the block alone, then climb the
        # ladder: this pool's cache, then every region's.
        r = self._new_block(cls, size, s, out)
        if r == CUDA_ERROR_OUT_OF_MEMORY and self.c.cached:
            self.c.oom_retries += 1
            self.release_cached()
            r = self._new_block(cls, size, s, out)
        if r == CUDA_ERROR_OUT_OF_MEMORY and self.c.cached:
            self.c.oom_retries += 1
            for i in range(self._regions.size()):
                self.region_drain(self._regions[i])
            self.release_cached()
            r = self._new_block(cls, size, s, out)
        if r == CUDA_ERROR_OUT_OF_MEMORY and self._hard_limit:
            r = self._exact_block(nbytes, s, out)
        return r

    cdef int _exact_block(self, size_t nbytes, StreamKey s, Block** out) noexcept nogil:
        """Under a hard limit that the size class's rounding would cross: a block of the
        room left (>= nbytes), binned in the largest class it holds. A pool capped at N bytes
        can so always allocate one N-byte block once its cache is released."""
        cdef size_t room, size
        if self.c.reserved >= self._hard_limit:
            return CUDA_ERROR_OUT_OF_MEMORY
        room = self._hard_limit - self.c.reserved
        size = room - room % SMALL_STEP
        if size < nbytes:
            size = room
        if size < nbytes or size < SMALL_STEP:
            return CUDA_ERROR_OUT_OF_MEMORY
        return self._new_block(floor_class(size), size, s, out)

    cdef void _answer_wanted(self, StreamKey s) noexcept nogil:
        cdef size_t i, j
        for i in range(self._wanted.size()):
            if _same(self._wanted[i], s):
                self._wanted.erase(self._wanted.begin() + i)
                self._mark_blocks(&self._free, s)
                for j in range(self._regions.size()):
                    self._mark_blocks(&self._regions[j].free, s)
                return

    cdef int acquire(self, size_t nbytes, StreamKey s, Block** out) noexcept nogil:
        """Take a block for nbytes > 0 used on stream s. Returns 0 or a status code."""
        cdef int r
        if gp_forked:
            return GP_FORKED
        if self._owner == _thread():
            return GP_REENTRANT
        self.lock()
        r = self.acquire_locked(nbytes, s, out)
        self.unlock()
        return r

    cdef int acquire_locked(self, size_t nbytes, StreamKey s, Block** out) noexcept nogil:
        cdef int cls = class_index(nbytes)
        cdef size_t size = class_size(cls)
        cdef RegionCache* rc
        cdef Block* b = NULL
        cdef int r = 0
        if not self._wanted.empty():
            if self._wanted.size() > WANTED_MAX:
                # Many streams hold blocks that others want and never allocate again (most
                # likely destroyed): one synchronize frees their blocks for every stream.
                self.release_cached()
            else:
                self._answer_wanted(s)
        rc = self._current_region()
        if rc != NULL:
            b = self._take(&rc.free, cls, s)
            if b != NULL:
                rc.hits += 1
                rc.cached_bytes -= b.size
                self.c.cache_hits += 1
            else:
                rc.misses += 1
        if b == NULL:
            b = self._take(&self._free, cls, s)
            if b == NULL:
                if size > SLAB_BLOCK_MAX:
                    b = self._take_split(cls, size, s)
                else:
                    b = self._take_larger(cls, s)
            if b != NULL:
                self.c.cache_hits += 1
                if b.slab != NULL:
                    b.slab.free_in_pool -= 1
            else:
                r = self._grow(nbytes, cls, size, s, rc == NULL, &b)
                if r != 0:
                    return r
                self.c.cache_misses += 1
        size = b.size                       # the class's, or more (an exact block)
        self.c.cached -= size               # new blocks were counted as cached by _grow
        b.state = LIVE
        b.stream = s
        b.region = rc
        if rc != NULL:
            b.live_prev = NULL
            b.live_next = rc.live_head
            if rc.live_head != NULL:
                rc.live_head.live_prev = b
            rc.live_head = b
            rc.live_count += 1
            rc.live_bytes += size
            if rc.live_bytes > rc.peak_in_use_bytes:
                rc.peak_in_use_bytes = rc.live_bytes
        self.c.in_use += size
        self.c.allocated_bytes += size
        self.c.num_allocs += 1
        if self.c.in_use > self.c.peak_in_use:
            self.c.peak_in_use = self.c.in_use
        if self._soft_limit and self.c.reserved > self._soft_limit:
            self.release_cached()
        out[0] = b
        return 0

    cdef object raise_status(self, int status, size_t nbytes):
        if status == CUDA_ERROR_OUT_OF_MEMORY:
            self.c.num_ooms += 1
            raise OutOfMemoryError(self._oom_message(nbytes))
        if status == GP_FORKED:
            raise GpupoolError(
                "this gpupool pool was inherited through fork(); CUDA state cannot cross "
                "fork(): use the 'spawn' start method, or create pools in the child")
        if status == GP_REENTRANT:
            raise GpupoolError("the pool was used from inside its own upstream call")
        self.upstream.raise_error(status, "allocate")

    def _oom_message(self, size_t nbytes):
        cdef size_t dev_free = 0, dev_total = 0
        dev = "device free/total unknown"
        if self.upstream.mem_info(&dev_free, &dev_total) == 0:
            dev = f"device has {format_bytes(dev_free)} free of {format_bytes(dev_total)}"
        else:
            self.upstream._pending = None
        limit = f"; hard limit {format_bytes(self._hard_limit)}" if self._hard_limit else ""
        return (
            f"gpupool: out of memory on device {self.device} allocating "
            f"{format_bytes(nbytes)} ({nbytes} B): {format_bytes(self.c.in_use)} in use, "
            f"{format_bytes(self.c.reserved)} reserved, {format_bytes(self.c.cached)} cached "
            f"by the pool and its regions; {dev}{limit}. Free buffers you no longer need, "
            f"release regions (region.release()), or register a callback with gpupool.on_oom."
        )

    # Freeing ----------------------------------------------------------------------------

    cdef void release(self, Block* b, StreamKey s) noexcept nogil:
        """Return a live block; with or without the GIL."""
        if gp_forked:
            return
        if self._mutex.try_lock():
            self._owner = _thread()
        elif self._owner == _thread():
            # The holder is this thread (a collection run inside the pool's upstream call).
            b.stream = s
            self._deferred.push_back(b)
            return
        else:
            self._wait()
            self._owner = _thread()
        self.release_locked(b, s)
        self.unlock()

    cdef void release_locked(self, Block* b, StreamKey s) noexcept nogil:
        cdef RegionCache* rc = b.region
        cdef size_t i, size = b.size
        cdef uintptr_t e
        cdef bint escaped
        b.stream = s
        b.buffer = NULL
        if b.extra_streams != NULL:
            for i in range(b.extra_streams.size()):
                if _same(b.extra_streams[0][i], s):
                    continue
                e = self._event()
                if e and self.upstream.event_record(e, b.extra_streams[0][i].handle) == 0:
                    if b.extra_events == NULL:
                        b.extra_events = new vector[uintptr_t]()
                    b.extra_events.push_back(e)
                elif e:
                    self._events.push_back(e)
            del b.extra_streams
            b.extra_streams = NULL
        if rc != NULL:
            escaped = b.escaped
            self.region_detach(b)
            b.region = rc
            if escaped or (rc.max_cached_bytes and
                           rc.cached_bytes + b.size > rc.max_cached_bytes):
                rc = NULL
        if rc != NULL:
            b.state = FREE_REGION
            rc.cached_bytes += b.size
            _push(&rc.free, b)
        else:
            b.region = NULL
            b.state = FREE_POOL
            if b.slab != NULL:
                b.slab.free_in_pool += 1
            self._push_pool(b)             # may join b into a neighbour: size kept above
        self.c.in_use -= size
        self.c.freed_bytes += size
        self.c.cached += size
        self.c.num_frees += 1

    cdef void add_stream(self, Block* b, StreamKey s) noexcept nogil:
        self.lock()
        if not _same(b.stream, s):
            if b.extra_streams == NULL:
                b.extra_streams = new vector[StreamKey]()
            b.extra_streams.push_back(s)
        self.unlock()

    # Regions ----------------------------------------------------------------------------

    cdef void region_register(self, RegionCache* rc) noexcept nogil:
        self.lock()
        rc.pool = <void*>self
        self._regions.push_back(rc)
        self.unlock()

    cdef bint region_set_process(self, RegionCache* rc, bint enter) noexcept nogil:
        """Make rc the region of every thread (enter) or stop; False if another one is."""
        cdef bint ok = True
        self.lock()
        if enter:
            ok = self._process_region == NULL
            if ok:
                self._process_region = rc
        elif self._process_region == rc:
            self._process_region = NULL
        self.unlock()
        return ok

    cdef void region_unregister(self, RegionCache* rc) noexcept nogil:
        """Forget a region: its live blocks return to the pool when freed, its cache now."""
        cdef size_t i
        self.lock()
        if self._process_region == rc:
            self._process_region = NULL
        while rc.live_head != NULL:
            self.region_detach(rc.live_head)
        self.region_drain(rc)
        for i in range(self._regions.size()):
            if self._regions[i] == rc:
                self._regions.erase(self._regions.begin() + i)
                break
        self.unlock()

    cdef void region_detach(self, Block* b) noexcept nogil:
        """Unlink a live block from its region (the block then returns to the pool)."""
        cdef RegionCache* rc = b.region
        if rc == NULL:
            return
        if b.live_prev != NULL:
            b.live_prev.live_next = b.live_next
        else:
            rc.live_head = b.live_next
        if b.live_next != NULL:
            b.live_next.live_prev = b.live_prev
        b.live_prev = b.live_next = NULL
        if b.escaped:
            rc.escaped_bytes -= b.size
        else:
            rc.live_count -= 1
            rc.live_bytes -= b.size
        b.region = NULL
        b.escaped = False

    cdef void region_escape(self, Block* b) noexcept nogil:
        """A live block outlived its region's exit: it stays listed (its bytes count as
        escaped until it dies) but returns to the pool when freed."""
        b.escaped = True
        b.region.live_count -= 1
        b.region.live_bytes -= b.size
        b.region.escaped_bytes += b.size

    cdef void region_drain(self, RegionCache* rc) noexcept nogil:
        """Move every cached block of a region into the pool's free lists."""
        cdef size_t c, i
        cdef Block* b
        for c in range(rc.free.bins.size()):
            for i in range(rc.free.bins[c].size()):
                for item in rc.free.bins[c][i].heap:
                    b = item.second
                    b.region = NULL
                    b.state = FREE_POOL
                    if b.slab != NULL:
                        b.slab.free_in_pool += 1
                    self._push_pool(b)
        rc.free.bins.clear()
        rc.cached_bytes = 0

    # Trimming ---------------------------------------------------------------------------

    cdef size_t release_cached(self) noexcept nogil:
        """Give the pool's free blocks, wholly free slabs and wholly free upstream
        allocations of pieces back; returns the bytes freed."""
        cdef vector[Block*] keep, large, pieces
        cdef vector[Slab*] slabs
        cdef size_t c, i, before = self.c.reserved
        cdef Block* b
        cdef Block* nxt
        cdef bint busy = False
        for c in range(self._free.bins.size()):
            for i in range(self._free.bins[c].size()):
                for item in self._free.bins[c][i].heap:
                    b = item.second
                    busy = busy or not _same(b.stream, NO_STREAM)
                    if b.seg_prev != NULL or b.seg_next != NULL:
                        pieces.push_back(b)
                    elif b.slab == NULL:
                        large.push_back(b)
                    elif b.slab.free_in_pool == b.slab.nblocks:
                        if b == b.slab.blocks:
                            slabs.push_back(b.slab)
                    else:
                        keep.push_back(b)
        if busy:
            # Cached blocks may still be read by work queued before their free. After this
            # every event has completed, so every kept block is free for any stream.
            self.upstream.synchronize()
            self._wanted.clear()
        self._free.bins.clear()
        self._join_pieces(&pieces, &keep, &large)
        self._rebin_unused(&self._free, &keep, NULL)
        for i in range(large.size()):
            self._drop_events(large[i])
            self._upstream_free(large[i].ptr, large[i].size)
            free(large[i])
        for i in range(slabs.size()):
            if slabs[i] == self._slab:
                self._slab = NULL
            if slabs[i].event:
                self._events.push_back(slabs[i].event)
            b = slabs[i].blocks
            while b != NULL:
                nxt = b.slab_next
                self._drop_events(b)
                free(b)
                b = nxt
            self._upstream_free(slabs[i].ptr, slabs[i].nbytes)
            free(slabs[i])
        return before - self.c.reserved

    cdef void _join_pieces(self, vector[Block*]* pieces, vector[Block*]* keep,
                           vector[Block*]* whole) noexcept nogil:
        """During a trim, after every event has completed and with the free lists emptied:
        join each run of free neighbouring pieces into its first; a run that is a whole
        upstream allocation goes to whole, any other to keep."""
        cdef vector[Block*] firsts
        cdef size_t i
        cdef Block* b
        for i in range(pieces.size()):
            b = pieces[0][i]
            self._drop_events(b)
            b.stream = NO_STREAM
            if b.seg_prev == NULL or b.seg_prev.state != FREE_POOL:
                firsts.push_back(b)         # the others are joined into these (and freed)
        for i in range(firsts.size()):
            b = firsts[i]
            while b.seg_next != NULL and b.seg_next.state == FREE_POOL:
                self._join(b, b.seg_next)
            if b.seg_prev == NULL and b.seg_next == NULL:
                whole.push_back(b)
            else:
                b.cls = floor_class(b.size)
                keep.push_back(b)

    cdef void _rebin_unused(self, FreeLists* fl, vector[Block*]* blocks,
                            size_t* moved) noexcept nogil:
        """After a device synchronize: put blocks into fl as free for any stream (their
        events recycled); counts in moved those that were bound to a stream."""
        cdef size_t i
        cdef Block* b
        for i in range(blocks.size()):
            b = blocks[0][i]
            if moved != NULL and not _same(b.stream, NO_STREAM):
                moved[0] += 1
            self._drop_events(b)
            b.stream = NO_STREAM
            _push(fl, b)

    cdef void _merge_free_lists(self, FreeLists* fl, size_t* moved) noexcept nogil:
        cdef vector[Block*] blocks
        cdef size_t c, i
        for c in range(fl.bins.size()):
            for i in range(fl.bins[c].size()):
                for item in fl.bins[c][i].heap:
                    blocks.push_back(item.second)
        fl.bins.clear()
        self._rebin_unused(fl, &blocks, moved)

    cdef int merge_streams_locked(self, size_t* moved) noexcept nogil:
        cdef int r = self.upstream.synchronize()
        cdef size_t i
        if r != 0:
            return r
        self._wanted.clear()
        self._merge_free_lists(&self._free, moved)
        for i in range(self._regions.size()):
            self._merge_free_lists(&self._regions[i].free, moved)
        return 0

    # Python API -------------------------------------------------------------------------

    def allocate(self, nbytes, stream=None):
        """Allocate ``nbytes`` of device memory for use on ``stream``.

        Parameters
        ----------
        nbytes : int
            Size in bytes, >= 0. Zero gives an empty buffer with pointer 0.
        stream : int, stream object or None
            The stream the buffer will be used on: an int ``CUstream`` handle, None for the
            legacy default stream, or an object with ``__cuda_stream__``, ``.cuda_stream``,
            ``.ptr`` or ``.handle``. The block is ready for work submitted to ``stream``
            (stream-ordered: earlier users on other streams are complete).

        Returns
        -------
        DeviceBuffer
            Owns the block; the block returns to the pool (or the current region) when the
            buffer's last reference goes or it is closed. The pointer is 256-byte aligned.

        Raises
        ------
        TypeError, ValueError
            ``nbytes`` not an integer, negative or absurd; bad ``stream``.
        OutOfMemoryError
            The upstream is out of memory after the out-of-memory ladder: the pool releases
            its cached blocks, then every region's, then runs the ``on_oom`` callbacks,
            retrying after each step.
        CudaError, GpupoolError
            A driver failure (among them ``cuStreamGetId`` refusing a handle that names no
            live stream, or the upstream's own error for it), or a pool inherited through
            ``fork()``.
        """
        cdef uintptr_t handle = 0 if stream is None else stream_handle(stream)
        return self.allocate_key(nbytes, self.checked_key(handle))

    cdef object allocate_key(self, object nbytes, StreamKey key):
        """``allocate`` once the stream is resolved to its key: checks ``nbytes``, takes the
        block (the calling thread's current region first), runs the ``on_oom`` callbacks
        and retries once, raises as ``allocate`` does, and wraps the block in a
        DeviceBuffer. The C-level entry of the adapters that build their own wrappers."""
        cdef size_t n
        cdef Block* b = NULL
        cdef int r
        if type(nbytes) is int and 0 < <object>nbytes <= MAX_NBYTES:
            n = nbytes
        else:
            n = _check_nbytes(nbytes)
            if n == 0:
                return _make_buffer(self, NULL, 0, key)
        r = self.acquire(n, key, &b)
        if r == CUDA_ERROR_OUT_OF_MEMORY and run_oom_callbacks(self, n):
            r = self.acquire(n, key, &b)
        if r != 0:
            self.raise_status(r, n)
        buf = _make_buffer(self, b, n, key)
        if b.region != NULL and b.region.on_alloc != NULL:
            (<object>b.region.on_alloc)(b.ptr)
        return buf

    def cached_blocks(self):
        """The blocks in the pool's free lists (not the regions'), for inspection and tests.

        Returns
        -------
        list of (int, int, bool)
            ``(device pointer, bytes, piece)`` by address; ``piece``: the block shares its
            upstream allocation with neighbours (it was cut from a larger block).
        """
        cdef size_t c, i
        cdef Block* b
        found = []
        self.lock()
        for c in range(self._free.bins.size()):
            for i in range(self._free.bins[c].size()):
                for item in self._free.bins[c][i].heap:
                    b = item.second
                    found.append((b.ptr, b.size, b.seg_prev != NULL or b.seg_next != NULL))
        self.unlock()
        return sorted(found)

    def stats(self):
        """Current counters as a :class:`gpupool.PoolStats` (bytes and counts)."""
        self.lock()
        c = self.c
        self.unlock()
        return PoolStats(
            in_use_bytes=c.in_use, peak_in_use_bytes=c.peak_in_use,
            reserved_bytes=c.reserved, peak_reserved_bytes=c.peak_reserved,
            cached_bytes=c.cached, num_allocs=c.num_allocs, num_frees=c.num_frees,
            cache_hits=c.cache_hits, cache_misses=c.cache_misses,
            upstream_allocs=c.upstream_allocs, upstream_frees=c.upstream_frees,
            oom_retries=c.oom_retries,
        )

    def memory_stats(self):
        """Counters under the keys of ``torch.cuda.memory_stats()``, for existing dashboards.

        Returns
        -------
        dict
            ``allocated_bytes.all.{current,peak,allocated,freed}`` and
            ``active_bytes.all.{current,peak}`` (bytes of live blocks, by size class),
            ``reserved_bytes.all.{current,peak}``, ``allocation.all.{current,allocated,freed}``
            (counts), ``segment.all.{current,allocated,freed}`` (upstream allocations),
            ``num_alloc_retries``, ``num_ooms``, ``num_device_alloc``, ``num_device_free``.
            gpupool keeps no per-pool ("small_pool"/"large_pool") split.
        """
        self.lock()
        c = self.c
        self.unlock()
        return {
            "allocated_bytes.all.current": c.in_use,
            "allocated_bytes.all.peak": c.peak_in_use,
            "allocated_bytes.all.allocated": c.allocated_bytes,
            "allocated_bytes.all.freed": c.freed_bytes,
            "active_bytes.all.current": c.in_use,
            "active_bytes.all.peak": c.peak_in_use,
            "reserved_bytes.all.current": c.reserved,
            "reserved_bytes.all.peak": c.peak_reserved,
            "allocation.all.current": c.num_allocs - c.num_frees,
            "allocation.all.allocated": c.num_allocs,
            "allocation.all.freed": c.num_frees,
            "segment.all.current": c.upstream_allocs - c.upstream_frees,
            "segment.all.allocated": c.upstream_allocs,
            "segment.all.freed": c.upstream_frees,
            "num_alloc_retries": c.oom_retries,
            "num_ooms": c.num_ooms,
            "num_device_alloc": c.upstream_allocs,
            "num_device_free": c.upstream_frees,
        }

    def reset_peak_stats(self):
        """Set the peaks of bytes in use and reserved to their current values."""
        self.lock()
        self.c.peak_in_use = self.c.in_use
        self.c.peak_reserved = self.c.reserved
        self.unlock()

    def merge_streams(self):
        """Make every cached block, of the pool and of its regions, free for any stream.

        A block freed on a stream goes to another stream only once an event recorded on its
        stream after the free reports complete, and that event is recorded when its stream
        next allocates: blocks of a stream that went idle stay with it. This synchronizes the
        device once (``cuCtxSynchronize``: the host waits for all queued work), then merges
        every stream's free lists, keeping the memory (``trim`` gives it back instead). Call
        it at a point where the host waits anyway, such as the end of an epoch.

        Returns
        -------
        int
            Blocks that were bound to a stream and are now free for all.

        Raises
        ------
        CudaError
            The synchronize failed.
        GpupoolError
            The pool was inherited through ``fork()``.
        """
        cdef size_t moved = 0
        cdef int r
        if gp_forked:
            self.raise_status(GP_FORKED, 0)
        self.lock()
        r = self.merge_streams_locked(&moved)
        self.unlock()
        self.upstream.raise_error(r, "synchronize")
        return moved

    def trim(self):
        """Give every cached free block, and every wholly free slab, back to the upstream.

        Blocks cached by regions stay with their regions (``Region.release()`` returns them).
        Synchronizes the device first when a cached block may still be in use by queued work.

        Returns
        -------
        int
            Bytes released.
        """
        cdef int r
        if gp_forked:
            self.raise_status(GP_FORKED, 0)
        self.lock()
        released = self.release_cached()
        r = self.upstream.trim()
        self.unlock()
        self.upstream.raise_error(r, "trim")
        return released

    def mem_info(self):
        """``(free, total)`` bytes of the device (``cuMemGetInfo``)."""
        cdef size_t f = 0, t = 0
        self.upstream.raise_error(self.upstream.mem_info(&f, &t), "cuMemGetInfo")
        return f, t

    @property
    def hard_limit(self):
        """Bytes the pool never exceeds in reserved memory; None when unlimited."""
        return self._hard_limit or None

    @property
    def soft_limit(self):
        """Reserved bytes above which cached blocks are released; None when unlimited."""
        return self._soft_limit or None

    def __repr__(self):
        return (f"<gpupool.Pool device={self.device} upstream={self.upstream!r} "
                f"in_use={self.c.in_use} reserved={self.c.reserved}>")


cdef bint run_oom_callbacks(Pool pool, size_t nbytes) except -1:
    """Run the on_oom callbacks (with the GIL); whether there were any to run."""
    if not _oom_callbacks:
        return False
    pool.c.oom_retries += 1
    for callback in list(_oom_callbacks):
        callback(nbytes)
    return True


def on_oom(callback):
    """Register ``callback(nbytes)`` to run when an allocation fails for lack of memory.

    Callbacks run (in registration order, outside the pool's lock) after the pool has
    released its own and its regions' caches; the allocation is then retried once.
    ``gpupool.on_oom(lambda n: gc.collect())`` is the usual one. Returns ``callback`` so it
    can be used as a decorator.
    """
    if not callable(callback):
        raise TypeError("on_oom needs a callable taking the requested nbytes")
    _oom_callbacks.append(callback)
    return callback


def remove_oom_callback(callback):
    """Unregister a callback added with :func:`on_oom`."""
    _oom_callbacks.remove(callback)
