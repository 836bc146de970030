"""A recorded trace replayed as a longer run: the whole trace, then its steps 1.. again, PASSES
times, in the same pool on the expandable simulated device; per pass, the device synchronizes
(the cold-page moves) and the peak reserved bytes. The recorded runs hold 12-30 steps; the
memory a long run settles at can be above their peak (Note [Excess on checkpointing runs]).
A free of an id not live is skipped and an id still live is not allocated again. At each
repetition's start the last step's tails (its gradients, freed in the step that would follow)
stay live for good, so the replay's own floor (the most bytes live at once, printed) is above
the trace's; compare policies on the same replay, and each with that floor. With ``--plan`` a
planned region (``gpupool.Region(plan=True)``) is entered at each step start, as
``bench/fragmentation.py``'s planned column; its hits and plans are printed per pass. Run from
the repository root::

    PYTHONPATH=$PWD python tools/profile/long_replay.py TRACE PASSES [--plan]   # TRACE: gpt2-ckpt
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import alloc_trace  # noqa: E402
import fragmentation  # noqa: E402

import gpupool  # noqa: E402
from gpupool.testing import SimulatedDevice  # noqa: E402

MiB = 1 << 20


def long_replay(trace, passes, plan=False):
    """Yield (pass, synchronizes in it, peak reserved bytes so far, most bytes live at once so
    far, the planned region's stats() or None) for pass 0 (the whole trace) and each
    repetition of its steps 1.. (1..passes); with ``plan``, a planned region entered at each
    step start (exited at the next one's and at each pass's end)."""
    sim = SimulatedDevice(capacity=1 << 40, virtual_memory=True)
    pool = gpupool.Pool(upstream=sim)
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
                live[i] = pool.allocate(n, s)
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a trace's name in bench/data/traces-real")
    p.add_argument("passes", type=int, help="repetitions of steps 1.. after the whole trace")
    p.add_argument("--plan", action="store_true",
                   help="a planned region entered at each step start")
    args = p.parse_args(argv)
    (trace,) = [t for t in map(alloc_trace.load, alloc_trace.find(fragmentation.REAL_DIR))
                if t.name == args.trace]
    for k, syncs, peak, floor, stats in long_replay(trace, args.passes, args.plan):
        planned = "" if stats is None else (
            f"; plan hits {stats.plan_hits:,}, misses {stats.plan_misses:,}, plans"
            f" {stats.plans} ({stats.planning_ms:,.0f} ms), given up {stats.plans_given_up}, at"
            f" request 0 {stats.record_plans} ({stats.record_ms:,.0f} ms)")
        print(f"{trace.name} pass {k}: {syncs} synchronizes, peak reserved {peak / MiB:,.0f} MiB"
              f" ({peak / floor:.3f}x the most bytes live at once, {floor / MiB:,.0f} MiB)"
              + planned)
    return 0


if __name__ == "__main__":
    sys.exit(main())
