"""Fragmentation of gpupool's policy beyond the recorded traces: peak reserved / peak live bytes
on the recorded traces and on synthetic training-like ones, on the simulated device.

``trace_replay.py`` compares gpupool with its peers on the two recorded traces, whose numbers
a policy could be tuned to. This script is the check against that: the same policy replayed
over 18 synthetic traces it was not tuned on (``alloc_trace.synthetic``, seeds 0-5, 10 layers,
3 steps, sizes scaled by 1, 3 and 8), reporting each trace's ratio and the synthetic ones'
mean and worst. Peak reserved bytes depend only on the policy, not on the GPU, so the
simulated device gives the H200's numbers (the recorded traces agree with ``trace_replay.py``
there). Run::

    python bench/fragmentation.py [--json PATH]
"""

import sys
import time

import _common
import alloc_trace
import numpy as np
import trace_replay
from _common import MiB, format_table

SCRIPT = "fragmentation"
SEEDS, SCALES = range(6), (1, 3, 8)


def traces():
    """The recorded traces and the synthetic ones, as :class:`alloc_trace.Trace`."""
    found = [alloc_trace.load(path) for path in alloc_trace.find()]
    for seed in SEEDS:
        base = alloc_trace.synthetic(steps=3, layers=10, seed=seed)
        for scale in SCALES:
            found.append(alloc_trace.Trace(f"synthetic s{seed} x{scale}", base.op, base.ids,
                                           base.nbytes * scale, base.stream, base.meta))
    return found


def peak_reserved(gpupool, trace):
    """Replay through a fresh pool on a simulated device; its peak reserved bytes."""
    from gpupool.testing import SimulatedDevice

    sim = SimulatedDevice(capacity=1 << 40)
    pool = gpupool.Pool(upstream=sim)
    streams = [None] + [sim.create_stream() for _ in range(1, trace.num_streams)]
    live = trace_replay.replay(trace.events(streams), pool.allocate)
    live.clear()
    return pool.stats().peak_reserved_bytes


def run(gpupool):
    rows = {}
    for trace in traces():
        live = trace.peak_live_bytes()
        reserved = peak_reserved(gpupool, trace)
        rows[trace.name] = {"peak_live": live, "peak_reserved": reserved,
                            "ratio": reserved / live}
    synthetic = [r["ratio"] for name, r in rows.items() if name.startswith("synthetic")]
    return {"script": SCRIPT, "simulated": True, "results": rows,
            "synthetic": {"mean": float(np.mean(synthetic)), "max": float(np.max(synthetic)),
                          "count": len(synthetic)}}


def report(out):
    res = out["results"]
    table = format_table(
        ["trace", "peak live MiB", "peak reserved MiB", "reserved / live"],
        [[name, f"{r['peak_live'] / MiB:.1f}", f"{r['peak_reserved'] / MiB:.1f}",
          f"{r['ratio']:.2f}x"] for name, r in res.items()],
        title="gpupool on the simulated device: peak reserved / peak live bytes")
    syn = out["synthetic"]
    return (f"{table}\n\nsynthetic traces ({syn['count']}): mean {syn['mean']:.3f}x, "
            f"worst {syn['max']:.2f}x")


def main(argv=None):
    args = _common.parser(__doc__.splitlines()[0]).parse_args(argv)
    start = time.perf_counter()
    import gpupool

    return _common.finish(run(gpupool), start, report, args.json)


if __name__ == "__main__":
    sys.exit(main())
