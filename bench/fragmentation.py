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
from _common import MiB, format_table

SCRIPT = "fragmentation"
SEEDS, SCALES = range(6), (1, 3, 8)


def traces():
    """(name, events) of the recorded traces and the synthetic ones."""
    found = [(t.name, list(t.events())) for t in map(alloc_trace.load, alloc_trace.find())]
    for seed in SEEDS:
        base = alloc_trace.synthetic(steps=3, layers=10, seed=seed)
        for scale in SCALES:
            found.append((f"synthetic s{seed} x{scale}",
                          [(op, i, n * scale, s) for op, i, n, s in base.events()]))
    return found


def peak_live(events):
    live, now, peak = {}, 0, 0
    for op, i, n, _ in events:
        if op:
            now -= live.pop(i)
        else:
            live[i] = n
            now += n
            peak = max(peak, now)
    return peak


def peak_reserved(gpupool, events):
    """Replay through a fresh pool on a simulated device; its peak reserved bytes."""
    from gpupool.testing import SimulatedDevice

    sim = SimulatedDevice(capacity=1 << 40)
    pool = gpupool.Pool(upstream=sim)
    streams = {0: None}
    live = {}
    for op, i, n, s in events:
        if op:
            del live[i]
        else:
            if s not in streams:
                streams[s] = sim.create_stream()
            live[i] = pool.allocate(n, streams[s])
    live.clear()
    return pool.stats().peak_reserved_bytes


def run(gpupool):
    rows = {}
    for name, events in traces():
        live = peak_live(events)
        reserved = peak_reserved(gpupool, events)
        rows[name] = {"peak_live": live, "peak_reserved": reserved, "ratio": reserved / live}
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
