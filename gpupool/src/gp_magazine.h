/* A thread's magazines (core/magazine.pxd): the slot that finds one by its pool's address, and
 * the magazine's lock. Part of the thread's state (gp_thread.h). */
#ifndef GPUPOOL_MAGAZINE_H
#define GPUPOOL_MAGAZINE_H

#include <atomic>
#include <sched.h>
#include "gp_lock.h"

#define GP_THREAD_POOLS 8       /* pools with a magazine per thread (more: the shared path) */

struct gp_thread_magazine {
    void* pool;                 /* the pool (borrowed: the magazine says if it still lives) */
    void* magazine;
};

/* A magazine's lock: its thread takes it with one compare-and-swap and gives it back with a
 * plain release store (no read-modify-write); another thread (the pool flushing it, rarely)
 * spins, yielding the processor now and then, since the holder never waits inside. */
struct gp_spin : gp_lock_word {
    void lock() {
        while (!try_lock() && !try_lock_spin(128))
            sched_yield();
    }

    /* try_lock_spin (gp_lock_word): its own thread calls it when a sweep of the pool holds
     * it (a few loads and stores), lock() between its yields. */

    void unlock() { state.store(0, std::memory_order_release); }
};

#endif
