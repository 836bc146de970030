# The pool's side of memory snapshots (gpupool.snapshot builds PyTorch's format from it): its
# segments and blocks as they are, read under the lock without changing anything (parked
# blocks stay parked, nothing is joined), with the memory history's sequence number at that
# moment, so that the snapshot pairs this state with exactly the entries made before it.
# Included into core/pool.pyx, which owns the records.
from gpupool.core.magpool cimport mp_counters_view
from gpupool.history.ring cimport Frame, hist_live, hist_segment_frames, hist_frames, hist_seq

cdef size_t NO_ROW = <size_t>-1

cdef enum:
    ROW_ALLOCATED = 0           # "active_allocated": live
    ROW_PENDING = 1             # "active_pending_free": free, waiting on record_stream events
    ROW_INACTIVE = 2            # "inactive": free

_ROW_STATES = ("active_allocated", "active_pending_free", "inactive")

cdef struct BlockRow:
    uintptr_t ptr
    size_t size
    size_t requested            # bytes requested (live blocks), else size
    int state                   # ROW_*
    uintptr_t region            # the RegionCache it belongs to; 0: the pool
    size_t frames               # its allocation frames (an index of the walk's frames)

cdef struct SegmentRow:
    uintptr_t address
    uintptr_t stream
    bint expandable
    size_t first                # its blocks: rows[first:first + count]
    size_t count
    size_t frames


def _snapshot_of(Pool pool, dict cache):
    """The pool's state for ``gpupool.memory_snapshot``: ``(seq, segments, regions,
    counters)``. ``seq``: the memory history's last entry before this state; ``segments``: by
    address, ``(address, stream, expandable, frames, blocks)``, one per plain segment and one
    per mapped run of an expandable segment (unmapped holes are not memory), ``blocks`` the
    tiling ``(address, size, requested, state, region, frames)`` with ``region`` the address
    of the RegionCache that a block belongs to (a live block allocated in the region and
    returning to it, or a block cached by it) or 0; ``regions``: ``(cache address, cached
    bytes, live bytes, private)`` of the pool's regions and of the private pools (unregistered:
    region/privatepool.pxd) its blocks belong to; ``counters``: the counters record. Frames
    come as PyTorch's frame dicts (``cache``: shared, see hist_frames). Raises GpupoolError
    in a fork() child (the pool's lock may have been held at the fork) and inside the pool's
    own upstream call."""
    cdef vector[BlockRow] rows
    cdef vector[SegmentRow] segments
    cdef vector[vector[Frame]] frames
    cdef vector[Frame] found
    cdef BlockRow row
    cdef SegmentRow* s
    cdef size_t open_row            # the segment row being filled; NO_ROW: none
    cdef Segment* seg
    cdef Block* b
    cdef RegionCache* rc
    cdef size_t i, j
    regions = []
    frames.resize(1)                    # frames[0]: none
    pool.lock_here()                    # (GpupoolError in a fork() child, or reentered)
    seq = hist_seq()
    seg = pool._st.segments.head
    while seg != NULL:
        open_row = NO_ROW
        b = seg.first
        while b != NULL:
            if b.state == UNMAPPED or seg.asleep:       # no memory (a sleeping tag's too)
                open_row = NO_ROW
                b = b.seg_next
                continue
            if open_row == NO_ROW:
                open_row = segments.size()
                segments.push_back(SegmentRow(b.ptr, seg.stream.handle, seg.va_bytes != 0,
                                              rows.size(), 0, 0))
                if not seg.va_bytes and hist_segment_frames(seg.base, &found):
                    segments[open_row].frames = frames.size()
                    frames.push_back(found)
            row = BlockRow(b.ptr, b.size, b.size, ROW_INACTIVE, <uintptr_t>b.region.cache, 0)
            if b.state == LIVE:
                row.state = ROW_ALLOCATED
                if b.region.escaped:
                    row.region = 0      # it returns to the pool
                if hist_live(b.ptr, &row.requested, &found):
                    row.frames = frames.size()
                    frames.push_back(found)
                elif b.holder != NULL:
                    row.requested = (<DeviceBuffer>b.holder)._nbytes
            elif b.extra_events != NULL:
                row.state = ROW_PENDING
            rows.push_back(row)
            segments[open_row].count += 1
            b = b.seg_next
        seg = seg.next
    registered = set()
    for i in range(pool._st.regions.size()):
        rc = pool._st.regions[i]
        registered.add(<uintptr_t>rc)
        regions.append((<uintptr_t>rc, rc.cached_bytes, rc.live_bytes, False))
    for i in range(rows.size()):
        if rows[i].region and rows[i].region not in registered:
            rc = <RegionCache*>rows[i].region       # a private pool's (held), live while its
            registered.add(rows[i].region)          # blocks are: read under the lock
            regions.append((rows[i].region, rc.cached_bytes, rc.live_bytes, True))
    counters = mp_counters_view(&pool._st)  # a magazine's blocks are free, as their rows say
    pool.unlock()
    out = []
    for i in range(segments.size()):
        s = &segments[i]
        out.append((s.address, s.stream, s.expandable, hist_frames(&frames[s.frames], cache),
                    [(rows[j].ptr, rows[j].size, rows[j].requested, _ROW_STATES[rows[j].state],
                      rows[j].region, hist_frames(&frames[rows[j].frames], cache))
                     for j in range(s.first, s.first + s.count)]))
    out.sort(key=lambda segment: segment[0])
    return seq, out, regions, counters
