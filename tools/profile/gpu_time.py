"""Whether a column's step time is the GPU's or the host's: ``bench/real_models.py``'s run of one
(model, column) in this process, its steps from ``--from`` on under ``torch.profiler`` with
CUDA activity only (CUPTI's kernel records, no host-side op records), printed as one JSON line:

- ``wall_ms``: each profiled step's wall time (the run's own ``per_step.ms``);
- ``span_ms``: each profiled step's GPU span, CUDA events recorded on the current stream at the
  step's start and after its loss is read (gaps where the GPU waits for the host included);
- ``kernel_ms``: each profiled step's sum of kernel durations, and ``busy_ms`` the union of
  every kernel's, copy's and set's interval (the GPU's busy time, streams overlapping once);
- ``top``: the kernels of the largest summed time, with their calls.

A step whose ``busy_ms`` is close to ``wall_ms`` is the GPU's; a column whose ``kernel_ms`` is
higher than another's on the same shapes runs slower kernels (its memory's layout), where the
same ``kernel_ms`` and a higher ``wall_ms`` put the difference on the host. GPU only::

    python tools/profile/gpu_time.py MODEL COLUMN [--steps N] [--from K] [--top T]
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step_profile import column_ready  # noqa: E402


def union_ms(intervals):
    """Total length in ms of the union of (start_us, end_us) intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def per_step(intervals, bounds):
    """The kernels' summed and united ms inside each step's (start_us, end_us) bounds."""
    sums, busy = [], []
    for lo, hi in bounds:
        inside = [(s, e) for s, e, name in intervals
                  if lo <= s < hi and "spin_kernel" not in name]
        sums.append(sum(e - s for s, e in inside) / 1e3)
        busy.append(union_ms(inside))
    return sums, busy


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="one of real_models.py's models (e.g. llama-ckpt)")
    p.add_argument("column", help="one of real_models.py's column keys (e.g. gp.vmm.plan)")
    p.add_argument("--steps", type=int, default=10, help="training steps (default: %(default)s)")
    p.add_argument("--from", dest="first", type=int, default=4,
                   help="the first profiled step (default: %(default)s)")
    p.add_argument("--top", type=int, default=8, help="kernels listed (default: %(default)s)")
    args = p.parse_args(argv)
    if not 0 <= args.first < args.steps or args.top < 0:
        p.error(f"need 0 <= --from < --steps and --top >= 0, not {args.first}, {args.steps}, "
                f"{args.top}")
    real_models = column_ready(p, args.column, "gpu_time.py")

    import torch
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])
    marks = []          # (step, start event, end event) of the profiled steps
    inner = real_models._models.step

    def step(work, index, on_phase=None):
        if index == args.first:
            torch.cuda.synchronize()
            prof.start()
        if index < args.first:
            return inner(work, index, on_phase=on_phase)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(1)
        loss = inner(work, index, on_phase=on_phase)
        end.record()
        marks.append((start, end))
        return loss

    real_models._models.step = step
    record = real_models.child(args.model, args.column, args.steps, None, False)
    torch.cuda.synchronize()
    prof.stop()
    span = [s.elapsed_time(e) for s, e in marks]
    intervals = []
    for ev in prof.events():
        if str(getattr(ev, "device_type", "")).endswith("CUDA"):
            intervals.append((ev.time_range.start, ev.time_range.end, ev.name))
    intervals.sort()
    # Each profiled step starts with a marker kernel (torch.cuda._sleep, CUDA's "spin_kernel"):
    # a step's records are those from its marker to the next step's
    starts = [s for s, _e, name in intervals if "spin_kernel" in name]
    ends = starts[1:] + [intervals[-1][1] + 1 if intervals else 0]
    bounds = list(zip(starts, ends, strict=True))
    kernel_ms, busy_ms = per_step(intervals, bounds)
    totals = {}
    for s, e, name in intervals:
        t = totals.setdefault(name, [0.0, 0])
        t[0] += (e - s) / 1e3
        t[1] += 1
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:args.top]
    out = {
        "model": args.model, "column": args.column, "from": args.first,
        "wall_ms": [round(x, 1) for x in record["per_step"]["ms"][args.first:]],
        "span_ms": [round(x, 1) for x in span],
        "kernel_ms": [round(x, 1) for x in kernel_ms],
        "busy_ms": [round(x, 1) for x in busy_ms],
        "records": len(intervals), "markers": len(starts),
        "top": [(name[:80], round(t, 1), n) for name, (t, n) in top],
        "own_peak_reserved": record["allocator_peak_reserved"],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
