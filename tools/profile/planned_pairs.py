"""The cost of an allocate + free pair served by a planned region's plan, beside a plain
region's and the pool's alone, on the simulated device: from Python (``pool.allocate`` +
``del``) and from C (``api->allocate`` + ``api->free`` in a C loop without the GIL,
``bench/_capi_loop.c``). Each entry of a region runs PAIRS pairs of one size (its step);
after the warm-up entries the planned region serves every request at its planned place (the
plan's hits are checked). The ways are timed interleaved, REPEATS times; the medians (and the
spread) of ns per pair are printed. Run from the repository root::

    PYTHONPATH=$PWD python tools/profile/planned_pairs.py [--pairs N] [--repeats R] [--nbytes B]
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import _cext  # noqa: E402

import gpupool  # noqa: E402
from gpupool.testing import SimulatedDevice  # noqa: E402

WAYS = ("pool", "region", "planned")


def python_pairs(pool, nbytes, pairs):
    """ns per pair of ``pairs`` Python allocate + free pairs."""
    allocate = pool.allocate
    start = time.perf_counter_ns()
    for _ in range(pairs):
        buf = allocate(nbytes)
        del buf
    return (time.perf_counter_ns() - start) / pairs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=1000, help="pairs per entry (the step)")
    p.add_argument("--repeats", type=int, default=15, help="timed entries per way and side")
    p.add_argument("--nbytes", type=int, default=1 << 20, help="bytes per request")
    args = p.parse_args(argv)
    if args.pairs < 1 or args.repeats < 1 or args.nbytes < 1:
        p.error("--pairs, --repeats and --nbytes must be >= 1")
    loop = _cext.build("gpupool_bench_loop", [os.path.join(ROOT, "bench", "_capi_loop.c")]).loop
    pool = gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 34), device=0)
    gpupool.set_pool(pool, 0)                       # the C API's pool
    regions = {"pool": None, "region": gpupool.Region(pool=pool, collect=None),
               "planned": gpupool.Region(pool=pool, collect=None, plan=True)}
    sides = {"Python": lambda: python_pairs(pool, args.nbytes, args.pairs),
             "C API": lambda: loop([args.nbytes], args.pairs)}
    times = {(way, side): [] for way in WAYS for side in sides}

    def entry(way, side):
        region = regions[way]
        if region is None:
            return sides[side]()
        with region:
            return sides[side]()
    for side in sides:                              # warm-up: the plan is made and installed
        for way in WAYS:
            for _ in range(4):
                entry(way, side)
    warm = regions["planned"].stats()
    for _ in range(args.repeats):
        for side in sides:
            for way in WAYS:
                times[way, side].append(entry(way, side))
    stats = regions["planned"].stats()
    hits, misses = stats.plan_hits - warm.plan_hits, stats.plan_misses - warm.plan_misses
    print(f"ns per allocate + free pair of {args.nbytes} B on the simulated device, median "
          f"(min-max) of {args.repeats} entries of {args.pairs} pairs, ways interleaved")
    print(f"{'way':<10}" + "".join(f"{side:>26}" for side in sides))
    for way in WAYS:
        cells = []
        for side in sides:
            ns = times[way, side]
            cells.append(f"{statistics.median(ns):,.0f} ({min(ns):,.0f}-{max(ns):,.0f})")
        print(f"{way:<10}" + "".join(f"{c:>26}" for c in cells))
    print(f"planned region, timed entries: {hits:,} of {2 * args.repeats * args.pairs:,} "
          f"requests served at their place, {misses:,} planned ones not; {stats.plans} plans")
    return 0


if __name__ == "__main__":
    sys.exit(main())
