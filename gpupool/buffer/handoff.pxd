# Hand-offs of memory from one stream to another, for DeviceBuffer (buffer/device_buffer.pyx): a consumer
# stream ordered after the work queued on the producer's stream (an event and a GPU-side wait;
# the host waits only where no event can be made), and the key a consumer's use is recorded
# under (record_stream), so that the block is reused only after that use.
#
# The per-thread default stream (handle 2) names another stream in every thread. The calling
# thread cannot name another thread's, so work queued there is reached through the legacy
# default stream: CUDA synchronizes it with every blocking stream, the per-thread ones
# included (an event recorded on it follows their earlier work).
from libc.stdint cimport uintptr_t
from gpupool.records.streams cimport (
    StreamKey, STREAM_PER_THREAD, BY_HANDLE, current_thread, stream_key,
)
from gpupool.upstream.base cimport Upstream


cdef inline bint one_stream(StreamKey a, StreamKey b) noexcept nogil:
    """Whether a and b name one stream, for ordering: one handle and, for the per-thread
    default stream, one thread (a created stream's key may or may not carry its driver ID)."""
    return a.handle == b.handle and (a.handle != STREAM_PER_THREAD or a.tag == b.tag)


cdef inline uintptr_t recordable(StreamKey s) noexcept nogil:
    """A handle on which the calling thread records an event that follows the work queued so
    far on s: s's own, or the legacy default stream's for another thread's per-thread
    stream."""
    if s.handle == STREAM_PER_THREAD and s.tag != current_thread():
        return 0
    return s.handle


cdef inline StreamKey use_key(StreamKey s) noexcept nogil:
    """The key a use on s is recorded under (its event is recorded when the block is freed,
    on whichever thread frees it): s, or the legacy default stream for a per-thread one."""
    if s.handle == STREAM_PER_THREAD:
        return stream_key(0, BY_HANDLE)
    return s


cdef inline int order_after(Upstream up, StreamKey producer, uintptr_t consumer) except -1:
    """Make work submitted to stream handle consumer from now on run after the work queued so
    far on producer: an event recorded there and cuStreamWaitEvent, so the host does not
    wait. Where no event can be made, the device is synchronized (cuCtxSynchronize) instead.
    Raises the upstream's error for a record or wait it refuses."""
    cdef uintptr_t event = 0
    if up.event_create(&event) != 0:
        up.clear_error()
        up.raise_error(up.synchronize(), "synchronize (no event could be made to order streams)")
        return 0
    try:
        up.raise_error(up.event_record(event, recordable(producer)), "cuEventRecord")
        up.raise_error(up.stream_wait(consumer, event), "cuStreamWaitEvent")
    finally:
        up.event_destroy(event)
    return 0
