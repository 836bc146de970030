/* A small C extension that allocates its scratch memory from gpupool's pool, through the
 * C API (gpupool.h), without the GIL: one scratch buffer per call, handed back at once. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <time.h>
#include <gpupool.h>

static const gpupool_api* api;

static PyObject* raise_code(int code) {
    PyErr_Format(code == GPUPOOL_ERROR_OUT_OF_MEMORY ? PyExc_MemoryError : PyExc_RuntimeError,
                 "gpupool error %d: %s", code, api->error_string(code));
    return NULL;
}

/* with_scratch(nbytes, fn, device=0, stream=0): call fn(ptr, nbytes) with scratch memory. */
static PyObject* with_scratch(PyObject* self, PyObject* args) {
    Py_ssize_t nbytes;
    PyObject* fn;
    int device = 0, code;
    unsigned long long stream = 0;
    void* ptr;
    if (!PyArg_ParseTuple(args, "nO|iK", &nbytes, &fn, &device, &stream))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    code = api->allocate(device, (size_t)nbytes, (uintptr_t)stream, &ptr);
    Py_END_ALLOW_THREADS
    if (code != GPUPOOL_OK)
        return raise_code(code);
    PyObject* result = PyObject_CallFunction(fn, "Kn", (unsigned long long)(uintptr_t)ptr, nbytes);
    code = api->free(device, ptr, (uintptr_t)stream);
    if (result == NULL)
        return NULL;
    if (code != GPUPOOL_OK) {
        Py_DECREF(result);
        return raise_code(code);
    }
    return result;
}

/* allocate(nbytes, device=0, stream=0) -> pointer; free(ptr, device=0, stream=0). */
static PyObject* c_allocate(PyObject* self, PyObject* args) {
    Py_ssize_t nbytes;
    int device = 0, code;
    unsigned long long stream = 0;
    void* ptr;
    if (!PyArg_ParseTuple(args, "n|iK", &nbytes, &device, &stream))
        return NULL;
    code = api->allocate(device, (size_t)nbytes, (uintptr_t)stream, &ptr);
    if (code != GPUPOOL_OK)
        return raise_code(code);
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)ptr);
}

static PyObject* c_free(PyObject* self, PyObject* args) {
    unsigned long long ptr, stream = 0;
    int device = 0, code;
    if (!PyArg_ParseTuple(args, "K|iK", &ptr, &device, &stream))
        return NULL;
    code = api->free(device, (void*)(uintptr_t)ptr, (uintptr_t)stream);
    if (code != GPUPOOL_OK)
        return raise_code(code);
    Py_RETURN_NONE;
}

static PyObject* c_stats(PyObject* self, PyObject* args) {
    int device = 0, code;
    gpupool_stats s;
    if (!PyArg_ParseTuple(args, "|i", &device))
        return NULL;
    code = api->get_stats(device, &s);
    if (code != GPUPOOL_OK)
        return raise_code(code);
    return Py_BuildValue(
        "{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n}",
        "in_use_bytes", (Py_ssize_t)s.in_use_bytes,
        "peak_in_use_bytes", (Py_ssize_t)s.peak_in_use_bytes,
        "reserved_bytes", (Py_ssize_t)s.reserved_bytes,
        "peak_reserved_bytes", (Py_ssize_t)s.peak_reserved_bytes,
        "cached_bytes", (Py_ssize_t)s.cached_bytes, "num_allocs", (Py_ssize_t)s.num_allocs,
        "num_frees", (Py_ssize_t)s.num_frees, "cache_hits", (Py_ssize_t)s.cache_hits,
        "cache_misses", (Py_ssize_t)s.cache_misses,
        "upstream_allocs", (Py_ssize_t)s.upstream_allocs,
        "upstream_frees", (Py_ssize_t)s.upstream_frees,
        "oom_retries", (Py_ssize_t)s.oom_retries);
}

/* bench(nbytes, n, device=0, stream=0) -> median-free mean ns per cached allocate + free,
 * timed in C without the GIL (one warm-up pair first). */
static PyObject* c_bench(PyObject* self, PyObject* args) {
    Py_ssize_t nbytes, n;
    int device = 0, code = GPUPOOL_OK;
    unsigned long long stream = 0;
    struct timespec t0, t1;
    void* ptr;
    if (!PyArg_ParseTuple(args, "nn|iK", &nbytes, &n, &device, &stream))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    code = api->allocate(device, (size_t)nbytes, (uintptr_t)stream, &ptr);
    if (code == GPUPOOL_OK)
        code = api->free(device, ptr, (uintptr_t)stream);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (Py_ssize_t i = 0; i < n && code == GPUPOOL_OK; i++) {
        code = api->allocate(device, (size_t)nbytes, (uintptr_t)stream, &ptr);
        if (code == GPUPOOL_OK)
            code = api->free(device, ptr, (uintptr_t)stream);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    Py_END_ALLOW_THREADS
    if (code != GPUPOOL_OK)
        return raise_code(code);
    double ns = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
    return PyFloat_FromDouble(ns / (double)n);
}

static PyMethodDef methods[] = {
    {"with_scratch", with_scratch, METH_VARARGS, "with_scratch(nbytes, fn, device=0, stream=0)"},
    {"allocate", c_allocate, METH_VARARGS, "allocate(nbytes, device=0, stream=0) -> pointer"},
    {"free", c_free, METH_VARARGS, "free(ptr, device=0, stream=0)"},
    {"stats", c_stats, METH_VARARGS, "stats(device=0) -> dict"},
    {"bench", c_bench, METH_VARARGS, "bench(nbytes, n, device=0, stream=0) -> ns per pair"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpupool_scratch",
                                    "Scratch memory from gpupool's C API.", -1, methods};

PyMODINIT_FUNC PyInit_gpupool_scratch(void) {
    api = gpupool_import();
    if (api == NULL)
        return NULL;
    return PyModule_Create(&module);
}
