"""A planned region's reserved bytes above the run floor, step by step, and the layout the
first steps leave (Note [The first steps' layout] in docs/design.md).

Replays a recorded trace (``bench/data/traces-real``) with a planned region
(``gpupool.Region(plan=True)``) entered at each step start, on the expandable simulated
device, as ``bench/fragmentation.py``'s planned column. Per step it prints the most bytes live,
the most bytes reserved in it and the step's page footprint: the 2 MiB pages that any of
its blocks touched, those live at its start included. No step unmaps a page in use, so a step
that moves no pages (no synchronize) reserves at least its footprint, whatever its policy.
It then prints the fixed rows: the blocks allocated before step 1 that stay live to the end
(the parameters, before step 0, and what step 0 adds for good: an optimizer's state), where
they lie and the holes of 2 MiB or more between them, around which every later step, online
or planned, is placed. With ``--at EVENT`` it prints, just before that event, the free blocks
of 2 MiB or more with the live blocks beside them (the event and step that allocated each).
Pages are counted from the trace's first block (the start of the stream's segment). Run from
the repository root::

    PYTHONPATH=$PWD python tools/profile/first_steps.py TRACE [--at EVENT]
        [--strategies NAME ...]

``--strategies``: the planner's orders (``gpupool.region.placement.STRATEGIES``' keys;
default: the Region's own). Output: MiB.
"""

import argparse
import bisect
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import alloc_trace  # noqa: E402
import fragmentation  # noqa: E402

import gpupool  # noqa: E402
from gpupool.core.pool import _snapshot_of  # noqa: E402
from gpupool.region.placement import STRATEGIES  # noqa: E402

MiB = 1 << 20
PAGE = 2 << 20              # the expandable simulated device's page


def pages(ptr, nbytes, base):
    """The page numbers (from base) that [ptr, ptr + nbytes) touches."""
    return range((ptr - base) // PAGE, (ptr + nbytes - 1 - base) // PAGE + 1)


def replay(trace, plan=True, stop=None):
    """Replay ``trace`` (up to event ``stop``, excluded; None: all) with a planned region per
    step (``plan``: Region's argument). Returns a dict: ``steps``, one dict per step (-1:
    before step 0) with ``live`` (the most bytes live, rounded to 512 B), ``reserved`` (at the
    step's end), ``footprint`` (bytes of the pages touched) and ``synchronizes``; ``born`` {id:
    event}; ``live`` {id: DeviceBuffer} at the end; ``pool``; ``region``; ``base``."""
    starts = list(trace.meta.get("step_starts", [0]))
    steps, born, base, step, touched = {}, {}, None, -1, set()
    cur = 0
    for k, op, i, sim, pool, region, live in fragmentation.replay(
            gpupool, trace, "vmm", True, plan, stop=stop):
        if k in starts:                     # the step before k ends before event k
            step = starts.index(k)
            touched = {p for b in live.values() for p in pages(b.ptr, b.nbytes, base)}
        n = (int(trace.nbytes[k]) + 511) // 512 * 512
        row = steps.setdefault(step, {"live": 0, "reserved": 0, "footprint": 0,
                                      "synchronizes": 0})
        if op:
            cur -= n
        else:
            born[i] = k
            cur += n
            b = live[i]
            base = b.ptr if base is None else base
            touched.update(pages(b.ptr, b.nbytes, base))
            del b
        row["live"] = max(row["live"], cur)
        row["reserved"] = max(row["reserved"], sim.device_bytes)
        row["footprint"] = len(touched) * PAGE
        row["synchronizes"] = sum(1 for c in sim.calls if c[0] == "synchronize")
        if len(sim.calls) > 1 << 16:        # the counts so far, the rest forgotten
            sim.calls[:] = [c for c in sim.calls if c[0] == "synchronize"]
    return {"steps": steps, "born": born, "live": live, "pool": pool, "region": region,
            "base": base, "starts": starts}


def fixed_rows(trace, out):
    """The fixed rows of a whole replay ``out``: [(offset from base, bytes, event)] of the
    blocks allocated before step 1 and live at the end, by address."""
    starts = out["starts"]
    first = starts[1] if len(starts) > 1 else len(trace)
    return sorted((b.ptr - out["base"], b.nbytes, out["born"][i])
                  for i, b in out["live"].items() if out["born"][i] < first)


def holes(rows):
    """[(offset, bytes)] of the gaps of at least a page between rows sorted by address."""
    out, end = [], None
    for off, n, _ in rows:
        if end is not None and off - end >= PAGE:
            out.append((end, off - end))
        end = off + n if end is None else max(end, off + n)
    return out


def free_at(trace, k, plan=True):
    """Just before event k: [(offset, bytes, state, (prev), (next))] of the free blocks of
    at least a page, each neighbour as (state, bytes, event allocated or None)."""
    out = replay(trace, plan, stop=k)
    _, segments, _, _ = _snapshot_of(out["pool"], {})
    by_ptr = {b.ptr: i for i, b in out["live"].items()}
    rows = [r for seg in segments for r in seg[4]]
    rows.sort(key=lambda r: r[0])

    def side(r):
        if r is None:
            return None
        i = by_ptr.get(r[0]) if r[3] == "active_allocated" else None
        return r[3], r[1], out["born"].get(i)
    return [(r[0] - out["base"], r[1], r[3], side(rows[j - 1] if j else None),
             side(rows[j + 1] if j + 1 < len(rows) else None))
            for j, r in enumerate(rows) if r[3] != "active_allocated" and r[1] >= PAGE]


def report(trace, at=None, plan=True):
    m = lambda b: f"{b / MiB:,.1f}"  # noqa: E731
    out = replay(trace, plan)
    starts = out["starts"]
    print(f"== {trace.name}")
    print("step   most live    reserved   footprint  synchronizes")
    for s, row in sorted(out["steps"].items()):
        print(f"{s:4d} {m(row['live']):>11} {m(row['reserved']):>11} "
              f"{m(row['footprint']):>11} {row['synchronizes']:>13}")
    rows = fixed_rows(trace, out)
    params = sum(n for _, n, k in rows if k < starts[0])
    gaps = holes(rows)
    if rows:
        print(f"fixed rows: {len(rows)}, {m(params)} before step 0, "
              f"{m(sum(n for _, n, _ in rows) - params)} from step 0, "
              f"over [0, {m(max(o + n for o, n, _ in rows))}); holes of a page or more: "
              + ", ".join(f"{m(n)} at {m(o)}" for o, n in gaps))
    if at is not None:
        step = bisect.bisect_right(starts, at) - 1
        print(f"before event {at} (step {step}, a request of {m(int(trace.nbytes[at]))}):")
        for off, n, state, prev, nxt in free_at(trace, at, plan):
            print(f"  free {m(n)} at {m(off)} ({state}); before it {side_text(prev, starts)}; "
                  f"after it {side_text(nxt, starts)}")
    out["live"].clear()


def side_text(side, starts):
    if side is None:
        return "the end"
    state, n, k = side
    if k is None:
        return f"{state} {n / MiB:,.1f}"
    return f"live {n / MiB:,.1f} (event {k}, step {bisect.bisect_right(starts, k) - 1})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a trace's name in bench/data/traces-real")
    ap.add_argument("--at", type=int, metavar="EVENT",
                    help="the free blocks and their neighbours just before this event")
    ap.add_argument("--strategies", nargs="+", choices=sorted(STRATEGIES),
                    help="the planner's orders (default: the Region's)")
    args = ap.parse_args(argv)
    if args.strategies and len(set(args.strategies)) < len(args.strategies):
        ap.error(f"--strategies names each strategy once, got {' '.join(args.strategies)}")
    path = os.path.join(ROOT, "bench", "data", "traces-real", args.trace + ".npz")
    if not os.path.exists(path):
        ap.error(f"no trace {args.trace!r} in bench/data/traces-real")
    trace = alloc_trace.load(path)
    if args.at is not None and not (0 < args.at < len(trace) and trace.op[args.at] == 0):
        # Before event 0 the pool holds nothing: the first event that can be asked about is 1.
        ap.error(f"--at {args.at}: not an allocation after the first of the trace's "
                 f"{len(trace)} events")
    plan = {"strategies": tuple(args.strategies)} if args.strategies else True
    report(trace, args.at, plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
