# The pool's lock (src/gp_lock.h: one compare-and-swap when free, then a futex), taken without
# blocking other Python threads, with the regions' lanes (core/lane.pxd), and the wanted
# streams it publishes to the fast path at each unlock (core/free.pxd has the unlock: it runs
# the deferred frees first).
from gpupool.records.streams cimport StreamKey, current_thread
from gpupool.core.lane cimport ln_enter
from gpupool.core.state cimport PoolState, WANTED_FAST

cdef extern from "Python.h" nogil:
    ctypedef struct PyThreadState
    int PyGILState_Check()
    PyThreadState* PyEval_SaveThread()
    void PyEval_RestoreThread(PyThreadState*)


cdef inline int wanted_bit(StreamKey s) noexcept nogil:
    """The stream's bit in the pool's wanted mask (Fibonacci hashing of its key)."""
    return <int>(((s.handle ^ (s.tag << 1)) * 0x9E3779B97F4A7C15ULL) >> 58)


cdef inline void ps_wait(PoolState* st) noexcept nogil:
    """Wait for the pool's lock. A Python thread waiting for it lets the others run: the
    lock_thread may need the GIL (a Python upstream), and must not deadlock against us."""
    cdef PyThreadState* state
    if PyGILState_Check():
        state = PyEval_SaveThread()
        st.mutex.lock()
        PyEval_RestoreThread(state)
    else:
        st.mutex.lock()


cdef inline void ps_lock(PoolState* st) noexcept nogil:
    """Take the pool's lock, and the regions' lanes' (core/lane.pxd)."""
    if not st.mutex.try_lock():
        ps_wait(st)
    ps_locked(st)


cdef inline void ps_locked(PoolState* st) noexcept nogil:
    """The pool's lock was just taken by the calling thread: it is the lock_thread, and
    holds the regions' lanes too."""
    st.lock_thread = current_thread()
    ln_enter(st)


cdef inline void ps_copy_wanted(PoolState* st) noexcept nogil:
    """Under the pool's lock: publish the wanted streams to the fast path (fp_take). A racy
    read may see a half-written key: then a wanted stream's request goes the fast way once
    (its answer waits for the next), or another stream's the shared way."""
    cdef size_t i, n = st.order.wanted.size()
    cdef unsigned long long mask = 0
    for i in range(n):
        mask |= 1ULL << wanted_bit(st.order.wanted[i])
        if i < WANTED_FAST:
            st.wanted[i] = st.order.wanted[i]
    st.wanted_mask = mask
    st.nwanted = <int>n if n <= WANTED_FAST else WANTED_FAST + 1
