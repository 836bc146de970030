"""``bench/real_models.py``'s memory samplers: device memory in use (``cuMemGetInfo``: total -
free, bytes) read now and every period by a thread, the peak kept. :class:`Sampler` reads it
from a Python thread; :class:`NativeSampler` from a native one (``_sampler.c``, built at run time
by ``_cext``), without a Python thread that takes the GIL between a host-bound step's own Python
two thousand times a second. Chosen with ``real_models.py --sampler``; the environment variable
``ENV`` carries the choice to each run's process."""

import os
import threading

import _cext

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = "GPUPOOL_BENCH_SAMPLER"          # "native": each run's process samples natively
CHOICES = ("python", "native")


def _check(result, what):
    err, *values = result
    if int(err):
        raise RuntimeError(f"{what} failed: {err}")
    return values[0] if len(values) == 1 else tuple(values)


class Sampler:
    """Device memory in use (``cuMemGetInfo``: total - free, bytes), sampled every ``period_s``
    seconds by a Python thread and on demand; keeps the peak since the last
    :meth:`take_peak`."""

    def __init__(self, period_s, device=0):
        from cuda.bindings import driver

        self._driver = driver
        _check(driver.cuInit(0), "cuInit")
        dev = _check(driver.cuDeviceGet(device), "cuDeviceGet")
        self._ctx = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        self.peak = 0
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = None

    def used(self):
        """Bytes in use on the device now (the calling thread gets the primary context)."""
        _check(self._driver.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        free, total = _check(self._driver.cuMemGetInfo(), "cuMemGetInfo")
        used = int(total) - int(free)
        self.peak = max(self.peak, used)
        return used

    def sample(self, _phase=None):
        self.used()

    def take_peak(self):
        """The peak since the last call; the next period starts at the current value."""
        peak, self.peak = self.peak, 0
        self.used()
        return max(peak, self.peak)

    def start(self):
        def run():
            while not self._stop.wait(self._period_s):
                self.used()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class NativeSampler:
    """Device memory in use on ``device``, read now (:meth:`used`) and by a native thread
    (:meth:`start`); keeps the peak since the last :meth:`take_peak`. Raises RuntimeError when
    the driver is missing or a read failed (the thread's failure at the next call)."""

    def __init__(self, period_s, device=0):
        self._c = _cext.build("gpupool_bench_sampler", [os.path.join(HERE, "_sampler.c")])
        self._c.open(device)
        self._period_ns = int(period_s * 1e9)

    def used(self):
        return self._c.used()

    def sample(self, _phase=None):
        self._c.used()

    def take_peak(self):
        return self._c.take_peak()

    def start(self):
        self._c.start(self._period_ns)

    def stop(self):
        self._c.stop()
