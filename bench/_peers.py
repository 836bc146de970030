"""What the benchmark columns draw on: gpupool (on the GPU or on the simulated device), the
peer frameworks, the CUDA driver through ``cuda.bindings.driver``, and streams.

A script makes one :class:`Context` with :func:`make_context`; each column asks it for what it
needs (``ctx.need("cupy")``, ``ctx.driver()``, ``ctx.streams(4)``) and raises :class:`Skip`,
with the reason, when that is not there, so the column is left out and the run goes on.
"""

from dataclasses import dataclass, field

import _common


class Skip(Exception):
    """A column that cannot run here; the message says why."""


class DriverError(RuntimeError):
    """A driver call made by a benchmark failed."""


def check(result, what):
    """The value of a ``cuda.bindings.driver`` call's ``(err, value...)`` tuple.

    Parameters
    ----------
    result : tuple
        What the call returned: ``(err,)`` or ``(err, value)``.
    what : str
        The call, for the message.

    Returns
    -------
    The value, or None for a call that returns only its error code.

    Raises
    ------
    DriverError
        ``err`` is not ``CUDA_SUCCESS``.
    """
    if result[0]:
        raise DriverError(f"{what}: {result[0]}")
    return result[1] if len(result) > 1 else None


@dataclass
class Context:
    """gpupool, a simulated device or not, and the frameworks a script imported."""

    gpupool: object
    sim: object = None                  # a SimulatedDevice in a --simulated run
    cupy: object = None
    torch: object = None
    numba_cuda: object = None
    reasons: dict = field(default_factory=dict)
    _driver: object = None
    _primary: object = None             # device 0's primary context (CUcontext)
    _streams: list = field(default_factory=list)

    @property
    def simulated(self):
        return self.sim is not None

    def new_pool(self):
        """A fresh gpupool pool (each column has its own, so its counters are its own)."""
        if self.simulated:
            return self.gpupool.Pool(upstream=self.sim)
        return self.gpupool.Pool(device=0)

    def need(self, name):
        """The module ``name`` (``cupy``, ``torch``, ``numba_cuda``), or raise Skip."""
        if self.simulated:
            raise Skip("simulated run: gpupool columns only")
        module = getattr(self, name)
        if module is None:
            raise Skip(self.reasons.get(name, f"{name} unavailable"))
        return module

    def driver(self):
        """``cuda.bindings.driver``, with device 0's primary context current on this thread.

        Call it again on every thread that makes driver calls (the driver's current context
        is per thread). Raises Skip on a simulated run or when the context cannot be had.
        """
        if self.simulated:
            raise Skip("simulated run: gpupool columns only")
        if self._driver is None:
            from cuda.bindings import driver

            (err,) = driver.cuInit(0)
            if err:
                raise Skip(f"cuInit failed: {err}")
            err, dev = driver.cuDeviceGet(0)
            err2, primary = driver.cuDevicePrimaryCtxRetain(dev)
            if err or err2:
                raise Skip("could not retain device 0's primary context")
            self._driver, self._primary = driver, primary
        if self._driver.cuCtxSetCurrent(self._primary)[0]:
            raise Skip("could not make device 0's primary context current")
        return self._driver

    def streams(self, count):
        """``count`` stream handles (ints), made once and shared by every column.

        On the GPU: non-blocking streams of device 0's primary context
        (``cuStreamCreate(CU_STREAM_NON_BLOCKING)``), so CuPy, PyTorch (as external streams)
        and the driver see the same streams gpupool does; on the simulated device:
        ``sim.create_stream()``. They live as long as the process.
        """
        while len(self._streams) < count:
            if self.simulated:
                self._streams.append(self.sim.create_stream())
            else:
                driver = self.driver()
                flags = driver.CUstream_flags.CU_STREAM_NON_BLOCKING
                stream = check(driver.cuStreamCreate(flags), "cuStreamCreate")
                self._streams.append(int(stream))
        return self._streams[:count]


def make_context(simulated, frameworks=("cupy", "torch", "numba_cuda")):
    """``(Context, None)`` for a GPU or simulated run, or ``(None, reason)`` without a GPU.

    Parameters
    ----------
    simulated : bool
        Run gpupool on ``gpupool.testing.SimulatedDevice`` (4 GiB); no framework is imported.
    frameworks : tuple of str
        The frameworks to import (``cupy``, ``torch``, ``numba_cuda``); one that fails to
        import is None in the context and ``reasons`` says why.
    """
    import gpupool

    if simulated:
        from gpupool.testing import SimulatedDevice

        return Context(gpupool, sim=SimulatedDevice(capacity=4 << 30)), None
    _, reason = _common.gpu_pool()
    if reason is not None:
        return None, reason
    ctx = Context(gpupool)
    modules = {"cupy": "cupy", "torch": "torch", "numba_cuda": "numba.cuda"}
    for name in frameworks:
        module, ctx.reasons[name] = _common.optional_import(modules[name])
        setattr(ctx, name, module)
    if ctx.cupy is not None:
        ctx.cupy.cuda.Device(0).use()
    return ctx, None
