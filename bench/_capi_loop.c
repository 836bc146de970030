/* Benchmark helper built by bench/threads.py at run time (bench/_cext.py): a loop of cached
 * allocate + free pairs through gpupool's C API (gpupool.h), run without the GIL, so that
 * several Python threads calling it at once run in parallel (timed per pair, or as a span on
 * the monotonic clock that several threads' loops share); and a loop of the two driver
 * calls that a created stream's key costs gpupool (key_loop) and a loop that shares nothing
 * (spin_loop), for comparison; and a replay of a recorded trace's allocate and free events
 * (replay), each call timed, with a host buffer walked between two events to push the
 * allocator's structures out of the caches. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <time.h>
#include <gpupool.h>

#define MAX_SIZES 16

static const gpupool_api* api;

static long long ns_of(const struct timespec* t) {
    return (long long)t->tv_sec * 1000000000LL + t->tv_nsec;
}

/* The pairs of loop() and loop_span(): parses (sizes, n[, device, stream]), runs n pairs
 * without the GIL, sets *n and the CLOCK_MONOTONIC times around them; 0, or -1 with an
 * exception set. */
static int run_pairs(PyObject* args, Py_ssize_t* pairs, long long* t0_ns, long long* t1_ns) {
    PyObject* seq;
    Py_ssize_t n, count;
    int device = 0, code = GPUPOOL_OK;
    unsigned long long stream = 0;
    size_t sizes[MAX_SIZES];
    struct timespec t0, t1;
    void* ptr;
    if (!PyArg_ParseTuple(args, "On|iK", &seq, &n, &device, &stream))
        return -1;
    seq = PySequence_Fast(seq, "sizes must be a sequence of ints");
    if (seq == NULL)
        return -1;
    count = PySequence_Fast_GET_SIZE(seq);
    if (count < 1 || count > MAX_SIZES || n < 0) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "need 1 to %d sizes and n >= 0", MAX_SIZES);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t v = PyNumber_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i), PyExc_OverflowError);
        if (v <= 0) {
            Py_DECREF(seq);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "sizes must be positive");
            return -1;
        }
        sizes[i] = (size_t)v;
    }
    Py_DECREF(seq);
    Py_BEGIN_ALLOW_THREADS
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (Py_ssize_t i = 0; i < n && code == GPUPOOL_OK; i++) {
        code = api->allocate(device, sizes[i % count], (uintptr_t)stream, &ptr);
        if (code == GPUPOOL_OK)
            code = api->free(device, ptr, (uintptr_t)stream);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    Py_END_ALLOW_THREADS
    if (code != GPUPOOL_OK) {
        PyErr_Format(code == GPUPOOL_ERROR_OUT_OF_MEMORY ? PyExc_MemoryError : PyExc_RuntimeError,
                     "gpupool error %d: %s", code, api->error_string(code));
        return -1;
    }
    *pairs = n;
    *t0_ns = ns_of(&t0);
    *t1_ns = ns_of(&t1);
    return 0;
}

/* loop(sizes, n, device=0, stream=0) -> ns per pair: n allocate + free pairs on `stream`,
 * the i-th of `nbytes = sizes[i % len(sizes)]`, timed in C (CLOCK_MONOTONIC). */
static PyObject* loop(PyObject* self, PyObject* args) {
    Py_ssize_t n;
    long long t0, t1;
    if (run_pairs(args, &n, &t0, &t1) < 0)
        return NULL;
    return PyFloat_FromDouble(n ? (double)(t1 - t0) / (double)n : 0.0);
}

/* loop_span(sizes, n, device=0, stream=0) -> (start_ns, end_ns): the same pairs, and the
 * CLOCK_MONOTONIC times (ns) just before the first and just after the last, so that several
 * threads' loops can be put on one time line. */
static PyObject* loop_span(PyObject* self, PyObject* args) {
    Py_ssize_t n;
    long long t0, t1;
    if (run_pairs(args, &n, &t0, &t1) < 0)
        return NULL;
    return Py_BuildValue("LL", t0, t1);
}

/* The driver functions of a created stream's key (gpupool/upstream/upstreams.pyx, stream_id), found
 * in libcuda at run time: no CUDA headers or toolkit needed. */
typedef int (*is_capturing_fn)(uintptr_t stream, int* status);
typedef int (*get_id_fn)(uintptr_t stream, unsigned long long* id);

/* key_loop(n, stream) -> ns per lookup: n times cuStreamIsCapturing + cuStreamGetId on
 * `stream` (a created stream's handle), without the GIL, timed in C. */
static PyObject* key_loop(PyObject* self, PyObject* args) {
    static is_capturing_fn is_capturing;
    static get_id_fn get_id;
    Py_ssize_t n;
    unsigned long long stream, id = 0;
    int status = 0, code = 0;
    struct timespec t0, t1;
    if (!PyArg_ParseTuple(args, "nK", &n, &stream))
        return NULL;
    if (get_id == NULL) {
        void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (lib == NULL)
            lib = dlopen("libcuda.so.1", RTLD_NOW);
        if (lib != NULL) {
            is_capturing = (is_capturing_fn)dlsym(lib, "cuStreamIsCapturing");
            get_id = (get_id_fn)dlsym(lib, "cuStreamGetId");
        }
        if (is_capturing == NULL || get_id == NULL) {
            get_id = NULL;
            return PyErr_Format(PyExc_OSError, "libcuda.so.1 with cuStreamGetId not found");
        }
    }
    Py_BEGIN_ALLOW_THREADS
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (Py_ssize_t i = 0; i < n && code == 0; i++) {
        code = is_capturing((uintptr_t)stream, &status);
        if (code == 0)
            code = get_id((uintptr_t)stream, &id);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    Py_END_ALLOW_THREADS
    if (code != 0)
        return PyErr_Format(PyExc_RuntimeError, "CUresult %d from the stream lookup", code);
    double ns = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
    return PyFloat_FromDouble(n ? ns / (double)n : 0.0);
}

/* spin_loop(n) -> (start_ns, end_ns): n rounds of a xorshift chain (72 dependent shift-xor
 * steps each, no memory shared between threads, no calls), without the GIL: a control whose
 * scaling over threads is what the machine gives a loop that shares nothing. */
static PyObject* spin_loop(PyObject* self, PyObject* args) {
    Py_ssize_t n;
    uint64_t x = 0x9E3779B97F4A7C15ULL;
    static volatile uint64_t sink;
    struct timespec t0, t1;
    if (!PyArg_ParseTuple(args, "n", &n))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (Py_ssize_t i = 0; i < n; i++) {
        for (int k = 0; k < 24; k++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    Py_END_ALLOW_THREADS
    sink = x;
    return Py_BuildValue("LL", ns_of(&t0), ns_of(&t1));
}

/* A 1-D C-contiguous buffer of int64 of `obj` (writable when `writable`) into *view; 0, or -1
 * with an exception naming `what` set. */
static int int64_view(PyObject* obj, Py_buffer* view, int writable, const char* what) {
    int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (view->ndim != 1 || view->itemsize != 8 || view->format == NULL ||
        (view->format[0] != 'q' && view->format[0] != 'l') || view->format[1] != '\0') {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D contiguous int64 array", what);
        return -1;
    }
    return 0;
}

/* Reads and writes a byte every 64 B (a cache line) of buf's n bytes. */
static void walk(volatile unsigned char* buf, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i += 64)
        buf[i] = (unsigned char)(buf[i] + 1);
}

/* The events' checks before the GIL is let go: op 0 (allocate) or 1 (free), 0 <= id < slots,
 * an allocation's nbytes > 0. -1 with ValueError naming the first bad event. */
static int check_events(const long long* op, const long long* id, const long long* nbytes,
                        Py_ssize_t n, Py_ssize_t slots) {
    for (Py_ssize_t k = 0; k < n; k++) {
        if (op[k] != 0 && op[k] != 1) {
            PyErr_Format(PyExc_ValueError, "event %zd: op %lld is neither 0 (allocate) nor 1 "
                         "(free)", k, op[k]);
            return -1;
        }
        if (id[k] < 0 || id[k] >= slots) {
            PyErr_Format(PyExc_ValueError, "event %zd: id %lld outside the %zd slots of ptrs",
                         k, id[k], slots);
            return -1;
        }
        if (op[k] == 0 && nbytes[k] <= 0) {
            PyErr_Format(PyExc_ValueError, "event %zd: an allocation of %lld bytes", k,
                         nbytes[k]);
            return -1;
        }
    }
    return 0;
}

/* replay(op, id, nbytes, ptrs, pollute=None, times=None, device=0, stream=0)
 *     -> (allocate_ns, free_ns, allocates, frees, clock_ns)
 * The events (op 0: api->allocate(device, nbytes, stream), op 1: api->free of the id's block)
 * in order, without the GIL; ptrs[id] holds the id's pointer while it is live (0: not live),
 * kept by the caller across calls. An allocation of a live id and a free of one not live are
 * skipped, as tools/profile/long_replay.py does. Before each event every 64th byte of
 * `pollute` (a writable buffer) is read and written, untimed. Each C API call is timed on
 * its own (CLOCK_MONOTONIC around it); clock_ns sums, per call, the span of two readings
 * back to back: what the timing itself adds to each call's time. `times` (a writable int64
 * array as long as op, or None) gets each event's call's ns, -1 for an event skipped. */
enum { OP, ID, NBYTES, PTRS, POLLUTE, TIMES, ARGS };

static PyObject* replay(PyObject* self, PyObject* args) {
    static const char* names[ARGS] = {"op", "id", "nbytes", "ptrs", "pollute", "times"};
    PyObject* obj[ARGS] = {NULL, NULL, NULL, NULL, Py_None, Py_None};
    Py_buffer view[ARGS];
    int held[ARGS] = {0};
    int device = 0, code = GPUPOOL_OK;
    unsigned long long stream = 0;
    long long alloc_ns = 0, free_ns = 0, clock_ns = 0, allocs = 0, frees = 0;
    Py_ssize_t n, bad = -1, walked = 0;
    PyObject* result = NULL;
    if (!PyArg_ParseTuple(args, "OOOO|OOiK", &obj[OP], &obj[ID], &obj[NBYTES], &obj[PTRS],
                          &obj[POLLUTE], &obj[TIMES], &device, &stream))
        return NULL;
    for (int a = 0; a < ARGS; a++) {        /* pollute: any writable buffer; the rest int64 */
        if (obj[a] == Py_None && a >= POLLUTE)
            continue;
        if (a == POLLUTE ? PyObject_GetBuffer(obj[a], &view[a],
                                              PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
                         : int64_view(obj[a], &view[a], a >= PTRS, names[a]))
            goto done;
        held[a] = 1;
    }
    Py_buffer *op = &view[OP], *id = &view[ID], *nbytes = &view[NBYTES], *ptrs = &view[PTRS];
    walked = held[POLLUTE] ? view[POLLUTE].len : 0;
    n = op->shape[0];
    if (id->shape[0] != n || nbytes->shape[0] != n ||
        (held[TIMES] && view[TIMES].shape[0] != n)) {
        PyErr_SetString(PyExc_ValueError, "op, id, nbytes and times must have the same length");
        goto done;
    }
    const long long* ops = op->buf;
    const long long* ids = id->buf;
    const long long* sizes = nbytes->buf;
    long long* slot = ptrs->buf;
    long long* took = held[TIMES] ? view[TIMES].buf : NULL;
    if (check_events(ops, ids, sizes, n, ptrs->shape[0]) < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    struct timespec t0, t1, t2;
    for (Py_ssize_t k = 0; k < n; k++) {
        long long* p = &slot[ids[k]];
        if (took != NULL)
            took[k] = -1;
        if ((ops[k] == 0) == (*p != 0))
            continue;                       /* allocated and live, or freed and not live */
        if (walked)
            walk(view[POLLUTE].buf, walked);
        void* ptr = (void*)(uintptr_t)*p;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        if (ops[k] == 0)
            code = api->allocate(device, (size_t)sizes[k], (uintptr_t)stream, &ptr);
        else
            code = api->free(device, ptr, (uintptr_t)stream);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        clock_gettime(CLOCK_MONOTONIC, &t2);
        clock_ns += ns_of(&t2) - ns_of(&t1);
        if (code != GPUPOOL_OK) {
            bad = k;
            break;
        }
        if (took != NULL)
            took[k] = ns_of(&t1) - ns_of(&t0);
        if (ops[k] == 0) {
            alloc_ns += ns_of(&t1) - ns_of(&t0);
            allocs++;
            *p = (long long)(uintptr_t)ptr;
        } else {
            free_ns += ns_of(&t1) - ns_of(&t0);
            frees++;
            *p = 0;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0)
        PyErr_Format(code == GPUPOOL_ERROR_OUT_OF_MEMORY ? PyExc_MemoryError : PyExc_RuntimeError,
                     "event %zd (%s of id %lld): gpupool error %d: %s", bad,
                     ops[bad] ? "free" : "allocate", ids[bad], code, api->error_string(code));
    else
        result = Py_BuildValue("LLLLL", alloc_ns, free_ns, allocs, frees, clock_ns);
done:
    for (int a = ARGS - 1; a >= 0; a--)
        if (held[a])
            PyBuffer_Release(&view[a]);
    return result;
}

static PyMethodDef methods[] = {
    {"loop", loop, METH_VARARGS, "loop(sizes, n, device=0, stream=0) -> ns per pair"},
    {"loop_span", loop_span, METH_VARARGS,
     "loop_span(sizes, n, device=0, stream=0) -> (start_ns, end_ns)"},
    {"key_loop", key_loop, METH_VARARGS, "key_loop(n, stream) -> ns per stream lookup"},
    {"spin_loop", spin_loop, METH_VARARGS, "spin_loop(n) -> (start_ns, end_ns)"},
    {"replay", replay, METH_VARARGS,
     "replay(op, id, nbytes, ptrs, pollute=None, times=None, device=0, stream=0) -> "
     "(allocate_ns, free_ns, allocates, frees, clock_ns)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpupool_bench_loop",
                                    "Allocate + free loops through gpupool's C API.", -1,
                                    methods};

PyMODINIT_FUNC PyInit_gpupool_bench_loop(void) {
    api = gpupool_import();
    if (api == NULL)
        return NULL;
    return PyModule_Create(&module);
}
