/* Device memory in use (cuMemGetInfo: total - free, bytes) read by a native thread every
 * period, its peak kept: bench/real_models.py's ruler where a Python sampler thread would take
 * the GIL between the step's own Python (bench/_native_sampler.py wraps it). The driver is
 * reached by dlopen, so no CUDA toolkit is needed to build it; every driver result is checked
 * (a failed read in the thread is kept and raised by the next call from Python). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <pthread.h>
#include <time.h>

typedef int (*init_fn)(unsigned int);
typedef int (*device_get_fn)(int*, int);
typedef int (*ctx_retain_fn)(void**, int);
typedef int (*ctx_set_fn)(void*);
typedef int (*mem_info_fn)(size_t*, size_t*);

static ctx_set_fn ctx_set;
static mem_info_fn mem_info;
static void* ctx;
static pthread_t thread;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int running, thread_error;
static unsigned long long peak;
static struct timespec period;

/* Reads the bytes in use into *used and raises the peak; the driver's error, or 0. */
static int read_used(unsigned long long* used) {
    size_t free_bytes = 0, total = 0;
    int err = ctx_set(ctx);
    if (err == 0)
        err = mem_info(&free_bytes, &total);
    pthread_mutex_lock(&lock);
    if (err == 0) {
        *used = (unsigned long long)(total - free_bytes);
        if (*used > peak)
            peak = *used;
    } else if (thread_error == 0) {
        thread_error = err;
    }
    pthread_mutex_unlock(&lock);
    return err;
}

static void* run(void* unused) {
    unsigned long long used;
    (void)unused;
    while (__atomic_load_n(&running, __ATOMIC_ACQUIRE)) {
        read_used(&used);
        nanosleep(&period, NULL);
    }
    return NULL;
}

static PyObject* driver_error(const char* what, int err) {
    return PyErr_Format(PyExc_RuntimeError, "%s failed: CUresult %d", what, err);
}

/* open(device): loads the driver and retains the device's primary context. */
static PyObject* sampler_open(PyObject* self, PyObject* args) {
    int device, handle, err;
    void* lib;
    init_fn init;
    device_get_fn device_get;
    ctx_retain_fn retain;
    if (!PyArg_ParseTuple(args, "i", &device))
        return NULL;
    if (ctx != NULL)
        Py_RETURN_NONE;
    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL)
        return PyErr_Format(PyExc_RuntimeError, "no CUDA driver: %s", dlerror());
    init = (init_fn)dlsym(lib, "cuInit");
    device_get = (device_get_fn)dlsym(lib, "cuDeviceGet");
    retain = (ctx_retain_fn)dlsym(lib, "cuDevicePrimaryCtxRetain");
    ctx_set = (ctx_set_fn)dlsym(lib, "cuCtxSetCurrent");
    mem_info = (mem_info_fn)dlsym(lib, "cuMemGetInfo_v2");
    if (!init || !device_get || !retain || !ctx_set || !mem_info)
        return PyErr_Format(PyExc_RuntimeError, "the CUDA driver lacks a function: %s",
                            dlerror());
    if ((err = init(0)) != 0)
        return driver_error("cuInit", err);
    if ((err = device_get(&handle, device)) != 0)
        return driver_error("cuDeviceGet", err);
    if ((err = retain(&ctx, handle)) != 0) {
        ctx = NULL;
        return driver_error("cuDevicePrimaryCtxRetain", err);
    }
    Py_RETURN_NONE;
}

static int check_open(void) {
    if (ctx == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "open(device) first");
        return -1;
    }
    if (thread_error != 0) {
        driver_error("cuMemGetInfo in the sampler thread", thread_error);
        return -1;
    }
    return 0;
}

/* used(): the bytes in use now (the peak raised by them). */
static PyObject* sampler_used(PyObject* self, PyObject* unused) {
    unsigned long long used = 0;
    int err;
    if (check_open() < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    err = read_used(&used);
    Py_END_ALLOW_THREADS
    if (err != 0)
        return driver_error("cuMemGetInfo", err);
    return PyLong_FromUnsignedLongLong(used);
}

/* take_peak(): the peak since the last call; the next period starts at the bytes in use now. */
static PyObject* sampler_take_peak(PyObject* self, PyObject* unused) {
    unsigned long long was, used = 0;
    int err;
    if (check_open() < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&lock);
    was = peak;
    peak = 0;
    pthread_mutex_unlock(&lock);
    err = read_used(&used);
    Py_END_ALLOW_THREADS
    if (err != 0)
        return driver_error("cuMemGetInfo", err);
    return PyLong_FromUnsignedLongLong(was > used ? was : used);
}

/* start(period_ns): the thread reads every period_ns nanoseconds. */
static PyObject* sampler_start(PyObject* self, PyObject* args) {
    long long ns;
    if (!PyArg_ParseTuple(args, "L", &ns))
        return NULL;
    if (ns <= 0)
        return PyErr_Format(PyExc_ValueError, "period_ns must be > 0, got %lld", ns);
    if (check_open() < 0)
        return NULL;
    if (running)
        return PyErr_Format(PyExc_RuntimeError, "already started");
    period.tv_sec = (time_t)(ns / 1000000000LL);
    period.tv_nsec = (long)(ns % 1000000000LL);
    __atomic_store_n(&running, 1, __ATOMIC_RELEASE);
    if (pthread_create(&thread, NULL, run, NULL) != 0) {
        running = 0;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/* stop(): the thread ends (joined); a read that failed in it is raised. */
static PyObject* sampler_stop(PyObject* self, PyObject* unused) {
    if (running) {
        __atomic_store_n(&running, 0, __ATOMIC_RELEASE);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(thread, NULL);
        Py_END_ALLOW_THREADS
    }
    if (thread_error != 0)
        return driver_error("cuMemGetInfo in the sampler thread", thread_error);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"open", sampler_open, METH_VARARGS, "open(device): load the driver, retain the context"},
    {"used", sampler_used, METH_NOARGS, "used(): bytes in use on the device now"},
    {"take_peak", sampler_take_peak, METH_NOARGS, "take_peak(): the peak since the last call"},
    {"start", sampler_start, METH_VARARGS, "start(period_ns): read every period_ns"},
    {"stop", sampler_stop, METH_NOARGS, "stop(): end and join the reading thread"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpupool_bench_sampler", NULL, -1,
                                    methods};

PyMODINIT_FUNC PyInit_gpupool_bench_sampler(void) { return PyModule_Create(&module); }
