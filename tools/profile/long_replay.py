"""A recorded trace replayed as a longer run: the whole trace, then its steps 1.. again, PASSES
times, in the same pool on the expandable simulated device; per pass, the device synchronizes
(the cold-page moves) and the peak reserved bytes. The recorded runs hold 12-30 steps; the
memory a long run settles at can be above their peak (Note [Excess on checkpointing runs]).
A free of an id not live is skipped and an id still live is not allocated again. At each
repetition's start the last step's tails (its gradients, freed in the step that would follow)
stay live for good, so the replay's own floor (the most bytes live at once, printed) is above
the trace's; compare policies on the same replay, and each with that floor. Run from the
repository root::

    PYTHONPATH=$PWD python tools/profile/long_replay.py TRACE PASSES    # TRACE: gpt2-ckpt ...
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


def long_replay(trace, passes):
    """Yield (pass, synchronizes in it, peak reserved bytes so far, most bytes live at once so
    far) for pass 0 (the whole trace) and each repetition of its steps 1.. (1..passes)."""
    sim = SimulatedDevice(capacity=1 << 40, virtual_memory=True)
    pool = gpupool.Pool(upstream=sim)
    events = trace.events([None] * trace.num_streams)
    live, floor = {}, [0, 0]          # [bytes live now, most bytes live at once]

    def run(lo):
        for op, i, n, s in events[lo:]:
            if op:
                if i in live:
                    floor[0] -= live.pop(i).nbytes
            elif i not in live:
                live[i] = pool.allocate(n, s)
                floor[0] += n
                floor[1] = max(floor)

    def syncs():
        return sum(1 for call in sim.calls if call[0] == "synchronize")

    for k in range(passes + 1):
        before = syncs()
        run(0 if k == 0 else trace.meta["step_starts"][1])
        yield k, syncs() - before, pool.stats().peak_reserved_bytes, floor[1]
    live.clear()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a trace's name in bench/data/traces-real")
    p.add_argument("passes", type=int, help="repetitions of steps 1.. after the whole trace")
    args = p.parse_args(argv)
    (trace,) = [t for t in map(alloc_trace.load, alloc_trace.find(fragmentation.REAL_DIR))
                if t.name == args.trace]
    for k, syncs, peak, floor in long_replay(trace, args.passes):
        print(f"{trace.name} pass {k}: {syncs} synchronizes, peak reserved {peak / MiB:,.0f} MiB"
              f" ({peak / floor:.3f}x the most bytes live at once, {floor / MiB:,.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
