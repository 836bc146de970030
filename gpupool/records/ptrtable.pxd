# The blocks the C API handed out, by pointer (the C API frees by pointer): an
# open-addressing table with linear probing and no allocation per entry. Keys are 256-byte
# aligned pointers, so 0 marks an empty slot and 1 a deleted one.
from libc.stdint cimport uintptr_t
from libcpp.pair cimport pair
from libcpp.vector cimport vector
from gpupool.records.block cimport Block

ctypedef pair[uintptr_t, Block*] PtrSlot

cdef cppclass PtrTable:
    vector[PtrSlot] slots
    size_t used             # slots not empty (live or deleted)

cdef enum:
    SLOT_EMPTY = 0
    SLOT_DELETED = 1


cdef inline size_t pt_home(uintptr_t ptr, size_t mask) noexcept nogil:
    return <size_t>(((ptr >> 8) * <uintptr_t>0x9E3779B97F4A7C15) >> 32) & mask


cdef inline size_t pt_find(PtrTable* t, uintptr_t ptr) noexcept nogil:
    """Slot of ptr, or the table's size when absent."""
    cdef size_t n = t.slots.size(), i
    if n == 0:
        return 0
    i = pt_home(ptr, n - 1)
    while t.slots[i].first != SLOT_EMPTY:
        if t.slots[i].first == ptr:
            return i
        i = (i + 1) & (n - 1)
    return n


cdef inline void pt_insert(PtrTable* t, uintptr_t ptr, Block* b) noexcept nogil:
    cdef vector[PtrSlot] old
    cdef size_t n = t.slots.size(), i
    if 2 * (t.used + 1) > n:                # keep at most half the slots used
        old.swap(t.slots)
        t.slots.assign(max(64, 2 * n), PtrSlot(SLOT_EMPTY, NULL))
        t.used = 0
        for i in range(old.size()):
            if old[i].first > SLOT_DELETED:
                pt_insert(t, old[i].first, old[i].second)
        n = t.slots.size()
    i = pt_home(ptr, n - 1)
    while t.slots[i].first > SLOT_DELETED:
        i = (i + 1) & (n - 1)
    if t.slots[i].first == SLOT_EMPTY:
        t.used += 1
    t.slots[i] = PtrSlot(ptr, b)


cdef inline Block* pt_lookup(PtrTable* t, uintptr_t ptr, bint remove) noexcept nogil:
    """The block at ptr, taken out of the table if remove; NULL when absent."""
    cdef size_t i = pt_find(t, ptr)
    if i >= t.slots.size():
        return NULL
    if remove:
        t.slots[i].first = SLOT_DELETED
    return t.slots[i].second
