# The slots of the CUDA IPC export table (src/gp_ipc.h), for the records that point at one: a
# DeviceBuffer (retired when it gives its block back) and a Segment (not returned to the
# driver while importers hold it open). The table itself is made in ipc/share.pyx.
from libc.stdint cimport uint32_t, uint64_t, int32_t

cdef extern from "gp_ipc.h" nogil:
    enum:
        GP_IPC_FREE
        GP_IPC_LIVE
        GP_IPC_RETIRED
    ctypedef struct gp_ipc_slot:
        uint64_t serial
        uint32_t state
        int32_t opened
    int32_t gp_ipc_opened(gp_ipc_slot* s)
    int32_t gp_ipc_add_opened(gp_ipc_slot* s, int32_t delta)
    uint32_t gp_ipc_state(gp_ipc_slot* s)
    uint64_t gp_ipc_serial(gp_ipc_slot* s)
    void gp_ipc_retire(gp_ipc_slot* s)
    void gp_ipc_claim(gp_ipc_slot* s, uint64_t serial)
    void gp_ipc_free(gp_ipc_slot* s)
    bint gp_ipc_reset_opened(gp_ipc_slot* s, int32_t expected)
