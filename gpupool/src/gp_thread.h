/* The calling thread's state that the pool reads on every allocation, in one thread-local
 * struct so that the hot path fetches it once: its stack of entered regions
 * (gp_region_stack.h), its current tag (gpupool.tag) and its magazines (gp_magazine.h), one
 * per pool it has freed into, found by the pool's address. The struct is plain data (reading it costs no initialization check);
 * a second thread-local object, touched only when a magazine is made, hands the thread's
 * magazines to gp_magazine_exit_hook when the thread exits. The thread-local variables are
 * static: only core/pool.pyx's module may call these functions (core/thread.pxd says so), so
 * that there is one state per thread. */
#ifndef GPUPOOL_THREAD_H
#define GPUPOOL_THREAD_H

#include "gp_magazine.h"
#include "gp_region_stack.h"

struct gp_thread {
    gp_region_stack regions;
    int tag;        /* the current gpupool.tag's id (core/tagged.pxd), 0: none; on the cache
                       line of magazines[0], which the fast path reads next */
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

/* Once per thread, so out of line and cold: inlined, it takes registers and stack from the
 * magazine fast path around every gp_this_thread (Note [Hot path across the PoolBase split]
 * in docs/design.md). */
__attribute__((noinline, cold)) static gp_thread* gp_make_thread(void) {
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

#endif
