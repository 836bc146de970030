# Stream identity: how the pool tells streams apart (StreamKey), and the one helper that turns
# a Python stream argument into a CUstream handle (stream_handle).
#
# The per-thread default stream has one handle value (CU_STREAM_PER_THREAD = 2) that names
# another stream in every thread, so its key's tag is the thread; the legacy default stream is
# handle 0 (CU_STREAM_LEGACY = 1 is folded into it), tag 0. Any other stream's tag is the
# driver's stream ID (cuStreamGetId), unique for the process's lifetime: a handle value reused
# by a new stream after cuStreamDestroy gives another key.
from libc.stdint cimport uintptr_t
from gpupool.upstream.base cimport Upstream

cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    pthread_t pthread_self()

cdef struct StreamKey:
    uintptr_t handle
    uintptr_t tag

cdef enum:
    STREAM_LEGACY = 1               # CU_STREAM_LEGACY, folded into handle 0
    STREAM_PER_THREAD = 2           # CU_STREAM_PER_THREAD

# The largest handle value, which no stream has: the handle of NO_STREAM's key. The tag of a
# created stream's key when the driver refused the handle (no stream ID is this value).
cdef extern from *:
    """
    #define GP_HANDLE_MAX ((uintptr_t)0xFFFFFFFFFFFFFFFFull)
    #define GP_OWN_HANDLE_TAG ((uintptr_t)0xFFFFFFFFFFFFFFFEull)
    """
    uintptr_t HANDLE_MAX "GP_HANDLE_MAX"
    uintptr_t NO_STREAM "GP_HANDLE_MAX"
    uintptr_t BAD_STREAM_TAG "GP_HANDLE_MAX"

# How stream_key tags a created stream (handle > 2): through an Upstream, with the driver's
# stream ID; given a StreamTag, with that tag and no driver call: BY_HANDLE (0, keyed by its
# handle alone: comparisons of handles, the key of NO_STREAM) or OWN_HANDLE_TAG (a free's key,
# resolved against the freed block by resolve_free).
ctypedef uintptr_t StreamTag
ctypedef fused KeyLookup:
    Upstream
    StreamTag

cdef extern from *:
    StreamTag BY_HANDLE "((uintptr_t)0)"
    StreamTag OWN_HANDLE_TAG "GP_OWN_HANDLE_TAG"


cdef inline uintptr_t current_thread() noexcept nogil:
    return <uintptr_t>pthread_self()


cdef inline StreamKey stream_key(uintptr_t handle, KeyLookup lookup) noexcept nogil:
    """The key of the stream with this handle as the calling thread names it, the one way to
    make a key: the legacy stream (0, or CU_STREAM_LEGACY) is (0, 0) and the per-thread stream
    is tagged with the calling thread, with no driver call; a created stream is tagged as
    lookup says (an Upstream: the driver's stream ID, BAD_STREAM_TAG for a handle the driver
    refuses, not a stream or destroyed; a StreamTag: that tag). The block never used on any
    stream, which any stream may take at once, is keyed stream_key(NO_STREAM, BY_HANDLE).
    lookup's type is chosen at compile time: no branch on it."""
    cdef unsigned long long sid = 0
    if handle <= STREAM_LEGACY:
        return StreamKey(0, 0)
    if handle == STREAM_PER_THREAD:
        return StreamKey(handle, current_thread())
    if KeyLookup is StreamTag:
        return StreamKey(handle, lookup)
    else:
        if lookup.stream_id(handle, &sid) != 0:
            return StreamKey(handle, BAD_STREAM_TAG)
        return StreamKey(handle, <uintptr_t>sid)


cdef inline StreamKey unordered() noexcept nogil:
    """The key of a free block whose use on some stream could be ordered neither by an event
    nor by a device synchronize (the driver failed both): no request's stream has it, so no
    request takes the block (it never reads as complete) until a synchronize makes it free
    for any stream (a trim, merge_streams)."""
    return StreamKey(HANDLE_MAX, BAD_STREAM_TAG)


cdef inline bint same_stream(StreamKey a, StreamKey b) noexcept nogil:
    return a.handle == b.handle and a.tag == b.tag


cdef inline bint is_no_stream(StreamKey a) noexcept nogil:
    """Whether a is NO_STREAM's key: a block never used on any stream."""
    return a.handle == NO_STREAM and a.tag == BY_HANDLE


cdef inline int key_status(Upstream upstream, uintptr_t handle, StreamKey* out) noexcept nogil:
    """The key of the stream with this handle, as the calling thread names it, into out, and
    the status of the one cuStreamGetId asked for a created stream: not 0 for a handle the
    driver refuses (not a stream, or destroyed; out's tag is then BAD_STREAM_TAG) or a failed
    query, whose exception (a Python upstream's) is the one pending for raise_error. No driver
    call for the default streams (the hot path). stream_key(handle, upstream) is the same key
    where the caller needs no status."""
    cdef unsigned long long sid = 0
    cdef int r
    if handle <= STREAM_PER_THREAD:
        out[0] = stream_key(handle, BY_HANDLE)
        return 0
    r = upstream.stream_id(handle, &sid)
    out[0] = StreamKey(handle, <uintptr_t>sid if r == 0 else BAD_STREAM_TAG)
    return r


cdef inline StreamKey resolve_free(Upstream upstream, StreamKey s, StreamKey own) noexcept nogil:
    """The stream a block whose key is own was last used on, freed as s names it:
    BAD_STREAM_TAG, own; a created stream's handle (OWN_HANDLE_TAG), own when own has that
    handle (no driver call: a free on the block's allocation stream, the common case), else
    the driver's key (a handle it refuses: keyed by the handle alone). A handle that a
    destroyed stream left to a new one resolves to the old key: blocks under it wait for a
    trim or merge_streams(), never a wrong hand-out."""
    if s.tag == BAD_STREAM_TAG:
        return own
    if s.tag != OWN_HANDLE_TAG:
        return s
    if own.handle == s.handle:
        return own
    s = stream_key(s.handle, upstream)
    if s.tag == BAD_STREAM_TAG:
        s.tag = BY_HANDLE                           # a free never fails
        upstream.clear_error()
    return s


cdef inline uintptr_t stream_handle(object stream) except? 0xFFFFFFFFFFFFFFFF:
    """Raw CUstream handle of a stream given as None (0, the legacy default stream), an int
    or a stream object: ``__cuda_stream__`` (returns ``(version, handle)``, the CUDA stream
    protocol), PyTorch's ``.cuda_stream``, CuPy's ``.ptr``, Numba's or cuda.core's
    ``.handle``.

    Raises TypeError for anything else, ValueError for a negative or too large handle."""
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
