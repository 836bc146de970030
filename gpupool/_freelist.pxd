# Free lists: free blocks binned by (size class, stream), the structure the pool and every
# region cache keep their free blocks in. Operations on the structure only (put, pop, unbin,
# each); which block a request takes is the stream-order layer's choice (_streamorder.pxd).
#
# In a bin, free blocks of one (size class, stream) form a heap, oldest block (lowest rank)
# first: the same request sequence then gets the same blocks, in the order it first got them,
# whatever order they were freed in.
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector
from libcpp.pair cimport pair
from libcpp.algorithm cimport push_heap, pop_heap, make_heap
from gpupool._block cimport Block
from gpupool._streams cimport StreamKey, same_stream

ctypedef pair[uintptr_t, Block*] HeapItem      # (~rank, block): std heaps are max-heaps

cdef cppclass StreamBin:
    StreamKey key
    vector[HeapItem] heap

cdef cppclass FreeLists:
    vector[vector[StreamBin]] bins      # by size class, then one bin per stream


cdef inline void fl_put(FreeLists* fl, Block* b) noexcept nogil:
    """Add free block b to the bin of (b.cls, b.stream)."""
    cdef vector[StreamBin]* bins
    cdef size_t i, n, empty
    if fl.bins.size() <= <size_t>b.cls:
        fl.bins.resize(b.cls + 1)
    bins = &fl.bins[b.cls]
    n = empty = bins.size()
    for i in range(n):
        if same_stream(bins[0][i].key, b.stream):
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


cdef inline Block* fl_front(vector[StreamBin]* bins, size_t i) noexcept nogil:
    """The oldest block of bin i (which must not be empty)."""
    return bins[0][i].heap.front().second


cdef inline Block* fl_pop(vector[StreamBin]* bins, size_t i) noexcept nogil:
    """Take the oldest block out of bin i (which must not be empty)."""
    cdef vector[HeapItem]* heap = &bins[0][i].heap
    pop_heap(heap.begin(), heap.end())
    cdef Block* b = heap.back().second
    heap.pop_back()
    return b


cdef inline vector[StreamBin]* fl_class(FreeLists* fl, int cls) noexcept nogil:
    """The bins of size class cls; NULL when no block of that class was ever put."""
    if <size_t>cls >= fl.bins.size():
        return NULL
    return &fl.bins[cls]


cdef inline bint fl_unbin(FreeLists* fl, Block* b) noexcept nogil:
    """Take block b out of the lists (where it is binned by its class and stream); whether
    it was found."""
    cdef vector[StreamBin]* bins = fl_class(fl, b.cls)
    cdef vector[HeapItem]* heap
    cdef size_t i, j
    if bins == NULL:
        return False
    for i in range(bins.size()):
        if not same_stream(bins[0][i].key, b.stream):
            continue
        heap = &bins[0][i].heap
        for j in range(heap.size()):
            if heap[0][j].second == b:
                heap[0][j] = heap.back()
                heap.pop_back()
                make_heap(heap.begin(), heap.end())
                return True
    return False


cdef inline void fl_each(FreeLists* fl, vector[Block*]* out) noexcept nogil:
    """Append every block of the lists to out (bin by bin; the lists are unchanged)."""
    cdef size_t c, i
    for c in range(fl.bins.size()):
        for i in range(fl.bins[c].size()):
            for item in fl.bins[c][i].heap:
                out.push_back(item.second)


cdef inline void fl_each_of(FreeLists* fl, StreamKey s, vector[Block*]* out) noexcept nogil:
    """Append every block of the lists free on stream s to out."""
    cdef size_t c, i
    for c in range(fl.bins.size()):
        for i in range(fl.bins[c].size()):
            if same_stream(fl.bins[c][i].key, s):
                for item in fl.bins[c][i].heap:
                    out.push_back(item.second)


cdef inline void fl_take_all(FreeLists* fl, vector[Block*]* out) noexcept nogil:
    """Move every block of the lists to out, leaving them empty."""
    fl_each(fl, out)
    fl.bins.clear()
