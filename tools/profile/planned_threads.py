"""Regions of several threads on one pool, the user trial's reproducer (Note [Planned regions on
several threads] in docs/design.md): each thread enters a region of its own for its steps of
16 requests (12 of 4 KiB, 1 MiB and 700,000 B, a third of them closed, then 4 of half a MiB),
their sizes scaled by k in {1, 2, 3}, k changing each step (or 1 with --fixed), on one pool
over the expandable simulated device. Prints, for each run, the pool's peak reserved MiB and
its peak in use. The threads take turns as the interpreter switches them, so runs differ: the
deterministic twin is tests/region/test_planned_threads.py.

    PYTHONPATH=$PWD python tools/profile/planned_threads.py --threads 4 --runs 5
    PYTHONPATH=$PWD python tools/profile/planned_threads.py --plain --steps 400,50,50,50
"""

import argparse
import threading

import gpupool
from gpupool.testing import SimulatedDevice

MIB = 1 << 20


def run(plan, steps, vary):
    """One run: a thread per entry of ``steps`` (its step count); the pool's stats after."""
    pool = gpupool.Pool(upstream=SimulatedDevice(virtual_memory=True))

    def worker(seed):
        region = gpupool.Region(pool=pool, plan=plan)
        for i in range(steps[seed]):
            k = 1 + (i * 7 + seed) % 3 if vary else 1
            with region:
                held = [pool.allocate(n * k) for n in (4096, MIB, 700_000) * 4]
                for buf in held[::3]:
                    buf.close()
                held += [pool.allocate(k * MIB // 2) for _ in range(4)]
                del held

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(steps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return pool.stats()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plain", action="store_true", help="plain regions (default: planned)")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--steps", default="400",
                        help="steps of each thread, comma-separated (one: every thread's)")
    parser.add_argument("--fixed", action="store_true", help="k = 1 at every step")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args(argv)
    steps = [int(n) for n in args.steps.split(",")]
    steps = steps * args.threads if len(steps) == 1 else steps
    for _ in range(args.runs):
        stats = run(not args.plain, steps, not args.fixed)
        print(f"{'plain' if args.plain else 'planned'} threads={len(steps)} "
              f"{'fixed' if args.fixed else 'varying'}: peak reserved "
              f"{stats.peak_reserved_bytes >> 20} MiB, peak in use "
              f"{stats.peak_in_use_bytes / MIB:.1f} MiB", flush=True)


if __name__ == "__main__":
    main()
