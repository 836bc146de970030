"""The planner's calls to its compiled greedy core (``gpupool.region.greedy.place``) on the
recorded real traces, replayed: each call's milliseconds with the index of placed requests by
time off and at several sizes, and whether every call gives the same offsets, work and status
with the index as without.

The calls are those of ``bench/fragmentation.py --planner`` on a trace (``every_plan``: one
plan per step, the model of a planned region by envelope and by exact sizes and the runtime
``gpupool.Region(plan=True)``). Each
call is replayed on this thread without a time budget (its work limit kept), one call after
the other; a column's milliseconds are the sum over the trace's calls, the least of
``--repeat`` runs. Run from the repository root (set ``OPENBLAS_NUM_THREADS=1`` so that NumPy
leaves the cores alone)::

    PYTHONPATH=$PWD python tools/profile/greedy_calls.py [TRACE ...] [--buckets 0,16,32]
        [--repeat 3] [--core MODULE]

``--core MODULE`` adds a column for another build of the core (a module importable by name
with the same ``place``, such as an older commit's ``greedy.pyx`` built on its own), replayed
on the same calls. Note [Compiled greedy placement] in docs/design.md has the results.
"""

import argparse
import importlib
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import alloc_trace  # noqa: E402
import fragmentation  # noqa: E402

import gpupool  # noqa: E402
from gpupool.region import greedy  # noqa: E402


def record(trace):
    """The calls the planner makes to ``greedy.place`` on ``trace``: a list of (positional
    arguments, work limit)."""
    calls, place = [], greedy.place

    def recording(*args, **kwargs):
        names = ("work_limit", "budget_ns", "buckets")
        extra = dict(zip(names, args[10:], strict=False)) | kwargs
        calls.append((args[:10], int(extra.get("work_limit", 0))))
        return place(*args, **kwargs)

    greedy.place = recording
    try:
        fragmentation.every_plan(gpupool, trace)
    finally:
        greedy.place = place
    return calls


def replay(calls, place, buckets):
    """Seconds over ``calls`` with ``place`` (``buckets=None``: the core's own choice, or
    another core's ``place`` that takes no ``buckets``), and their results."""
    results, took = [], 0.0
    for args, limit in calls:
        kwargs = {} if buckets is None else {"buckets": buckets}
        start = time.perf_counter()
        out = place(*args, limit, -1, **kwargs)
        took += time.perf_counter() - start
        results.append(out)
    return took, results


def same(a, b):
    """Whether two lists of place's results agree: offsets, work and status."""
    return all(x[0].tolist() == y[0].tolist() and x[1:] == y[1:] for x, y in zip(a, b,
                                                                               strict=True))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="*", help="recorded real traces (default: all)")
    p.add_argument("--buckets", default="0,16,32", help="index sizes to replay, by commas")
    p.add_argument("--repeat", type=int, default=3, help="runs of each column (least kept)")
    p.add_argument("--core", help="another build of the core, a module name")
    args = p.parse_args(argv)
    try:
        sizes = [int(b) for b in args.buckets.split(",")]
    except ValueError:
        p.error(f"--buckets takes integers by commas, got {args.buckets!r}")
    if min(sizes) < 0:
        p.error(f"--buckets must be 0 or more, got {args.buckets!r}")
    if args.repeat < 1:
        p.error(f"--repeat must be 1 or more, got {args.repeat}")
    try:
        other = importlib.import_module(args.core) if args.core else None
    except ImportError as exc:
        p.error(f"--core {args.core!r} cannot be imported: {exc}")
    if other is not None and not hasattr(other, "place"):
        p.error(f"--core {args.core!r} has no place(): not a build of gpupool.region.greedy")
    found = {alloc_trace.load(f).name: f for f in alloc_trace.find(fragmentation.REAL_DIR)}
    unknown = sorted(set(args.traces) - set(found))
    if unknown:
        p.error(f"unknown traces {unknown}; recorded: {sorted(found)}")
    columns = ([args.core] if other else []) + [f"B={b}" for b in sizes] + ["default"]
    print(f"{'trace':<14}{'calls':>6}{'max n':>7}" + "".join(f"{c:>14}" for c in columns)
          + "  same")
    for name in args.traces or sorted(found):
        calls = record(alloc_trace.load(found[name]))
        runs = ([(other.place, None)] if other else []) + [(greedy.place, b) for b in sizes] \
            + [(greedy.place, None)]
        best, outs = [], []
        for place, buckets in runs:
            took = []
            for _ in range(args.repeat):
                seconds, results = replay(calls, place, buckets)
                took.append(seconds)
            best.append(min(took) * 1e3)
            outs.append(results)
        agree = all(same(outs[0], o) for o in outs[1:])
        most = max((len(a[0]) for a, _ in calls), default=0)
        print(f"{name:<14}{len(calls):>6}{most:>7}" + "".join(f"{ms:>14.1f}" for ms in best)
              + f"  {'yes' if agree else 'NO'}")


if __name__ == "__main__":
    main()
