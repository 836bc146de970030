# The CUDA IPC export table: a file of shared memory of 16-byte slots (src/gp_ipc.h) that the
# exporting process makes and its importers map; the locks importers hold on their slots.
from gpupool.records.ipcslot cimport gp_ipc_slot

cdef enum:
    SLOTS = 1 << 20                 # slots of a table: 16 MiB, sparse

cdef inline size_t table_bytes() noexcept nogil:
    return SLOTS * sizeof(gp_ipc_slot)

cdef class Table:
    cdef readonly str path
    cdef readonly int fd
    cdef readonly bint own
    cdef gp_ipc_slot* slots

    cdef gp_ipc_slot* slot(self, size_t index) except NULL
    cdef size_t index(self, gp_ipc_slot* slot) noexcept

cdef Table own_table()
cdef Table current_own_table()
cdef Table made_own_table()
