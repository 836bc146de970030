/* The calling thread's magazines (gpupool/_magazine.pxd): one per pool the thread has freed
 * into, found by the pool's address. The table is plain thread-local data (reading it costs
 * no TLS initialization check); a second thread-local object, touched only when a magazine is
 * made, hands the thread's magazines to gp_magazine_exit_hook when the thread exits. Included
 * by _pool.pyx alone, so there is one table per thread. */
#ifndef GPUPOOL_MAGAZINE_H
#define GPUPOOL_MAGAZINE_H

#define GP_THREAD_POOLS 8       /* pools with a magazine per thread (more: the shared path) */

struct gp_thread_magazine {
    void* pool;                 /* the pool (borrowed: the magazine says if it still lives) */
    void* magazine;
};

static thread_local gp_thread_magazine gp_thread_magazines[GP_THREAD_POOLS];
static void (*gp_magazine_exit_hook)(void*) = nullptr;

struct gp_magazine_reaper {
    bool armed = false;
    ~gp_magazine_reaper() {
        if (!armed || gp_magazine_exit_hook == nullptr)
            return;
        for (int i = 0; i < GP_THREAD_POOLS; i++) {
            if (gp_thread_magazines[i].magazine != nullptr)
                gp_magazine_exit_hook(gp_thread_magazines[i].magazine);
            gp_thread_magazines[i].pool = nullptr;
            gp_thread_magazines[i].magazine = nullptr;
        }
    }
};

static thread_local gp_magazine_reaper gp_thread_reaper;

static inline void gp_arm_reaper(void) { gp_thread_reaper.armed = true; }

#endif
