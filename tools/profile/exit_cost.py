"""What a planned region costs per step on the CPU, split: ``tools/profile/long_replay.py``'s
replay of a recorded trace (a region entered at each step start on the expandable simulated
device), and per step the milliseconds of its body (the requests and frees, a record step's
plan included), of its exit, and inside those the greedy placement (``placement._side_by_side``: the wall
time of a plan's strategies run side by side, at the exit and at a record step's request 0),
the planner's other Python (``Planner.exited``,
``place`` and ``record`` less the greedy) and the region's own part of the exit (the rest:
reading the events, the layout, installing the plan); then the upstream calls the step made
on the simulated device, by name (``map`` with its MiB). ``--no-plan`` enters a region without
a plan instead (the same step boundaries, the pool's online way), to compare the calls and
the body's time. Wall times are this machine's, one run: compare runs made together.

An exit's plan is made on the region's worker thread and installed at its next call
(gpupool/region/background.py): "exit" is the calling thread's time in ``__exit__``, and
"wait" the next call's wait for the plan in flight, after ``--host-ms`` milliseconds of host
work between the exit and that call (``--host sleep``: ``time.sleep``, which releases the GIL,
as a wait for the GPU does; ``busy``: a Python loop, which holds it, as framework code does).
The plan's columns (greedy, planner) are those of its exit's row. ``--sync`` takes the plan
inside the timed exit instead (the host work, if any, after it): the exit as it was when plans
were made on the exit's thread; it needs a plan (not with ``--no-plan``). "region" is the exit less ``Planner.exited`` (and less
``place`` with ``--sync``): reading the events, the layout, handing the plan over. Run from the
repository root::

    PYTHONPATH=$PWD python tools/profile/exit_cost.py TRACE [--passes P] [--capi] [--no-plan]
        [--host-ms MS] [--host {sleep,busy}] [--sync]
"""

import collections
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tools", "profile"))

import long_replay  # noqa: E402

import gpupool  # noqa: E402
from gpupool.region import placement, planned  # noqa: E402
from gpupool.testing import SimulatedDevice  # noqa: E402

MiB = 1 << 20
COLUMNS = ("body", "exit", "wait", "greedy", "planner", "region", "record")


class Timers:
    """Seconds spent in the planner's methods and the greedy, by name, while installed."""

    def __init__(self):
        self.spent = collections.defaultdict(float)
        self._undo = []

    def install(self):
        for owner, name, key in ((planned.Planner, "exited", "exited"),
                                 (planned.Planner, "place", "place"),
                                 (planned.Planner, "record_plan", "record"),
                                 (placement, "_side_by_side", "greedy")):
            self._undo.append((owner, name, getattr(owner, name)))
            setattr(owner, name, self._timed(getattr(owner, name), key))

    def remove(self):
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def _timed(self, function, key):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.spent[key] += time.perf_counter() - start
        return timed


def host_work(ms, kind):
    """``ms`` milliseconds of host work: ``"sleep"`` (the GIL released) or ``"busy"`` (a
    Python loop, the GIL held but for the interpreter's switches)."""
    if ms <= 0:
        return
    if kind == "sleep":
        time.sleep(ms / 1e3)
        return
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def steps_of(trace, passes=0, capi=False, plan=True, host_ms=0.0, host="sleep", sync=False):
    """Per step of the replay, ``(ms, calls)``: ms a dict of COLUMNS' milliseconds, calls a
    Counter of the upstream calls by name (and ``map MiB``). ``host_ms`` of ``host`` work
    (:func:`host_work`) follow each exit; ``sync`` takes the exit's plan inside the exit."""
    timers, sims, rows = Timers(), [], []
    region_class, sim_init = gpupool.Region, SimulatedDevice.__init__

    def init(self, *args, **kwargs):
        sim_init(self, *args, **kwargs)
        sims.append(self)

    class Measured:
        """The replay's region, timed; each exit closes a step's row."""

        def __init__(self, *args, **kwargs):
            kwargs["plan"] = plan
            self.region, self.seen, self.mark = region_class(*args, **kwargs), 0, None

        def __enter__(self):
            self.mark = (time.perf_counter(), dict(timers.spent))
            return self.region.__enter__()

        def __exit__(self, *exc):
            start = time.perf_counter()
            self.region.__exit__(*exc)
            if sync:
                self.region.planner          # takes the plan in flight
            end = time.perf_counter()
            host_work(host_ms, host)
            waited = time.perf_counter()
            self.region.planner              # the next call's wait
            d = collections.defaultdict(float, {k: v - self.mark[1].get(k, 0.0)
                                                for k, v in timers.spent.items()})
            ms = {"body": start - self.mark[0], "exit": end - start,
                  "wait": time.perf_counter() - waited, "greedy": d["greedy"],
                  "planner": d["exited"] + d["place"] + d["record"] - d["greedy"],
                  "region": end - start - d["exited"] - (d["place"] if sync else 0.0),
                  "record": d["record"]}
            calls = sims[-1].calls[self.seen:]
            self.seen = len(sims[-1].calls)
            counts = collections.Counter(name for name, _ in calls)
            mapped = sum(args[1] for name, args in calls if name == "map")
            if mapped:
                counts["map MiB"] = mapped // MiB
            rows.append(({k: v * 1e3 for k, v in ms.items()}, counts))
            return False

        def stats(self):
            return self.region.stats()

    timers.install()
    gpupool.Region, SimulatedDevice.__init__ = Measured, init
    try:
        for _ in long_replay.long_replay(trace, passes, plan=True, capi=capi):
            pass
    finally:
        gpupool.Region, SimulatedDevice.__init__ = region_class, sim_init
        timers.remove()
    return rows


def main(argv=None):
    p = long_replay.trace_options(long_replay.parser(__doc__), passes=0)
    p.add_argument("--capi", action="store_true", help="the requests through the C API")
    p.add_argument("--no-plan", action="store_true", help="a region without a plan per step")
    p.add_argument("--host-ms", type=float, default=0.0,
                   help="milliseconds of host work between an exit and the next entry "
                        "(default: %(default)s)")
    p.add_argument("--host", choices=("sleep", "busy"), default="sleep",
                   help="that work: time.sleep (GIL released) or a Python loop (GIL held) "
                        "(default: %(default)s)")
    p.add_argument("--sync", action="store_true",
                   help="take each exit's plan inside the exit (as made on its thread)")
    args, trace = long_replay.parse(p, argv)
    if not 0 <= args.host_ms < math.inf:
        p.error(f"--host-ms must be a finite number of milliseconds, 0 or more, got "
                f"{args.host_ms}")
    if args.sync and args.no_plan:
        p.error("--sync takes an exit's plan, and --no-plan makes none: choose one")
    rows = steps_of(trace, args.passes, args.capi, not args.no_plan, args.host_ms, args.host,
                    args.sync)
    print("step " + " ".join(f"{c:>8}" for c in COLUMNS) + "  upstream calls")
    total = collections.Counter()
    for k, (ms, calls) in enumerate(rows):
        total.update(ms)
        print(f"{k:4d} " + " ".join(f"{ms[c]:8.2f}" for c in COLUMNS) + "  " +
              ", ".join(f"{name} {n}" for name, n in sorted(calls.items())))
    print(" sum " + " ".join(f"{total[c]:8.2f}" for c in COLUMNS))
    return 0


if __name__ == "__main__":
    long_replay.run(main)
