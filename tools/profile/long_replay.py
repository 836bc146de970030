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
        [--steps N] [--per-step]

``--steps N`` replays the trace's first N steps only (its events before step N's start; the
last step's tails stay live), what a run of N steps records: ``real_models.py --steps N``
draws its shapes by the step's index, so these are that run's (``gpt2-varlen 0 --steps 10``:
the pool's 12,884 MiB peak reserved and 12,834 MiB in use at most of its ten steps on the
H100).

``--per-step`` prints a line at each step's end: its requests, the bytes they asked (and
request 0), the most
bytes live during it, the pool's reserved and peak reserved bytes, the planned region's
counters that changed in it (plans, hits, misses, record plans, ...) and the upstream's calls
(maps, synchronizes): where a peak is reached and by what.
"""

import argparse
import ctypes
import os
import sys
from collections import Counter
from typing import NamedTuple

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


class StepRow(NamedTuple):
    """One step of a replay (``long_replay``'s ``on_step``): the pass, the step's number in
    the trace (1: the first of ``meta["step_starts"]``), its requests, requested bytes and
    request 0's requested bytes (0: none), the most bytes live during it, the pool's reserved and peak reserved bytes at its end,
    the planned region's stats() (None without ``plan``) and the upstream's calls during the
    step by name."""

    passed: int
    step: int
    requests: int
    asked: int
    first: int
    live_peak: int
    reserved: int
    peak_reserved: int
    stats: object
    calls: Counter


def long_replay(trace, passes, plan=False, capi=False, on_step=None):
    """Yield (pass, synchronizes in it, peak reserved bytes so far, most bytes live at once so
    far, the planned region's stats() or None) for pass 0 (the whole trace) and each
    repetition of its steps 1.. (1..passes); with ``plan``, a planned region entered at each
    step start (exited at the next one's and at each pass's end); with ``capi``, the requests
    made through the C API (one stream only), the pool made device 0's default; with
    ``on_step``, a callable given a :class:`StepRow` at each step's end (after the region's
    exit)."""
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
    steps = list(trace.meta.get("step_starts", ())) if plan or on_step else []
    starts = {t: k for k, t in enumerate(steps, 1)}
    region = gpupool.Region(pool=pool, collect=None, plan=True) if plan and steps else None

    def run(lo, passed):
        step = None         # [number, requests, bytes, request 0's, live peak, calls before]

        def ended():
            if region is not None:
                region.__exit__(None, None, None)
            if on_step is not None:
                stats = pool.stats()
                on_step(StepRow(passed, *step[:5], stats.reserved_bytes,
                                stats.peak_reserved_bytes,
                                region.stats() if region is not None else None,
                                Counter(call[0] for call in sim.calls[step[5]:])))

        for t, (op, i, n, s) in enumerate(events[lo:], lo):
            if t in starts:
                if step is not None:
                    ended()
                if region is not None:
                    region.__enter__()
                step = [starts[t], 0, 0, 0, floor[0], len(sim.calls)]
            if op:
                if i in live:
                    floor[0] -= live.pop(i).nbytes
            elif i not in live:
                live[i] = allocate(n, s)
                floor[0] += n
                floor[1] = max(floor)
                if step is not None:
                    step[3] = step[3] if step[1] else n
                    step[1], step[2], step[4] = step[1] + 1, step[2] + n, max(step[4], floor[0])
        if step is not None:
            ended()

    def syncs():
        return sum(1 for call in sim.calls if call[0] == "synchronize")

    for k in range(passes + 1):
        before = syncs()
        run(0 if k == 0 else trace.meta["step_starts"][1], k)
        yield (k, syncs() - before, pool.stats().peak_reserved_bytes, floor[1],
               region.stats() if region is not None else None)
    live.clear()


# The planned region's counters printed per step (--per-step), as their change in the step.
STEP_COUNTERS = ("plans", "plan_hits", "plan_misses", "record_plans", "plans_reused",
                 "plans_repaired", "plans_not_fitting", "plans_given_up", "plans_past_work",
                 "plans_past_requests")


def step_printer(name):
    """An ``on_step`` that prints each step of trace ``name``: its requests, requested
    bytes (MiB; request 0's in bytes), live peak, reserved and peak reserved (MiB), the planned region's counters that
    changed in it and the upstream's calls."""
    last = {}

    def show(row):
        line = (f"{name} pass {row.passed} step {row.step:2d}: {row.requests:5,} requests,"
                f" asked {row.asked / MiB:9,.0f} MiB (request 0 {row.first:,} B), live peak {row.live_peak / MiB:7,.0f},"
                f" reserved {row.reserved / MiB:7,.0f}, peak {row.peak_reserved / MiB:7,.0f}")
        if row.stats is not None:
            now = {key: getattr(row.stats, key) for key in STEP_COUNTERS}
            line += "".join(f"; {key} +{now[key] - last.get(key, 0):,}" for key in STEP_COUNTERS
                            if now[key] != last.get(key, 0))
            last.update(now)
        if row.calls:
            line += "; upstream " + ", ".join(f"{call} {n}" for call, n in
                                              sorted(row.calls.items()))
        print(line)

    return show


def parser(doc):
    """An argument parser whose help is ``doc`` as written (its reST literals' backquotes
    and ``::`` left out), for a tool taking a trace's name (``trace``) and the repetitions
    after it (``passes``); read with :func:`parse`."""
    return argparse.ArgumentParser(description=doc.replace("``", "").replace("::\n", ":\n"),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def run(main):
    """``sys.exit(main())``, quiet when the reader of stdout goes away (``| head``)."""
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at nothing first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 1
    sys.exit(status)


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
    p.add_argument("--per-step", action="store_true",
                   help="a line per step: requests, bytes asked (request 0's), live peak, reserved, the "
                        "planned region's counters that changed and the upstream's calls")
    args, trace = parse(p, argv)
    on_step = step_printer(trace.name) if args.per_step else None
    for k, syncs, peak, floor, stats in long_replay(trace, args.passes, args.plan, args.capi,
                                                    on_step):
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
    run(main)
