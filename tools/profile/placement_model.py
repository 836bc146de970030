"""An offline model of placement policies on one address range: how near the run floor (the most
bytes live at once) an allocator can get on a recorded trace whose shapes vary every step, when
it uses what the steps before tell it.

No pool and no device: a request goes to a free hole of one range that grows at its top (the
expandable segment's way), and the peak of the top, rounded up to the 2 MiB page, is what the
policy reserves. Sizes are rounded up to 512 B, as the pool does. The replay is the trace
(``run``) or the trace then its steps 1.. again ``PASSES`` times (``long``: the replay of
``tools/profile/long_replay.py``, whose floor is the trace's plus the last step's tails).

Online policies, one request at a time (``ONLINE``):

- ``best``: best fit (the smallest hole that fits, the lowest on a tie), at the hole's low end;
  else at the range's top. The pool's way on one expandable segment, without its magazines,
  small-request and cold-page rules.
- ``two-ended``: a request predicted to live more than ``LONG`` allocations takes best fit at
  the hole's low end; a shorter-lived one the highest hole that fits, at its high end.
- ``neighbour``: among the holes up to ``SLACK`` times the best fit's size, the one with a live
  neighbour whose predicted free time is nearest the request's, placed against it.

A lifetime is predicted from the request's position in its step (its index ``k`` among the
step's allocations): the lifetime of the last request ``k`` seen, in allocations. ``oracle-``
runs a policy on each request's true lifetime instead.

Planned policies (``PLANNED``), a step placed whole by ``gpupool.region.placement.plan``
(greedy by size) around the blocks live at its first request (with the events that free
them), each request then taking its planned place when those bytes are free, else best fit:

- ``plan-exact``: the step's own sizes and lifetimes (an oracle: the bound of planning).
- ``plan-scaled``: the previous step's structure and lifetimes; its sizes predicted from the
  step's first request: a request whose size differed between the two steps before scales
  by the ratio of the first request's size to its size in the previous step, any other keeps
  its size. Planned at the first request of every step.
- ``plan-bucket``: as ``plan-scaled``, the first request's size rounded up to a bucket
  (``BUCKETS`` per doubling) and the plan kept per (structure, bucket): a later step of that
  bucket reuses it unless a block live at its start meets one of its places then.
- ``plan-kept``: as ``plan-bucket``, but the first step of a bucket is served by best fit (its
  plan is made then and serves the bucket's later steps): plans made after a step, never
  while one runs, as a region planning at its exits would have them.

A step is planned only when the two steps before it have one structure (the order of their
allocations and frees): a step of another shape is served by best fit alone. Run from the
repository root::

    PYTHONPATH=$PWD python tools/profile/placement_model.py [TRACE ...] [--passes N] [--oracle]

Output: per trace and replay, each policy's peak in MiB and its ratio to the replay's floor;
for the planned ones also the share of the requests served at their place, the plans made and
reused, and the slowest plan's milliseconds.
"""

import argparse
import bisect
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import alloc_trace  # noqa: E402
import fragmentation  # noqa: E402
import numpy as np  # noqa: E402

from gpupool.region import placement  # noqa: E402

MiB = 1 << 20
ALIGN = placement.ALIGN     # bytes: the pool's rounding of a request
PAGE = 2 << 20              # bytes: the expandable device's page
LONG = 256                  # allocations: a request living longer is long-lived (two-ended)
SLACK = 1.25                # neighbour: holes up to this times the best fit's size are looked at
NEVER = 1 << 62             # the free time of a request never freed
BUCKETS = 8                 # plan-bucket: buckets of the first request's size per doubling


def expand(trace, passes, raw=None):
    """The replay's events ``[(op, uid, rounded bytes)]``, ``uid`` new for each allocation,
    and the index of each step's first event among them. Pass 0 is the whole trace; each
    further pass repeats its steps 1.. in the same live set: a free of an id not live is
    skipped and an id still live is not allocated again (``long_replay.py``'s rules).
    ``raw``: a dict given here gets each ``uid``'s requested bytes (before rounding)."""
    starts = trace.meta["step_starts"]
    first = set(starts)
    events, out, live = trace.events(), [], {}
    step_at = []
    for p in range(passes + 1):
        for t in range(0 if p == 0 else starts[1], len(events)):
            if t in first:
                step_at.append(len(out))
            op, i, n, _ = events[t]
            if op:
                if i in live:
                    out.append((1, live.pop(i), 0))
            elif i not in live:
                live[i] = len(out)
                if raw is not None:
                    raw[len(out)] = n
                out.append((0, len(out), -(-n // ALIGN) * ALIGN))
    return out, step_at


def floor_bytes(events):
    """The most bytes live at once over ``events`` (rounded sizes)."""
    live, top, size = 0, 0, {}
    for op, uid, n in events:
        if op:
            live -= size.pop(uid)
        else:
            size[uid] = n
            live += n
            top = max(top, live)
    return top


class Arena:
    """The free holes and live blocks of one range that grows at its top."""

    def __init__(self):
        self.addrs, self.size = [], {}        # free holes by address; address -> bytes
        self.by_size = []                     # (bytes, address), sorted
        self.used = {}                        # live block's address -> bytes
        self.top = self.peak = 0

    def _add(self, addr, n):
        bisect.insort(self.addrs, addr)
        self.size[addr] = n
        bisect.insort(self.by_size, (n, addr))

    def _drop(self, addr):
        n = self.size.pop(addr)
        del self.addrs[bisect.bisect_left(self.addrs, addr)]
        del self.by_size[bisect.bisect_left(self.by_size, (n, addr))]
        return n

    def _extend(self, end):
        self.top = max(self.top, end)
        self.peak = max(self.peak, self.top)

    def fits(self, n):
        """The free holes of at least ``n`` bytes, smallest first: [(bytes, address)]."""
        return self.by_size[bisect.bisect_left(self.by_size, (n, -1)):]

    def take(self, hole, n, high=False):
        """``n`` bytes cut from the free hole at address ``hole`` (at its high end when
        ``high``); returns their address."""
        m = self._drop(hole)
        at = hole + m - n if high else hole
        if m > n:
            self._add(hole if high else hole + n, m - n)
        self.used[at] = n
        return at

    def grow(self, n):
        """``n`` bytes at the top, joining the free hole that ends there; their address."""
        at = self.top
        if self.addrs and self.addrs[-1] + self.size[self.addrs[-1]] == self.top:
            at = self.addrs[-1]
            self._drop(at)
        self._extend(at + n)
        self.used[at] = n
        return at

    def best_fit(self, n):
        fit = self.fits(n)
        return self.take(fit[0][1], n) if fit else self.grow(n)

    def take_at(self, addr, n):
        """Take ``[addr, addr + n)`` when every byte of it is free (in one hole, or in the
        hole ending at the top and past it); returns whether it did."""
        j = bisect.bisect_right(self.addrs, addr) - 1
        hole = self.addrs[j] if j >= 0 else None
        end = hole + self.size[hole] if hole is not None else -1
        if end < addr + n:
            if end == self.top:                 # the top hole, made to reach past addr + n
                self._drop(hole)
            elif addr >= self.top:
                hole = self.top
            else:
                return False
            self._add(hole, addr + n - hole)
            self._extend(addr + n)
        m = self._drop(hole)
        if addr > hole:
            self._add(hole, addr - hole)
        if hole + m > addr + n:
            self._add(addr + n, hole + m - addr - n)
        self.used[addr] = n
        return True

    def release(self, addr):
        n = self.used.pop(addr)
        j = bisect.bisect_left(self.addrs, addr)
        if j < len(self.addrs) and self.addrs[j] == addr + n:
            n += self._drop(addr + n)
        if j > 0:
            prev = self.addrs[j - 1]
            if prev + self.size[prev] == addr:
                n += self._drop(prev)
                addr = prev
        self._add(addr, n)

    def check(self):
        """Raise AssertionError unless the holes and live blocks tile ``[0, top)`` without
        overlap."""
        spans = sorted([(a, n) for a, n in self.used.items()] + list(self.size.items()))
        at = 0
        for a, n in spans:
            assert a >= at and n > 0, f"overlap or empty span at {a}"
            at = a + n
        assert at <= self.top


# Online policies: pick(arena, n, lifetime, frees_at) -> (hole address, high end?) or None.

def _best(arena, n, life, frees_at):
    fit = arena.fits(n)
    return (fit[0][1], False) if fit else None


def _two_ended(arena, n, life, frees_at):
    fit = arena.fits(n)
    if not fit:
        return None
    if life > LONG:
        return fit[0][1], False
    return max(a for _, a in fit), True


def _neighbour(arena, n, life, frees_at):
    fit = arena.fits(n)
    if not fit:
        return None
    choice, score = (fit[0][1], False), None
    for m, a in fit:
        if m > SLACK * fit[0][0]:
            break
        for high, other in ((True, frees_at.get(a + m)), (False, frees_at.get(arena.ends.get(a)))):
            if other is not None and (score is None or abs(other - life) < score):
                choice, score = (a, high), abs(other - life)
    return choice


ONLINE = {"best": _best, "two-ended": _two_ended, "neighbour": _neighbour}


def simulate(events, step_at, policy, oracle=False):
    """The page-rounded peak top in bytes of an ONLINE ``policy`` over ``events``."""
    arena, where, clock, pick = Arena(), {}, 0, ONLINE[policy]
    arena.ends = {}                           # a live block's end -> its start
    frees = {}
    if oracle:
        t = 0
        for op, uid, _ in events:
            frees[uid] = t if op else NEVER
            t += not op
    seen, born, kof, frees_at = {}, {}, {}, {}
    starts, k = set(step_at), -1
    for e, (op, uid, n) in enumerate(events):
        if e in starts:
            k = 0
        if op:
            at = where.pop(uid)
            del arena.ends[at + arena.used[at]]
            frees_at.pop(at, None)
            arena.release(at)
            kk = kof.pop(uid)
            if born.get(kk, (None,))[0] == uid:
                seen[kk] = clock - born.pop(kk)[1]
            continue
        if oracle:
            life = frees[uid] - clock
        elif k in born:
            life = max(seen.get(k, 0), clock - born[k][1])
        else:
            life = seen.get(k, NEVER)
        spot = pick(arena, n, life, frees_at)
        at = arena.take(spot[0], n, spot[1]) if spot else arena.grow(n)
        where[uid], kof[uid], born[k] = at, k, (uid, clock)
        arena.ends[at + n] = at
        frees_at[at] = clock + life
        clock += 1
        k += k >= 0
    return -(-arena.peak // PAGE) * PAGE


PLANNED = ("plan-exact", "plan-scaled", "plan-bucket", "plan-kept")


def obstacles(arena, where, events, lo, hi):
    """The blocks live at event ``lo`` as ``placement.plan``'s fixed rows: (address, bytes,
    0, the event of the step ``[lo, hi)`` that frees it, or forever)."""
    freed = {events[t][1]: t - lo for t in range(lo, hi) if events[t][0]}
    rows = [(at, arena.used[at], 0, freed.get(uid, NEVER)) for uid, at in where.items()]
    return np.array(rows, np.int64).reshape(-1, 4)


def meets(plan, fixed):
    """Whether a block of ``fixed`` holds bytes of one of ``plan``'s places while its request
    may be live."""
    step, keep = plan.step, plan.step.planned
    lo = plan.offsets[keep]
    hi, t0 = lo + step.nbytes[keep], step.alloc[keep]
    t1 = np.minimum(step.free[keep], step.length)
    return any(((lo < a + n) & (a < hi) & (t0 < end) & (first < t1)).any()
               for a, n, first, end in fixed)


def _predicted(steps, s, first_bytes):
    """Step ``s``'s requests as the steps before it predict them, its first request being
    ``first_bytes``: step s-1's structure, its sizes scaled where they varied."""
    prev, before = steps[s - 1], steps[s - 2]
    scales = prev.nbytes != before.nbytes
    scales[0] = True
    ratio = first_bytes / prev.nbytes[0]
    pred = np.where(scales, np.ceil(prev.nbytes * ratio / ALIGN) * ALIGN, prev.nbytes)
    return placement.Step(pred.astype(np.int64), prev.alloc, prev.free, prev.stream,
                          prev.length)


def steps_and_prelude(events, step_at):
    """The steps' bounds (each step's first event, then the end) and ``placement.Step`` s, and
    an Arena with the events before the first step placed by best fit, with its blocks' uid ->
    address."""
    bounds = step_at + [len(events)]
    rows = [(op, uid, n, 0) for op, uid, n in events]
    steps = [placement.record_step(rows, bounds[s], bounds[s + 1],
                                   bounds[min(s + 2, len(step_at))])
             for s in range(len(step_at))]
    arena, where = Arena(), {}
    for t in range(bounds[0]):
        op, uid, n = events[t]
        if op:
            arena.release(where.pop(uid))
        else:
            where[uid] = arena.best_fit(n)
    return bounds, steps, arena, where


def simulate_planned(events, step_at, how):
    """Replay ``events`` under a PLANNED policy ``how``; returns a dict: peak (bytes, page
    rounded), served and planned (requests), plans, reused, slowest plan's ms."""
    bounds, steps, arena, where = steps_and_prelude(events, step_at)
    kept = {}
    out = {"served": 0, "planned": 0, "plans": 0, "reused": 0, "ms": 0.0}
    for s in range(len(step_at)):
        lo, hi = bounds[s], bounds[s + 1]
        offsets = None
        repeats = s >= 2 and steps[s - 1].structure() == steps[s - 2].structure()
        k = 0
        for t in range(lo, hi):
            op, uid, n = events[t]
            if op:
                arena.release(where.pop(uid))
                continue
            if k == 0 and repeats:
                offsets = _plan_for(how, steps, s, n, obstacles(arena, where, events, lo, hi),
                                    kept, out)
            at = None
            if offsets is not None and k < len(offsets) and offsets[k] >= 0:
                out["planned"] += 1
                if arena.take_at(int(offsets[k]), n):
                    at = int(offsets[k])
                    out["served"] += 1
            where[uid] = arena.best_fit(n) if at is None else at
            k += 1
    out["peak"] = -(-arena.peak // PAGE) * PAGE
    arena.check()
    return out


def _plan_for(how, steps, s, first_bytes, fixed, kept, out):
    """The offsets step ``s`` is served from under ``how`` (see PLANNED)."""
    if how == "plan-exact":
        step = steps[s]
    elif how == "plan-scaled":
        step = _predicted(steps, s, first_bytes)
    else:
        bucket = int(np.ceil(BUCKETS * np.log2(first_bytes)))
        key = (steps[s - 1].structure(), bucket)
        step = _predicted(steps, s, 2 ** (bucket / BUCKETS))
        if key in kept and not meets(kept[key], fixed):
            out["reused"] += 1
            return kept[key].offsets
        made = placement.plan(step, budget_ms=1e6, max_requests=1 << 20, fixed=fixed)
        out["plans"] += 1
        out["ms"] = max(out["ms"], made.planning_ms)
        first = key not in kept
        kept[key] = made
        return None if how == "plan-kept" and first else made.offsets
    made = placement.plan(step, budget_ms=1e6, max_requests=1 << 20, fixed=fixed)
    out["plans"] += 1
    out["ms"] = max(out["ms"], made.planning_ms)
    return made.offsets


def arguments(doc, policies, argv, oracle=False):
    """The model scripts' command line: traces, --passes, --policies (default ``policies``)
    and, with ``oracle``, --oracle."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("traces", nargs="*", default=["gpt2-ckpt", "llama-ckpt", "gpt2-generate"])
    p.add_argument("--passes", type=int, default=3, help="repetitions for the long replay")
    p.add_argument("--policies", default=",".join(policies))
    if oracle:
        p.add_argument("--oracle", action="store_true", help="also the online policies' oracles")
    return p.parse_args(argv)


def replays(names, passes):
    """Per trace of ``names`` and replay (``run``, then ``long`` of ``passes``): (events,
    step_at, raw, floor) as ``expand`` gives them, after printing the replay's floor."""
    traces = {t.name: t for t in map(alloc_trace.load, alloc_trace.find(fragmentation.REAL_DIR))}
    for name in names:
        for label, n in (("run", 0), ("long", passes)):
            raw = {}
            events, step_at = expand(traces[name], n, raw)
            floor = floor_bytes(events)
            print(f"{name} {label}: floor {floor / MiB:,.0f} MiB", flush=True)
            yield events, step_at, raw, floor


def report_online(events, step_at, floor, policy, oracle=False):
    """Print an ONLINE policy's peak and its ratio to ``floor`` (and its oracle's)."""
    for true in (False, True) if oracle else (False,):
        peak = simulate(events, step_at, policy, true)
        print(f"  {'oracle-' if true else ''}{policy}: {peak / MiB:,.0f} MiB"
              f" ({peak / floor:.3f}x)", flush=True)


def main(argv=None):
    args = arguments(__doc__, list(ONLINE) + list(PLANNED), argv, oracle=True)
    for events, step_at, _, floor in replays(args.traces, args.passes):
        for policy in args.policies.split(","):
            if policy in ONLINE:
                report_online(events, step_at, floor, policy, args.oracle)
                continue
            r = simulate_planned(events, step_at, policy)
            print(f"  {policy}: {r['peak'] / MiB:,.0f} MiB ({r['peak'] / floor:.3f}x);"
                  f" served {r['served']:,} of {r['planned']:,} planned requests;"
                  f" {r['plans']} plans, {r['reused']} reused, slowest {r['ms']:.0f} ms",
                  flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(main())
