"""What the benchmark columns draw on: gpupool (on the GPU or on the simulated device), the
peer frameworks, the CUDA driver through ``cuda.bindings.driver``, and streams.

A script makes one :class:`Context` with :func:`make_context`; each column asks it for what it
needs (``ctx.need("cupy")``, ``ctx.driver()``, ``ctx.streams(4)``) and raises :class:`Skip`,
with the reason, when that is not there, so the column is left out and the run goes on.
:func:`make_columns` makes a script's columns (each a :class:`Column` whose ``make(ctx)``
returns a :class:`Made`), :func:`close_column` records a column's pool counters and cleans up.
"""

import sys
from dataclasses import dataclass, field

import _common


class Skip(Exception):
    """A column that cannot run here; the message says why."""


class DriverError(RuntimeError):
    """A driver call made by a benchmark failed."""


def async_pair(alloc, free, nbytes, stream):
    """One cuMemAllocAsync of nbytes and its cuMemFreeAsync on stream (cuda.bindings' calls,
    passed in so that a timed loop looks them up once); raises DriverError on failure."""
    err, ptr = alloc(nbytes, stream)
    if err:
        raise DriverError(f"cuMemAllocAsync({nbytes}): {err}")
    if free(ptr, stream)[0]:
        raise DriverError("cuMemFreeAsync failed")


@dataclass
class Made:
    """What a column's ``make(ctx)`` returns."""

    loop: object                        # makes the timed loop: see the script's columns
    cleanup: object = None              # run after the measurements
    pool: object = None                 # the gpupool pool it draws from, if any
    before: object = None               # run before each timed batch (untimed)
    notes: object = None                # returns a dict of the column's own counters, read
                                        # after its measurements (into its JSON, as "notes")


@dataclass
class Column:
    """One allocator of a script: its key, its label in the legend, and ``make(ctx)``, which
    returns a :class:`Made` or raises :class:`Skip`."""

    key: str
    label: str
    make: object


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

        # Expandable, as the GPU's default upstream (vmm) is.
        return Context(gpupool, sim=SimulatedDevice(capacity=4 << 30, virtual_memory=True)), None
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


def context_or_skip(script, args, frameworks=("cupy", "torch", "numba_cuda"), simulated=True):
    """:func:`make_context` for a script's parsed ``args`` (``simulated``, ``json``); without
    a GPU, the script's skip (:func:`_common.skip`: a line, a skip record, exit status 0),
    which names ``--simulated`` where the script has a simulated run (``simulated``)."""
    ctx, reason = make_context(args.simulated, frameworks)
    if ctx is None:
        if simulated and not args.simulated:
            reason += f"; python bench/{script}.py --simulated runs its gpupool columns here"
        _common.skip(script, reason, args.json)
    return ctx


def chosen_columns(p, spec, columns):
    """The columns (:class:`Column`) that ``--columns`` (``spec``) names, in the script's
    order; all without ``spec`` (see :func:`_common.column_keys`: an unknown key exits 2)."""
    keys = _common.column_keys(p, spec, [c.key for c in columns])
    return [c for c in columns if c.key in keys]


def make_columns(makers, ctx, skipped):
    """Make every column that can run here; the others are skipped, with their reason.

    Parameters
    ----------
    makers : dict of key -> callable
        ``make(ctx)`` of each column, in the order to make them.
    ctx : Context
        What the columns draw on.
    skipped : dict
        Gets ``key -> reason`` for each column whose ``make`` raised :class:`Skip` (the
        reason is also printed to stderr, as progress).

    Returns
    -------
    dict of key -> what ``make`` returned
        The columns that can run, in ``makers``' order. Exceptions other than Skip propagate.
    """
    made = {}
    for key, make in makers.items():
        try:
            made[key] = make(ctx)
        except Skip as exc:
            skipped[key] = str(exc)
            print(f"  {key}: skipped ({exc})", file=sys.stderr)
    return made


def close_column(made, entry):
    """After a column's measurements: its pool's counters into ``entry`` (``made.pool``, if
    any; see :func:`_common.pool_counters`) and its own (``made.notes()``, if any), then its
    ``made.cleanup()``, if any."""
    if made.pool is not None:
        entry["pool_counters"] = _common.pool_counters(made.pool)
    if made.notes is not None:
        entry["notes"] = made.notes()
    if made.cleanup is not None:
        made.cleanup()
