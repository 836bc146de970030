/* The calling thread's state that the pool reads on every allocation, in one thread-local
 * struct so that the hot path fetches it once: its stack of entered regions
 * (core/regionstack.pxi) and its magazines (core/magazine.pxd), one per pool it has freed into,
 * found by the pool's address. The struct is plain data (reading it costs no initialization
 * check); a second thread-local object, touched only when a magazine is made, hands the
 * thread's magazines to gp_magazine_exit_hook when the thread exits. Included by core/pool.pyx
 * alone, so there is one per thread. Also the magazines' lock. */
#ifndef GPUPOOL_MAGAZINE_H
#define GPUPOOL_MAGAZINE_H

#include <atomic>
#include <sched.h>
#include "gp_lock.h"

#define GP_REGION_DEPTH_MAX 64
#define GP_THREAD_POOLS 8       /* pools with a magazine per thread (more: the shared path) */

struct gp_thread_magazine {
    void* pool;                 /* the pool (borrowed: the magazine says if it still lives) */
    void* magazine;
};

struct gp_thread {
    int region_depth;
    void* region_stack[GP_REGION_DEPTH_MAX];
    gp_thread_magazine magazines[GP_THREAD_POOLS];
};

static void (*gp_magazine_exit_hook)(void*) = nullptr;

/* The thread's state lives on the heap, found through one thread-local pointer in the
 * initial-exec model (a load relative to the thread register: no __tls_get_addr call on the
 * hot path; 8 bytes of static TLS). Made on the thread's first use; the reaper (a
 * thread-local object with a destructor, touched only then) gives its magazines to
 * gp_magazine_exit_hook and frees it when the thread exits. A call after that (another
 * library's thread-exit code freeing a buffer) gets a state with no magazines, never freed. */
static __thread gp_thread* gp_thread_ptr __attribute__((tls_model("initial-exec"))) = nullptr;
static __thread bool gp_thread_gone __attribute__((tls_model("initial-exec"))) = false;

struct gp_magazine_reaper {
    gp_thread* state = nullptr;
    ~gp_magazine_reaper() {
        gp_thread* t = state;
        if (t == nullptr)
            return;
        for (int i = 0; i < GP_THREAD_POOLS; i++) {
            if (t->magazines[i].magazine != nullptr && gp_magazine_exit_hook != nullptr)
                gp_magazine_exit_hook(t->magazines[i].magazine);
            t->magazines[i].pool = nullptr;
            t->magazines[i].magazine = nullptr;
        }
        gp_thread_gone = true;
        gp_thread_ptr = nullptr;
        delete t;
    }
};

static thread_local gp_magazine_reaper gp_thread_reaper;

static gp_thread* gp_make_thread(void) {
    gp_thread* t = new gp_thread();             /* value-initialized: depth 0, no magazines */
    gp_thread_ptr = t;
    if (!gp_thread_gone)
        gp_thread_reaper.state = t;
    return t;
}

static inline gp_thread* gp_this_thread(void) {
    gp_thread* t = gp_thread_ptr;
    return t != nullptr ? t : gp_make_thread();
}

/* Whether magazines may be made on this thread (not once its thread-exit code has run). */
static inline bool gp_thread_alive(void) { return !gp_thread_gone; }

static inline void gp_arm_reaper(void) {}

/* A magazine's lock: its thread takes it with one compare-and-swap and gives it back with a
 * plain release store (no read-modify-write); another thread (the pool flushing it, rarely)
 * spins, yielding the processor now and then, since the holder never waits inside. */
struct gp_spin {
    std::atomic<int> state;

    gp_spin() : state(0) {}

    bool try_lock() {
        int expected = 0;
        return state.compare_exchange_strong(expected, 1, std::memory_order_acquire,
                                             std::memory_order_relaxed);
    }

    void lock() {
        while (!try_lock() && !try_lock_spin(128))
            sched_yield();
    }

    /* Waits at most `spins` pauses for it, never yielding; whether it got it. Its own thread
     * calls it when a sweep of the pool holds it (a few loads and stores), lock() between
     * its yields. */
    bool try_lock_spin(unsigned spins) {
        for (unsigned i = 0; i < spins; i++) {
            gp_cpu_relax();
            if (state.load(std::memory_order_relaxed) == 0 && try_lock())
                return true;
        }
        return false;
    }

    void unlock() { state.store(0, std::memory_order_release); }
};

#endif
