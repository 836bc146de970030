"""Failure injection for the simulated device (``SimulatedDevice(failures=...)``,
``sim.inject``): which simulated driver calls fail, when, and with what error."""

import random

from cuda.bindings.driver import CUresult

from gpupool.errors import CudaError

CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_INVALID_HANDLE = 400
CUDA_ERROR_UNKNOWN = 999

# The memory source's calls, whose failure the driver reports as out of memory (the pool's
# out-of-memory ladder runs); "create" and "set_access" are steps of "map" (cuMemCreate,
# cuMemSetAccess), which fail on their own.
OUT_OF_MEMORY_CALLS = frozenset({"alloc", "reserve", "create", "map"})
CALLS = OUT_OF_MEMORY_CALLS | frozenset({
    "set_access", "free", "unmap", "unreserve", "trim", "mem_info",
    "event_create", "event_destroy", "event_record", "event_query", "stream_wait_event",
    "synchronize", "stream_capturing", "stream_id", "copy", "memset", "host_alloc", "host_free",
    "ipc_export", "ipc_open", "ipc_close", "ipc_event_create", "ipc_event_record",
    "ipc_event_destroy", "ipc_wait",
})


class Failures:
    """Which simulated driver calls fail: the n-th call of the named kinds (and the ``times``
    - 1 after it), or each one at a rate drawn from a seeded generator.

    ``Failures("alloc", nth=3)`` fails the third ``alloc``; ``Failures(("free", "unmap"),
    rate=0.1, seed=7)`` fails a tenth of the frees and unmaps, the same ones on every run.

    Parameters
    ----------
    calls : str or iterable of str
        The kinds of call that may fail, by their names in ``SimulatedDevice.calls``
        (``Failures.CALLS`` lists them all), and ``"stream_id"`` (``cuStreamGetId``, not
        logged), ``"create"`` and ``"set_access"`` (the ``cuMemCreate`` and
        ``cuMemSetAccess`` steps of ``map``, counted once a map).
    nth : int, optional
        Fail the ``nth`` call (1 is the first) of the named kinds, counted together from
        when this object was made.
    times : int or None
        With ``nth``: how many calls fail, from the ``nth`` on (None: every one after it).
    rate : float, optional
        Instead of ``nth``: the chance, in (0, 1], that each call of the named kinds fails.
    seed : int
        Seed of the generator that draws the failures at ``rate``.
    code : int, optional
        The ``CUresult`` the failing calls report. By default the memory source's calls
        (``alloc``, ``reserve``, ``create``, ``map``) fail as out of memory (2,
        CUDA_ERROR_OUT_OF_MEMORY): they raise ``MemoryError``, which the pool sees as the
        driver's out of memory, so its out-of-memory ladder runs; every other call raises
        ``gpupool.CudaError`` with 999 (CUDA_ERROR_UNKNOWN). A ``code`` given applies to
        every named call: 2 raises ``MemoryError``, another ``CudaError`` with that code.

    Attributes
    ----------
    seen : int
        Calls of the named kinds so far.
    injected : list of (str, tuple, str)
        Each failure injected, in order: the name and arguments of the call that failed and
        the message of the exception it raised (``CudaError.message``; unique, it tells
        which failure a caller got). The exceptions themselves are not kept: their
        tracebacks would keep the callers' frames, and the pools in them, alive.

    Raises
    ------
    ValueError
        A name not in ``CALLS``, neither or both of ``nth`` and ``rate``, ``nth`` or ``times``
        below 1, a ``rate`` outside (0, 1], or a ``code`` that is not a CUresult other
        than 0.
    """

    CALLS = CALLS

    def __init__(self, calls, nth=None, *, times=1, rate=None, seed=0, code=None):
        names = frozenset((calls,) if isinstance(calls, str) else calls)
        unknown = sorted(names - CALLS)
        if not names or unknown:
            raise ValueError(f"Failures: unknown call names {unknown} (the names are "
                             f"{', '.join(sorted(CALLS))})")
        if (nth is None) == (rate is None):
            raise ValueError("Failures: give either nth (fail the n-th call) or rate (fail "
                             "at random), not both or neither")
        if nth is not None and not (isinstance(nth, int) and nth >= 1):
            raise ValueError(f"Failures: nth must be an int >= 1 (1 is the first call), "
                             f"got {nth!r}")
        if times is not None and not (isinstance(times, int) and times >= 1):
            raise ValueError(f"Failures: times must be an int >= 1 or None, got {times!r}")
        if rate is not None and not 0 < rate <= 1:
            raise ValueError(f"Failures: rate must be in (0, 1], got {rate!r}")
        if code is not None:
            try:
                if not isinstance(code, int) or code == 0:
                    raise ValueError
                CUresult(code)
            except ValueError:
                raise ValueError(f"Failures: code must be a CUresult other than "
                                 f"CUDA_SUCCESS, got {code!r}") from None
        self.calls = names
        self.nth, self.times, self.rate, self.seed, self.code = nth, times, rate, seed, code
        self._random = random.Random(seed)
        self.seen = 0
        self.injected = []

    def check(self, name, args):
        """Count a call ``name(*args)`` of the simulated device; raise its injected failure
        when this call fails (``MemoryError`` or ``gpupool.CudaError``, as ``code`` says)."""
        if name not in self.calls:
            return
        self.seen += 1
        if self.rate is not None:
            fails = self._random.random() < self.rate
        else:
            fails = self.seen >= self.nth and (self.times is None or
                                               self.seen < self.nth + self.times)
        if not fails:
            return
        code = self.code
        if code is None:
            code = CUDA_ERROR_OUT_OF_MEMORY if name in OUT_OF_MEMORY_CALLS else CUDA_ERROR_UNKNOWN
        what = (f"simulated device: injected failure of {name} (call {self.seen} of "
                f"{'/'.join(sorted(self.calls))})")
        self.injected.append((name, args, what))
        if code == CUDA_ERROR_OUT_OF_MEMORY:
            raise MemoryError(what)
        raise cuda_error(code, what)

    def __repr__(self):
        when = f"nth={self.nth}, times={self.times}" if self.rate is None else \
            f"rate={self.rate}, seed={self.seed}"
        code = "" if self.code is None else f", code={self.code}"
        return (f"Failures({sorted(self.calls)}, {when}{code}: {len(self.injected)} injected "
                f"of {self.seen} calls)")


def cuda_error(code, what):
    """The ``gpupool.CudaError`` of a simulated driver call that returned ``code`` (a
    ``CUresult`` value), as the driver path raises it, ``what`` its message."""
    return CudaError(code, CUresult(code).name, what)
