/* The pool's lock: one atomic word, taken with a single compare-and-swap when free (the
 * common case: one Python thread, or threads that rarely meet), a short spin when held, then
 * a futex wait. Cheaper than std::mutex on the allocate/free path, which takes it twice per
 * allocate + free pair. Linux only, as gpupool is.
 * State: 0 free, 1 held, 2 held and a thread may be waiting (unlock must wake one). */
#ifndef GPUPOOL_LOCK_H
#define GPUPOOL_LOCK_H

#include <atomic>
#include <climits>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

static inline void gp_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* The word both of gpupool's locks are (gp_lock below, a magazine's gp_spin in gp_magazine.h):
 * 0 free, non-zero held; taken with one compare-and-swap. */
struct gp_lock_word {
    std::atomic<int> state;

    gp_lock_word() : state(0) {}

    bool try_lock() {
        int expected = 0;
        return state.compare_exchange_strong(expected, 1, std::memory_order_acquire,
                                             std::memory_order_relaxed);
    }

    /* Waits at most `spins` pauses for it, never yielding or sleeping; whether it got it. */
    bool try_lock_spin(unsigned spins) {
        for (unsigned i = 0; i < spins; i++) {
            gp_cpu_relax();
            if (state.load(std::memory_order_relaxed) == 0 && try_lock())
                return true;
        }
        return false;
    }
};

struct gp_lock : gp_lock_word {
    void lock() {
        if (try_lock() || try_lock_spin(128))
            return;
        /* Mark the lock contended, then sleep until an unlock wakes us. */
        while (state.exchange(2, std::memory_order_acquire) != 0)
            syscall(SYS_futex, reinterpret_cast<int*>(&state), FUTEX_WAIT_PRIVATE, 2,
                    nullptr, nullptr, 0);
    }

    void unlock() {
        if (state.exchange(0, std::memory_order_release) == 2)
            syscall(SYS_futex, reinterpret_cast<int*>(&state), FUTEX_WAKE_PRIVATE, 1,
                    nullptr, nullptr, 0);
    }
};

#endif
