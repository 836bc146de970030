"""A recorded trace replayed as a longer run: the whole trace, then its steps 1.. again, PASSES
times, in the same pool on the expandable simulated device; per pass, the device synchronizes
(the cold-page moves) and the peak reserved bytes. The recorded runs hold 12-30 steps; the
memory a long run settles at can be above their peak (Note [Excess on checkpointing runs]).
A free of an id not live is skipped and an id still live is not allocated again. At each
repetition's start the last step's tails (its gradients, freed in the step that would follow)
stay live for good, so the replay's own floor (the most bytes live at once, printed) is above
the trace's; compare policies on the same replay, and each with that floor. With ``--plan`` a
planned region (``gpupool.Region(plan=True)``) is entered at each step start, as
``bench/fragmentation.py``'s planned column; its hits and plans are printed per pass. With
``--capi`` every request and free goes through gpupool's C API table (``allocate``, ``free``:
PyTorch's way in), the pool being device 0's default. Run from the repository root::

    PYTHONPATH=$PWD python tools/profile/long_replay.py TRACE PASSES [--plan] [--capi]
        [--steps N]

``--steps N`` replays the trace's first N steps only (its events before step N's start; the
last step's tails stay live), what a run of N steps records: ``real_models.py --steps N``
draws its shapes by the step's index, so these are that run's (``gpt2-varlen 0 --steps 10``:
the pool's 12,884 MiB peak reserved and 12,834 MiB in use at most of its ten steps on the
H100).
"""

import argparse
import ctypes
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import alloc_trace  # noqa: E402
import fragmentation  # noqa: E402

import gpupool  # noqa: E402
import gpupool._capi  # noqa: E402
from gpupool.testing import SimulatedDevice  # noqa: E402

MiB = 1 << 20


class CBlock:
    """A block of the C API's ``allocate`` (device 0, legacy default stream), given back with
    its ``free`` when the last reference goes."""

    __slots__ = ("ptr", "nbytes")
    _allocate = _free = None

    def __init__(self, nbytes):
        if CBlock._allocate is None:
            # The table (include/gpupool.h): version and size (two unsigned ints), then the
            # pointers of allocate and free.
            get = ctypes.pythonapi.PyCapsule_GetPointer
            get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
            table = get(gpupool._capi._C_API, b"gpupool._capi._C_API")
            fns = (ctypes.c_void_p * 2).from_address(table + 8)
            CBlock._allocate = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_size_t,
                                                ctypes.c_size_t,
                                                ctypes.POINTER(ctypes.c_void_p))(fns[0])
            CBlock._free = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                            ctypes.c_size_t)(fns[1])
        ptr = ctypes.c_void_p()
        status = CBlock._allocate(0, nbytes, 0, ctypes.byref(ptr))
        if status:
            raise RuntimeError(f"the C API's allocate({nbytes}) returned {status}")
        self.ptr, self.nbytes = ptr.value, nbytes

    def __del__(self):
        CBlock._free(0, self.ptr, 0)


def long_replay(trace, passes, plan=False, capi=False):
    """Yield (pass, synchronizes in it, peak reserved bytes so far, most bytes live at once so
    far, the planned region's stats() or None) for pass 0 (the whole trace) and each
    repetition of its steps 1.. (1..passes); with ``plan``, a planned region entered at each
    step start (exited at the next one's and at each pass's end); with ``capi``, the requests
    made through the C API (one stream only), the pool made device 0's default."""
    sim = SimulatedDevice(capacity=1 << 40, virtual_memory=True)
    pool = gpupool.Pool(upstream=sim, device=0)
    if capi and trace.num_streams != 1:
        raise ValueError(f"{trace.name}: --capi replays one stream, the trace has "
                         f"{trace.num_streams}")
    if capi:
        gpupool.set_pool(pool, 0)
    allocate = (lambda n, s: CBlock(n)) if capi else pool.allocate
    events = trace.events([None] * trace.num_streams)
    live, floor = {}, [0, 0]          # [bytes live now, most bytes live at once]
    starts = set(trace.meta.get("step_starts", ())) if plan else set()
    region = gpupool.Region(pool=pool, collect=None, plan=True) if starts else None

    def run(lo):
        entered = False
        for t, (op, i, n, s) in enumerate(events[lo:], lo):
            if t in starts:
                if entered:
                    region.__exit__(None, None, None)
                region.__enter__()
                entered = True
            if op:
                if i in live:
                    floor[0] -= live.pop(i).nbytes
            elif i not in live:
                live[i] = allocate(n, s)
                floor[0] += n
                floor[1] = max(floor)
        if entered:
            region.__exit__(None, None, None)

    def syncs():
        return sum(1 for call in sim.calls if call[0] == "synchronize")

    for k in range(passes + 1):
        before = syncs()
        run(0 if k == 0 else trace.meta["step_starts"][1])
        yield (k, syncs() - before, pool.stats().peak_reserved_bytes, floor[1],
               region.stats() if region is not None else None)
    live.clear()


def parser(doc):
    """An argument parser whose help is ``doc`` as written, for a tool taking a trace's name
    (``trace``) and the repetitions after it (``passes``); read with :func:`parse`."""
    return argparse.ArgumentParser(description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def trace_options(p, passes):
    """Add a trace's name (``trace``) and ``--passes`` (default ``passes``) to parser ``p``."""
    p.add_argument("trace", help="a trace's name in bench/data/traces-real")
    p.add_argument("--passes", type=int, default=passes,
                   help="repetitions of steps 1.. after the whole trace")
    return p


def parse(p, argv=None):
    """``p``'s arguments and the recorded trace named by ``trace``, cut to its first
    ``steps`` steps where ``p`` takes ``--steps`` and it is given; an unknown name, negative
    ``passes`` or steps out of the trace's range exits (status 2) naming what is accepted."""
    args = p.parse_args(argv)
    if args.passes < 0:
        p.error(f"passes must be 0 or more, got {args.passes}")
    traces = {t.name: t for t in map(alloc_trace.load, alloc_trace.find(fragmentation.REAL_DIR))}
    if args.trace not in traces:
        p.error(f"no recorded trace {args.trace!r} in {fragmentation.REAL_DIR}: one of "
                + ", ".join(sorted(traces)))
    trace, steps = traces[args.trace], getattr(args, "steps", None)
    if steps is not None:
        try:
            trace = alloc_trace.first_steps(trace, steps)
        except ValueError as e:
            p.error(f"--steps: {e}")
        if steps < 2 and args.passes:
            p.error(f"--steps {steps} leaves no step 1 to repeat: passes must be 0")
    return args, trace


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("trace", help="a trace's name in bench/data/traces-real")
    p.add_argument("passes", type=int, help="repetitions of steps 1.. after the whole trace")
    p.add_argument("--plan", action="store_true",
                   help="a planned region entered at each step start")
    p.add_argument("--capi", action="store_true",
                   help="every request and free through gpupool's C API (as PyTorch's)")
    p.add_argument("--steps", type=int, metavar="N",
                   help="the trace's first N steps only (alloc_trace.first_steps: what a run "
                        "of N steps records), the whole and the repetitions")
    args, trace = parse(p, argv)
    for k, syncs, peak, floor, stats in long_replay(trace, args.passes, args.plan, args.capi):
        planned = "" if stats is None else (
            f"; plan hits {stats.plan_hits:,}, misses {stats.plan_misses:,}, plans"
            f" {stats.plans} ({stats.planning_ms:,.0f} ms), reused {stats.plans_reused}, given"
            f" up {stats.plans_given_up}, at"
            f" request 0 {stats.record_plans} ({stats.record_ms:,.0f} ms)")
        print(f"{trace.name} pass {k}: {syncs} synchronizes, peak reserved {peak / MiB:,.0f} MiB"
              f" ({peak / floor:.3f}x the most bytes live at once, {floor / MiB:,.0f} MiB)"
              + planned)
    return 0


if __name__ == "__main__":
    sys.exit(main())
