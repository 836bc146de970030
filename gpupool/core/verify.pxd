# The pool's consistency check and diagnostics (for tests and tools): functions of the pool's
# state, run under the pool's lock (Pool._verify, Pool._magazines_info, Pool._sweep_counts).
from libc.stdint cimport uintptr_t
from gpupool.records.block cimport Block, Segment, LIVE, FREE, PARKED, UNMAPPED, HELD, TAGGED
from gpupool.core.magazine cimport Magazine
from gpupool.core.magpool cimport mp_reap, mp_counters_view
from gpupool.core.regioncache cimport RegionCache
from gpupool.core.state cimport PoolState, SWEEP_OTHERS, SWEEP_WANT, SWEEP_HANDED, SWEEP_SETTLE


cdef inline list ps_verify(PoolState* st):
    """Under the pool's lock: check the pool's bookkeeping: segments tiled by their blocks,
    the free lists and the parked blocks, region tags and their byte counts, and the
    counters. Returns the problems found (an empty list when all is consistent). Exited
    threads' magazines are reaped first."""
    cdef Segment* seg = st.segments.head
    cdef Block* b
    cdef Block* prev
    cdef uintptr_t pos
    cdef size_t live = 0, idle = 0, mapped = 0, nfree = 0, nparked = 0, nheld = 0, holes
    cdef size_t magazine_blocks = 0, asleep = 0, offloaded = 0
    cdef size_t i
    cdef RegionCache* rc
    problems, tagged, counted = [], {}, {}
    mp_reap(st)
    while seg != NULL:
        pos, b, holes = seg.base, seg.first, 0
        prev = NULL
        while b != NULL:
            if b.ptr != pos or b.seg_prev != prev or b.segment != seg:
                problems.append(f"segment {seg.base:#x}: block {b.ptr:#x} out of place")
                break
            if b.tag != seg.tag or (seg.tag and b.state != LIVE and b.state != TAGGED):
                problems.append(f"segment {seg.base:#x} (tag {seg.tag}): block {b.ptr:#x} "
                                f"of tag {b.tag}, state {b.state}")
            if b.state != LIVE and b.extra_streams != NULL:
                problems.append(f"segment {seg.base:#x}: free block {b.ptr:#x} carries "
                                f"record_stream streams")
            if b.state == LIVE and seg.asleep:
                asleep += b.size
                offloaded += b.size if seg.offload.ptr else 0
            elif b.state == LIVE:
                live += b.size
            elif seg.asleep:
                pass                    # a sleeping tag's free block: no memory
            elif b.state == FREE or b.state == PARKED or b.state == HELD or b.state == TAGGED:
                idle += b.size
                nfree += b.state == FREE
                nparked += b.state == PARKED
                nheld += b.state == HELD
                if b.region.cache != NULL:
                    key = <uintptr_t>b.region.cache
                    tagged[key] = tagged.get(key, 0) + b.size
            elif b.state == UNMAPPED:
                holes += b.size
            pos += b.size
            prev = b
            b = b.seg_next
        if seg.last != prev or pos != seg.base + seg.nbytes:
            problems.append(f"segment {seg.base:#x}: its blocks end at {pos:#x}, "
                            f"it at {seg.base + seg.nbytes:#x}")
        mapped += 0 if seg.asleep else seg.nbytes - holes
        if seg.offload.ptr and not seg.asleep:
            problems.append(f"segment {seg.base:#x}: awake, holding a host copy")
        seg = seg.next
    for i in range(st.segments.spare.size()):
        if st.segments.spare[i].extra_streams != NULL:
            problems.append("a spare block record carries record_stream streams")
    c = mp_counters_view(st)
    for i in range(st.magazines.size()):
        magazine_blocks += st.magazines[i].nblocks
    if nheld != magazine_blocks:
        problems.append(f"{nheld} held blocks, magazines hold {magazine_blocks}")
    if c.peak_in_use < c.in_use or st.bound > c.peak_in_use or st.bound < c.in_use:
        problems.append(f"bytes in use {c.in_use}, bound {st.bound}, peak "
                        f"{c.peak_in_use}: not in use <= bound <= peak")
    if (c.reserved, c.cached, c.in_use) != (mapped, idle, live):
        problems.append(f"counters reserved/cached/in use {c.reserved}/{c.cached}/"
                        f"{c.in_use}, blocks {mapped}/{idle}/{live}")
    if c.asleep != asleep or c.offloaded != offloaded:
        problems.append(f"counters asleep/offloaded {c.asleep}/{c.offloaded}, sleeping "
                        f"blocks {asleep}, with a host copy {offloaded}")
    if nfree != st.free.nblocks or nparked != <size_t>st.nparked:
        problems.append(f"{nfree} free and {nparked} parked blocks, lists hold "
                        f"{st.free.nblocks} and {st.nparked}")
    for i in range(st.regions.size()):
        rc = st.regions[i]
        b = rc.cached_head
        n = 0
        while b != NULL:
            n += b.size
            b = b.region.next
        counted[<uintptr_t>rc] = n
        if n != rc.cached_bytes or n != tagged.get(<uintptr_t>rc, 0):
            problems.append(f"region {<uintptr_t>rc:#x}: cached_bytes {rc.cached_bytes},"
                            f" its list {n}, tagged blocks {tagged.get(<uintptr_t>rc, 0)}")
    # A private pool's cache (held) is not registered (region/privatepool.pxd): its blocks'
    # tag is known to be its own.
    if [k for k in set(tagged) - set(counted) if not (<RegionCache*><uintptr_t>k).held]:
        problems.append("free blocks tagged with a region the pool does not know")
    return problems


cdef inline list ps_verify_chunks(PoolState* st, object chunks, size_t page):
    """Under the pool's lock: check the upstream's chunks (chunks(va, nbytes): the upstream's
    ``_chunks``) against the expandable segments: each run of mapped pages is tiled by whole
    chunks, none across its ends (an unmap of the run takes them whole); an untagged
    segment's chunks are single pages (a trim unmaps any page); a sleeping segment has none.
    Returns the problems found."""
    cdef Segment* seg = st.segments.head
    cdef Block* b
    cdef uintptr_t start
    problems = []
    while seg != NULL:
        if seg.va_bytes:
            runs, start, b = [], seg.base, seg.first
            while b != NULL:
                if b.state == UNMAPPED:
                    if b.ptr > start:
                        runs.append((start, b.ptr))
                    start = b.ptr + b.size
                b = b.seg_next
            if seg.base + seg.nbytes > start:
                runs.append((start, seg.base + seg.nbytes))
            if seg.asleep:
                if chunks(seg.base, seg.nbytes):
                    problems.append(f"segment {seg.base:#x} sleeps with chunks mapped")
                runs = []
            for lo, hi in runs:
                pos = lo
                for at, n in chunks(lo, hi - lo):
                    if at != pos or (seg.tag == 0 and n != page):
                        problems.append(f"segment {seg.base:#x} (tag {seg.tag}): chunk of {n} B "
                                        f"at {at:#x} in the run [{lo:#x}, {hi:#x}) at {pos:#x}")
                    pos = at + n
                if pos != hi:
                    problems.append(f"segment {seg.base:#x}: the run [{lo:#x}, {hi:#x}) is "
                                    f"mapped to {pos:#x}")
        seg = seg.next
    return problems


cdef inline list ps_magazines_info(PoolState* st):
    """Every thread's magazine for this pool, for tests and diagnostics: a list of dicts
    with ``blocks`` (held free blocks), ``held`` and ``credit`` (bytes), ``handed`` (C
    API blocks taken from it, live), ``orphan`` (its thread exited), ``allocs`` and
    ``frees`` (served by it without the pool's lock, not yet folded into the pool's
    counters), ``misses`` (its thread's requests it could not serve, with no free block of
    the exact size either), and why requests took the shared path while it held blocks:
    ``wanted`` (another stream waits for blocks of its stream, or more than WANTED_FAST
    streams are waited for and its bit is in the mask), ``no_block`` (none of the size on
    the stream), ``no_credit`` (one, but too little credit: the pool's peak bound) and
    ``no_hand`` (one, but MAG_HANDED C API blocks are out); why they took it otherwise:
    ``empty`` (it held no block); ``waits`` and ``free_waits`` (its lock was another
    thread's at that moment, and a request or a free waited for it); and ``streams``, each
    held block's (size, stream handle, stream tag)."""
    cdef Magazine* m
    cdef size_t k
    cdef int i
    out = []
    for k in range(st.magazines.size()):
        m = st.magazines[k]
        m.mutex.lock()
        out.append({"blocks": m.nblocks, "held": m.held, "credit": m.credit,
                    "handed": m.nhanded, "orphan": bool(m.orphan), "allocs": m.allocs,
                    "frees": m.frees, "misses": m.misses, "wanted": m.wanted,
                    "no_block": m.no_block, "no_credit": m.no_credit,
                    "no_hand": m.no_hand, "empty": m.empty, "waits": m.waits,
                    "free_waits": m.free_waits,
                    "streams": [(m.blocks[i].size, m.blocks[i].stream.handle,
                                 m.blocks[i].stream.tag) for i in range(m.nblocks)]})
        m.mutex.unlock()
    return out


cdef inline dict ps_sweep_counts(PoolState* st):
    """How often the pool's lock holder swept every magazine, for diagnostics:
    a dict of counts since the pool was made, ``others`` (a request found no free block of
    its size and looked at idle threads' magazines), ``want`` (before the pool grew),
    ``handed`` (a C API free not in the pool's table: another thread's magazine, or its
    own when the wait for its lock ran out) and ``settle`` (the peak bound passed: credit taken
    back)."""
    out = {"others": st.sweeps[SWEEP_OTHERS], "want": st.sweeps[SWEEP_WANT],
           "handed": st.sweeps[SWEEP_HANDED], "settle": st.sweeps[SWEEP_SETTLE]}
    return out
