# Free lists: every free block of a pool, binned by size class and stream, for best fit.
#
# A block of `size` bytes lies in the bin of its class (floor_class(size): the largest class it
# holds) and of the stream it was last used on. Within a bin, blocks are sorted by (size,
# address), so the best fit for n bytes in a bin is the first block of size >= n, and among
# blocks of one size the lowest address is handed out first: the same request sequence on the
# same free memory gets the same addresses. A bitmap of the classes that hold any block lets
# a search skip empty classes. Operations on the structure only (put, take out, find, each):
# which block a request may take is the stream-order layer's choice (core/streamorder.pxd).
from libc.stdint cimport uint64_t
from libcpp.vector cimport vector
from gpupool.records.block cimport Block
from gpupool.records.sizes cimport floor_class
from gpupool.records.streams cimport StreamKey, same_stream

cdef extern from *:
    int __builtin_ctzll(unsigned long long) nogil

cdef enum:
    MASK_WORDS = 8                      # classes up to 512 (2**50 bytes needs 312)

cdef cppclass StreamBin:
    StreamKey key
    vector[Block*] blocks               # sorted by (size, ptr)

cdef cppclass FreeLists:
    vector[vector[StreamBin]] bins      # by size class, then one bin per stream
    vector[size_t] counts               # blocks per class
    uint64_t mask[MASK_WORDS]           # bit c: class c holds a block
    size_t nblocks


cdef inline bint fl_before(Block* a, Block* b) noexcept nogil:
    return a.size < b.size or (a.size == b.size and a.ptr < b.ptr)


cdef inline size_t fl_lower(vector[Block*]* blocks, size_t size) noexcept nogil:
    """Index of the first block of at least size bytes in a sorted bin."""
    cdef size_t lo = 0, hi = blocks.size(), mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if blocks[0][mid].size < size:
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef inline size_t fl_position(vector[Block*]* blocks, Block* b) noexcept nogil:
    """Index where b is, or goes, in a sorted bin."""
    cdef size_t lo = 0, hi = blocks.size(), mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if fl_before(blocks[0][mid], b):
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef inline void fl_put(FreeLists* fl, Block* b) noexcept nogil:
    """Add free block b to the bin of its class and stream (b.cls is set here)."""
    cdef vector[StreamBin]* bins
    cdef size_t i, n, empty
    b.cls = floor_class(b.size)
    if fl.bins.size() <= <size_t>b.cls:
        fl.bins.resize(b.cls + 1)
        fl.counts.resize(b.cls + 1, 0)
    bins = &fl.bins[b.cls]
    n = empty = bins.size()
    for i in range(n):
        if same_stream(bins[0][i].key, b.stream):
            break
        if empty == n and bins[0][i].blocks.empty():
            empty = i
    else:
        # Empty bins are reused (their storage too), so streams that went idle do not
        # fragment the lists and the steady state allocates nothing.
        if empty == n:
            bins.resize(n + 1)
        i = empty
        bins[0][i].key = b.stream
    bins[0][i].blocks.insert(bins[0][i].blocks.begin() + fl_position(&bins[0][i].blocks, b), b)
    fl.counts[b.cls] += 1
    fl.mask[b.cls >> 6] |= (<uint64_t>1) << (b.cls & 63)
    fl.nblocks += 1


cdef inline void fl_erase(FreeLists* fl, int cls, StreamBin* bin, size_t i) noexcept nogil:
    """Take the i-th block of bin (of class cls) out of the lists."""
    bin.blocks.erase(bin.blocks.begin() + i)
    fl.counts[cls] -= 1
    if fl.counts[cls] == 0:
        fl.mask[cls >> 6] &= ~((<uint64_t>1) << (cls & 63))
    fl.nblocks -= 1


cdef inline bint fl_unbin(FreeLists* fl, Block* b) noexcept nogil:
    """Take free block b out of the lists; whether it was found."""
    cdef vector[StreamBin]* bins
    cdef size_t i, j
    if <size_t>b.cls >= fl.bins.size():
        return False
    bins = &fl.bins[b.cls]
    for i in range(bins.size()):
        if same_stream(bins[0][i].key, b.stream):
            j = fl_position(&bins[0][i].blocks, b)
            if j < bins[0][i].blocks.size() and bins[0][i].blocks[j] == b:
                fl_erase(fl, b.cls, &bins[0][i], j)
                return True
            return False
    return False


cdef inline int fl_next_class(FreeLists* fl, int cls) noexcept nogil:
    """The first class >= cls that holds a block; -1 if none."""
    cdef int w
    cdef uint64_t bits
    if cls < 0:
        cls = 0
    w = cls >> 6
    if w >= MASK_WORDS:
        return -1
    bits = fl.mask[w] & (~(<uint64_t>0) << (cls & 63))
    while True:
        if bits:
            return (w << 6) + __builtin_ctzll(bits)
        w += 1
        if w >= MASK_WORDS:
            return -1
        bits = fl.mask[w]


cdef inline void fl_each(FreeLists* fl, vector[Block*]* out) noexcept nogil:
    """Append every block of the lists to out (the lists are unchanged)."""
    cdef size_t c, i, j
    for c in range(fl.bins.size()):
        for i in range(fl.bins[c].size()):
            for j in range(fl.bins[c][i].blocks.size()):
                out.push_back(fl.bins[c][i].blocks[j])


cdef inline bint fl_has_exact(FreeLists* fl, size_t size, StreamKey s) noexcept nogil:
    """Whether a block of exactly size bytes is free on stream s (a request would take it
    without a cut)."""
    cdef int cls = floor_class(size)
    cdef size_t i, j
    if <size_t>cls >= fl.bins.size():
        return False
    for i in range(fl.bins[cls].size()):
        if same_stream(fl.bins[cls][i].key, s):
            j = fl_lower(&fl.bins[cls][i].blocks, size)
            return j < fl.bins[cls][i].blocks.size() and \
                fl.bins[cls][i].blocks[j].size == size
    return False


cdef inline void fl_each_of(FreeLists* fl, StreamKey s, vector[Block*]* out) noexcept nogil:
    """Append every block of the lists free on stream s to out."""
    cdef size_t c, i, j
    for c in range(fl.bins.size()):
        for i in range(fl.bins[c].size()):
            if same_stream(fl.bins[c][i].key, s):
                for j in range(fl.bins[c][i].blocks.size()):
                    out.push_back(fl.bins[c][i].blocks[j])


cdef inline void fl_take_all(FreeLists* fl, vector[Block*]* out) noexcept nogil:
    """Move every block of the lists to out, leaving them empty."""
    cdef int w
    fl_each(fl, out)
    fl.bins.clear()
    fl.counts.clear()
    for w in range(MASK_WORDS):
        fl.mask[w] = 0
    fl.nblocks = 0
