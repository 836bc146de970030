"""What a request and a free cost through gpupool's C API inside a region, beside the pool
alone, with the allocator's structures in the caches and pushed out of them.

A recorded trace's first ``--steps`` steps are replayed from C (``bench/_capi_loop.c``'s
``replay``: ``api->allocate`` and ``api->free``, device 0, the legacy default stream, no
GIL and no Python between two events), step by step, in three ways, each in a fresh pool on
the expandable simulated device made device 0's default (as
``tools/profile/long_replay.py --capi``): the pool alone (``pool``); a
``Region(scope="process")`` entered at each step start and exited at the next, from Python
between two steps' C replays (``region``); the same with ``plan=True`` (``planned``). Each C
API call is timed on its own with ``CLOCK_MONOTONIC``; what two readings back to back take
is subtracted. Before each event of the timed steps (``--from-step`` on) every 64th byte of
a host buffer of ``--pollute`` bytes is read and written, untimed, so that the allocator's
tables, blocks and magazines fall out of L1 and L2 as a process's host work between two
requests pushes them out (0: the caches stay hot, as a loop of requests keeps them).

Printed: ns per allocate (each step's request 0 apart, in us a step: a planned region's
record plans are made in it) and per free, the median over ``--repeats`` repetitions (the
ways and pollution sizes interleaved within each, each way first in turn), per way and
pollution size, and each way's peak reserved bytes beside the same steps' peak in
``long_replay.py --capi`` (pool, planned) and ``bench/fragmentation.py``'s replay with a
region (region): the same workload. A CPU measurement: the simulated device's bookkeeping,
not a GPU's driver. Run from the repository root::

    PYTHONPATH=$PWD python tools/profile/capi_cold.py TRACE [--steps N] [--pollute BYTES ...]
        [--repeats R] [--from-step S]

BYTES is an int, or one with a ``KiB`` or ``MiB`` suffix (``1MiB``).
"""

import os
import re
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _cext  # noqa: E402
import alloc_trace  # noqa: E402
import fragmentation  # noqa: E402
import long_replay  # noqa: E402

import gpupool  # noqa: E402
from gpupool.testing import SimulatedDevice  # noqa: E402

MiB = 1 << 20
WAYS = ("pool", "region", "planned")
UNITS = {"": 1, "kib": 1 << 10, "mib": MiB}


class Replay(NamedTuple):
    """One replay (:func:`replay`): the timed steps' C API calls (allocates but each step's
    request 0, frees, and the ns each kind took in all, the clock's own ns not subtracted),
    the clock's own ns (two readings back to back, once per call), the steps' request 0s
    and their ns (a planned region's record plans are made in theirs), the pool's peak
    reserved bytes, the region's stats() (None for the pool alone), the pool's stats() after
    the last free and its magazines then (1: the replaying thread's; 0 would mean the pool
    alone took the shared path), the simulated device's calls during the timed steps' C
    calls (maps: Python's, with the GIL, timed as the call's) and the median ns of an
    allocate (request 0s apart) and of a free."""

    allocates: int
    frees: int
    allocate_ns: int
    free_ns: int
    clock_ns: int
    firsts: int
    first_ns: int
    peak_reserved: int
    stats: object
    pool_stats: object
    magazines: int
    upstream_calls: int
    allocate_median: float
    free_median: float


def helper():
    """``bench/_capi_loop.c`` built and imported (``bench/_cext.py``).

    Raises
    ------
    RuntimeError
        It did not build (no C compiler).
    """
    return _cext.build("gpupool_bench_loop", [os.path.join(ROOT, "bench", "_capi_loop.c")])


def step_bounds(trace):
    """The events' bounds ``[0, s1, ..., len]``: the events before the first step start,
    then each step's (``meta["step_starts"]``)."""
    return [0, *trace.meta["step_starts"], len(trace)]


def replay(c, trace, way, pollute=0, from_step=4):
    """Replay ``trace`` through the C API of ``c`` (:func:`helper`) on a fresh thread (a
    thread keeps magazines for 8 pools at most: a later pool would take the shared path) in
    a fresh pool made device 0's default, in ``way`` (one of :data:`WAYS`), a region entered
    at each step
    start and exited at the next (and after the last step); before each event of steps
    ``from_step`` on, ``pollute`` bytes of a host buffer are walked. The blocks still live
    at the end (the trace's) are freed through the C API, untimed. Returns a
    :class:`Replay`; device 0's pool is not restored.

    Raises
    ------
    ValueError
        ``way`` is not one of :data:`WAYS`, or ``trace`` has more than one stream (the C
        replay uses the legacy one).
    """
    if way not in WAYS:
        raise ValueError(f"way must be one of {WAYS}, got {way!r}")
    if trace.num_streams != 1:
        raise ValueError(f"{trace.name}: the C replay uses one stream, the trace has "
                         f"{trace.num_streams}")
    return on_fresh_thread(_replay, c, trace, way, pollute, from_step)


def on_fresh_thread(fn, *args):
    """``fn(*args)`` on a thread made for it: its pools get the thread's magazines, whatever
    pools the calling thread's table holds (8 at most), and leave no slot taken there."""
    with ThreadPoolExecutor(1) as thread:
        return thread.submit(fn, *args).result()


def _replay(c, trace, way, pollute, from_step):
    """:func:`replay` on the calling thread."""
    sim = SimulatedDevice(capacity=1 << 40, virtual_memory=True)
    pool = gpupool.Pool(upstream=sim, device=0)
    gpupool.set_pool(pool, 0)
    region = None if way == "pool" else gpupool.Region(
        pool=pool, collect=None, scope="process", plan=way == "planned")
    op, ids = trace.op.astype(np.int64), trace.ids
    nbytes = np.ascontiguousarray(trace.nbytes, dtype=np.int64)
    ptrs = np.zeros(int(ids.max(initial=-1)) + 1, dtype=np.int64)
    dirt = bytearray(pollute) if pollute else None
    times = np.empty(len(trace), dtype=np.int64)
    sums = np.zeros(7, dtype=np.int64)      # as the fields of Replay from allocates to first_ns
    kept, upstream = [[], []], 0            # the timed calls' ns: allocates, frees
    bounds = step_bounds(trace)
    for step, (lo, hi) in enumerate(zip(bounds, bounds[1:])):   # step 0: before step 1
        if region is not None and step:
            region.__enter__()
        timed = step >= from_step
        calls = len(sim.calls)
        alloc_ns, free_ns, allocs, frees, clock_ns = c.replay(
            op[lo:hi], ids[lo:hi], nbytes[lo:hi], ptrs, dirt if timed else None, times[lo:hi])
        calls = len(sim.calls) - calls      # during the C calls, not the region's exit
        if region is not None and step:
            region.__exit__(None, None, None)
        if timed:
            upstream += calls
            called = times[lo:hi][(op[lo:hi] == 0) & (times[lo:hi] >= 0)]
            kept[0].append(called[1:])
            kept[1].append(times[lo:hi][(op[lo:hi] == 1) & (times[lo:hi] >= 0)])
            first, firsts = int(called[:1].sum()), min(len(called), 1)
            sums += (allocs - firsts, frees, alloc_ns - first, free_ns, clock_ns, firsts, first)
    live = np.flatnonzero(ptrs)
    c.replay(np.ones(len(live), dtype=np.int64), live, np.ones(len(live), dtype=np.int64),
             ptrs)
    stats = pool.stats()
    return Replay(*map(int, sums), stats.peak_reserved_bytes,
                  region.stats() if region is not None else None, stats,
                  len(pool._magazines_info()), upstream,
                  *(float(np.median(np.concatenate(k))) if k else 0.0 for k in kept))


def reference_peaks(trace):
    """Each way's peak reserved bytes on the same steps from the replays it is checked
    against: ``long_replay.long_replay`` through the C API (pool, planned) and
    ``fragmentation.peak_reserved`` with a region entered at each step (region), on a fresh
    thread (:func:`on_fresh_thread`)."""
    return on_fresh_thread(_reference_peaks, trace)


def _reference_peaks(trace):
    """:func:`reference_peaks` on the calling thread."""
    peaks = {}
    for way, plan in (("pool", False), ("planned", True)):
        (_, _, peaks[way], _, _), = long_replay.long_replay(trace, 0, plan=plan, capi=True)
    peaks["region"] = fragmentation.peak_reserved(gpupool, trace, "vmm", region=True)
    return peaks


def byte_count(text):
    """Bytes of ``text``: an int, or one with a KiB or MiB suffix; ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-z]*)\s*", text, re.IGNORECASE)
    if m is None or m.group(2).lower() not in UNITS:
        raise ValueError(f"not a byte count (an int, or with KiB or MiB): {text!r}")
    return int(m.group(1)) * UNITS[m.group(2).lower()]


def options(argv=None):
    """The parsed arguments and the trace cut to its first ``--steps`` steps; bad ones exit
    (status 2) saying what is accepted."""
    p = long_replay.parser(__doc__)
    p.add_argument("trace", help="a trace's name in bench/data/traces-real")
    p.add_argument("--steps", type=int, default=12, metavar="N",
                   help="the trace's first N steps (alloc_trace.first_steps; default 12)")
    p.add_argument("--pollute", nargs="+", default=["0", "1MiB", "8MiB"], metavar="BYTES",
                   help="host bytes walked before each timed event (default 0 1MiB 8MiB)")
    p.add_argument("--repeats", type=int, default=3, metavar="R",
                   help="replays per way and pollution size, interleaved (default 3)")
    p.add_argument("--from-step", type=int, metavar="S",
                   help="the first step timed (1: the trace's first; default 4, or the last "
                        "step when --steps is below 4)")
    p.set_defaults(passes=0)
    args, trace = long_replay.parse(p, argv)
    try:
        args.pollute = [byte_count(text) for text in args.pollute]
    except ValueError as e:
        p.error(f"--pollute: {e}")
    if len(set(args.pollute)) < len(args.pollute):
        p.error(f"--pollute names each size once, got {args.pollute}")
    if args.from_step is None:
        args.from_step = min(4, args.steps)
    if args.repeats < 1:
        p.error(f"--repeats must be 1 or more, got {args.repeats}")
    if not 1 <= args.from_step <= args.steps:
        p.error(f"--from-step must be from 1 to --steps ({args.steps}), got {args.from_step}")
    if trace.num_streams != 1:
        p.error(f"{trace.name} uses {trace.num_streams} streams; the C replay uses one")
    return args, trace


def main(argv=None):
    args, trace = options(argv)
    c = helper()
    runs = {(way, dirt): [] for dirt in args.pollute for way in WAYS}
    for k in range(args.repeats):
        for dirt in args.pollute:
            for way in WAYS[k % 3:] + WAYS[:k % 3]:        # each way first in turn
                runs[way, dirt].append(replay(c, trace, way, dirt, args.from_step))
    first = runs[WAYS[0], args.pollute[0]][0]
    print(f"{trace.name}, steps {args.from_step}-{args.steps} of {args.steps}: "
          f"{first.allocates:,} allocates (request 0s apart) and {first.frees:,} frees "
          f"through the C API a replay; ns a call less the clock's own (median of "
          f"{args.repeats} replays); request 0: us a step; the median call's ns (clock's "
          f"own in); the simulated device's calls in the timed C calls")
    print(f"{'pollute':>9} {'way':<8} {'allocate':>9} {'free':>9} {'both':>9} "
          f"{'x pool':>7} {'clock':>6} {'request 0':>10} {'med alloc':>9} {'med free':>9} "
          f"{'upstream':>8}")
    for dirt in args.pollute:
        base = None
        for way in WAYS:
            rows = runs[way, dirt]
            clock = statistics.median(r.clock_ns / (r.allocates + r.frees) for r in rows)
            alloc = statistics.median(r.allocate_ns / r.allocates for r in rows) - clock
            free = statistics.median(r.free_ns / r.frees for r in rows) - clock
            both = statistics.median((r.allocate_ns + r.free_ns) / (r.allocates + r.frees)
                                     for r in rows) - clock
            first_us = statistics.median(r.first_ns / r.firsts for r in rows) / 1000
            base = both if base is None else base
            print(f"{dirt // 1024:>6,}KiB {way:<8} {alloc:9,.0f} {free:9,.0f} {both:9,.0f} "
                  f"{both / base:7.3f} {clock:6,.0f} {first_us:10,.1f} "
                  f"{statistics.median(r.allocate_median for r in rows):9,.0f} "
                  f"{statistics.median(r.free_median for r in rows):9,.0f} "
                  f"{statistics.median(r.upstream_calls for r in rows):8,.0f}")
    expected = reference_peaks(trace)
    for way in WAYS:
        peaks = [f"{r.peak_reserved / MiB:,.0f}" for dirt in args.pollute
                 for r in runs[way, dirt]]
        differ = sum(r.peak_reserved != expected[way] for dirt in args.pollute
                     for r in runs[way, dirt])
        print(f"{way:<8} peak reserved MiB by pollution and replay {' '.join(peaks)}; the "
              f"reference replay's {expected[way] / MiB:,.0f}: "
              + (f"{differ} replays DIFFERENT" if differ else "all the same"))
    for way in WAYS:
        magazines = sorted({r.magazines for dirt in args.pollute for r in runs[way, dirt]})
        print(f"{way:<8} magazines of the pool after a replay: {magazines} (1: the thread's)")
    stats = runs["planned", args.pollute[0]][-1].stats
    print(f"planned: {stats.plan_hits:,} hits, {stats.plan_misses:,} misses, {stats.plans} "
          f"plans, {stats.record_plans} record plans a replay")
    return 0


if __name__ == "__main__":
    long_replay.run(main)
