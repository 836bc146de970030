/* The slots of gpupool's CUDA IPC export table: 16 bytes in a file of shared memory that the
 * exporting process maps and every importer maps too (gpupool/ipc/table.pyx makes the table).
 *
 * A slot describes one export target: a buffer (its state goes RETIRED when the buffer gives
 * its block back, so a later open fails) or a segment (an upstream allocation whose IPC handle
 * was given out: `opened` counts the importers' mappings of it, and the pool does not return
 * the segment to the driver while it is above 0: core/segments.pxd). Importers change `opened`
 * with atomic adds, and hold a read lock (an open-file-description lock, which the kernel drops
 * when the process ends) on the slot's 16 bytes while they count in it, so the exporter can
 * forget the count of an importer that died without closing (gp_ipc_reset_opened). The
 * exporter reads `opened` without its pool's lock.
 */
#ifndef GP_IPC_H
#define GP_IPC_H

#include <stdint.h>

enum {
    GP_IPC_FREE = 0,        /* not in use */
    GP_IPC_LIVE = 1,        /* its buffer or segment holds the memory */
    GP_IPC_RETIRED = 2      /* given back: opening a handle of it fails */
};

typedef struct gp_ipc_slot {
    uint64_t serial;        /* a new value each time the slot is put to use; 0: never */
    uint32_t state;
    int32_t opened;         /* importers holding it open */
} gp_ipc_slot;

static inline int32_t gp_ipc_opened(gp_ipc_slot* s) {
    return __atomic_load_n(&s->opened, __ATOMIC_SEQ_CST);
}

static inline int32_t gp_ipc_add_opened(gp_ipc_slot* s, int32_t delta) {
    return __atomic_add_fetch(&s->opened, delta, __ATOMIC_SEQ_CST);
}

static inline uint32_t gp_ipc_state(gp_ipc_slot* s) {
    return __atomic_load_n(&s->state, __ATOMIC_SEQ_CST);
}

static inline uint64_t gp_ipc_serial(gp_ipc_slot* s) {
    return __atomic_load_n(&s->serial, __ATOMIC_SEQ_CST);
}

static inline void gp_ipc_retire(gp_ipc_slot* s) {
    __atomic_store_n(&s->state, (uint32_t)GP_IPC_RETIRED, __ATOMIC_SEQ_CST);
}

/* Put a free slot to use with a new serial (the exporter only). */
static inline void gp_ipc_claim(gp_ipc_slot* s, uint64_t serial) {
    __atomic_store_n(&s->state, (uint32_t)GP_IPC_FREE, __ATOMIC_SEQ_CST);
    __atomic_store_n(&s->serial, serial, __ATOMIC_SEQ_CST);
    __atomic_store_n(&s->state, (uint32_t)GP_IPC_LIVE, __ATOMIC_SEQ_CST);
}

/* Set `opened` to 0 if it still is `expected` (the exporter, once no importer's lock backs it). */
static inline int gp_ipc_reset_opened(gp_ipc_slot* s, int32_t expected) {
    return __atomic_compare_exchange_n(&s->opened, &expected, 0, 0, __ATOMIC_SEQ_CST,
                                       __ATOMIC_SEQ_CST);
}

/* The slot is free for reuse (the exporter only, once no importer holds it). */
static inline void gp_ipc_free(gp_ipc_slot* s) {
    __atomic_store_n(&s->state, (uint32_t)GP_IPC_FREE, __ATOMIC_SEQ_CST);
}

#endif /* GP_IPC_H */
