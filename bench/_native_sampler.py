"""``bench/real_models.py``'s memory sampler read by a native thread (``_sampler.c``, built at
run time by ``_cext``): the same readings as ``real_models.Sampler`` (``cuMemGetInfo``: total -
free, bytes, every ``SAMPLE_S``), without a Python thread that takes the GIL between a
host-bound step's own Python two thousand times a second. Chosen with ``real_models.py
--sampler native``; the environment variable ``ENV`` carries the choice to each run's process."""

import os

import _cext

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = "GPUPOOL_BENCH_SAMPLER"          # "native": each run's process samples natively
CHOICES = ("python", "native")


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
