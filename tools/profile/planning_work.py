"""The work and the wall time of every plan that ``bench/fragmentation.py --planner`` makes on
the recorded real traces (``bench/data/traces-real``): the runtime ``Region(plan=...)`` replay
(a region per step on the expandable simulated device) and the script's model of one step's
plan per step (``step_plans``) and of a planned region (``planned_region``, by envelope and by
exact sizes). Each plan's work (``placement.Plan.work``, units of one candidate place examined)
is the same on every run; its milliseconds are the least over ``--repeats`` runs (this machine
is shared). Per trace it prints the plans made, the most work one took, the least and most
milliseconds of that one, the most milliseconds any took, and the ns per unit of work, over
the plans of at least 1 ms. Run from the repository root::

    PYTHONPATH=$PWD python tools/profile/planning_work.py [--repeats R] [--budget-work W]
        [--budget-ms MS]

The budgets default to unbounded: the work each plan needs to finish. See Note [Planning
budget in work] in docs/design.md.
"""

import argparse
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import alloc_trace  # noqa: E402
import fragmentation  # noqa: E402
import numpy as np  # noqa: E402

import gpupool  # noqa: E402
from gpupool.region import placement  # noqa: E402


def plans_of(trace, budget_work, budget_ms):
    """[(work, ms, fallback)] of every plan made for ``trace``, in order."""
    made, plan = [], placement.plan

    def spy(step, **kwargs):
        kwargs.setdefault("budget_work", budget_work)
        kwargs.setdefault("budget_ms", budget_ms)
        kwargs.update(budget_work=min(kwargs["budget_work"], budget_work),
                      budget_ms=min(kwargs["budget_ms"], budget_ms))
        out = plan(step, **kwargs)
        made.append((out.work, out.planning_ms, out.fallback))
        return out

    placement.plan = spy
    try:
        fragmentation.every_plan(gpupool, trace,
                                 {"budget_work": budget_work, "budget_ms": budget_ms})
    finally:
        placement.plan = plan
    return made


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-work", type=int, default=1 << 62)
    parser.add_argument("--budget-ms", type=float, default=math.inf)
    args = parser.parse_args()
    print("trace | plans | most work | its ms (least-most) | most ms | ns / unit | fallbacks")
    for path in alloc_trace.find(fragmentation.REAL_DIR):
        trace = alloc_trace.load(path)
        runs = [plans_of(trace, args.budget_work, args.budget_ms) for _ in range(args.repeats)]
        if any([(w, f) for w, _, f in run] != [(w, f) for w, _, f in runs[0]] for run in runs):
            print(f"{trace.name}: the plans' work differs between runs")
        work = np.array([w for w, _, _ in runs[0]], np.int64)
        ms = np.array([[m for _, m, _ in run] for run in runs]).min(axis=0)
        fell = sum(f is not None for _, _, f in runs[0])
        if not len(work):
            print(f"{trace.name} | 0 | - | - | - | - | 0")
            continue
        top = int(np.argmax(work))
        spread = [run[top][1] for run in runs]
        timed = (ms >= 1) & (work > 0)
        per = ms[timed] * 1e6 / work[timed] if timed.any() else np.zeros(1)
        print(f"{trace.name} | {len(work)} | {work[top]:,} | {min(spread):.0f}-{max(spread):.0f}"
              f" | {ms.max():.0f} | {np.median(per):.0f} ({per.min():.0f}-{per.max():.0f})"
              f" | {fell}")


if __name__ == "__main__":
    main()
