"""Scale-invariant plans in the offline placement model (``placement_model.py``): a plan made
between steps for a reference step, served at a step of another scale with O(1) work per
request, no planner call while the step runs.

The plan splits the reference step's requests (``classify``) into those whose size keeps
(``CONST``), those that scale with the step's ratio ``r`` (``LINEAR``: ``n_k = r * ref_k``
within ``TOL`` and one 512 B unit, in every step of the structure seen) and the rest
(``OTHER``). Tails (requests the next step frees) never scale: the next step may have another
``r``. The constant and other requests (the others at the most bytes seen) are placed by
``placement.plan`` in ``[0, C)`` around the blocks there; the linear ones, each ``PAD`` units
larger than its reference size, by a second plan at offsets ``a_k`` (in 512 B units) above a
base ``B >= C`` and above every block that stays. A step of ratio ``r = N / D`` (``N``: the
requested bytes of the step's first linear request, ``D``: that request's in the reference)
serves linear request ``k`` at units ``[B + f(a_k), B + f(a_k + b_k))`` with
``f(x) = ceil(x * N / D)``, when its size fits there; any other request at its planned units.

Why no two planned blocks meet: ``f`` is non-decreasing on integers, so two blocks the plan put
apart (``a_i + b_i <= a_j``) stay apart (``f(a_i + b_i) <= f(a_j)``); the step has the plan's
structure (every event is checked against it, O(1) each: the first mismatch sends the rest of
the step online), so a block lives only when the plan says; the linear sub-range lies above
every constant place, and blocks live across steps are tails, at fixed places. A fit is ``n <=
(f(a_k + b_k) - f(a_k)) * 512``; ``f(a + b) - f(a) >= r * (b0 + PAD) - 1`` units, enough for a
request of ``r * b0`` units when ``r * PAD >= 1``. The model checks it: the range's blocks are
kept in a second ``Arena`` beside the whole memory's, and a planned request refused there in a
step the argument covers raises AssertionError. Requests that do not fit their place, escaped
ones and those of a step off its plan go to best fit in the memory's arena (they may also take
holes in the range, which then refuse a planned request: counted as ``refused``).

Reference steps (``REFS``): ``last``: re-planned between every two steps, the step before as
reference; ``max``: the largest step of the structure seen (by its first linear request's
bytes), re-planned only when a larger one comes, steps served by scaling down; ``once``: the
first plan of a structure kept. ``-online``: the other requests online instead of at a slot
of their most bytes. ``-joint``: the requests that are not tails and do not scale go to the
scaled sub-range too, at their most bytes over ``LOW`` or the least ratio seen to the
reference (whichever is larger), so that they share bytes with scaled blocks not live with
them; before the step's first linear request and below that ratio they go online. Run from
the repository root::

    PYTHONPATH=$PWD python tools/profile/scaled_plan.py [TRACE ...] [--passes N]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import placement_model as pm  # noqa: E402

from gpupool.region import placement  # noqa: E402

UNIT = pm.ALIGN             # bytes: the offsets' and sizes' unit
CONST, OTHER, LINEAR, JOINT, UNPLANNED = 0, 1, 2, 3, -1
TOL = 0.01                  # a linear request's size within this share of r * ref (and a unit)
PAD = 1                     # units added to each linear request's reference size
LOW = 0.25                  # joint: the least ratio to the reference a plan is made for
REFS = ("last", "max", "once")
POLICIES = ("scaled-last", "scaled-max", "scaled-once", "scaled-last-online",
            "scaled-last-joint", "scaled-max-joint")


def _units(nbytes):
    return -(-np.asarray(nbytes, dtype=np.int64) // UNIT)


def classify(sizes, raws, tails, tol=TOL):
    """Each request's class and the ratio's request.

    Parameters
    ----------
    sizes, raws : array-like of int, shape (steps, requests)
        Rounded and requested bytes of the steps of one structure seen, oldest first.
    tails : numpy.ndarray of bool
        The structure's tails (never LINEAR).

    Returns
    -------
    (numpy.ndarray of int, int)
        CONST, LINEAR or OTHER per request; the first linear request (-1: none).
    """
    sizes, raws = np.asarray(sizes, np.int64), np.asarray(raws, np.float64)
    varying = (sizes != sizes[-1]).any(axis=0)
    cls = np.where(varying, OTHER, CONST)
    candidates = np.flatnonzero(varying & ~tails)
    if not len(candidates):
        return cls, -1
    k0 = int(candidates[0])
    r = raws[:, k0] / raws[-1, k0]
    expect = r[:, None] * sizes[-1][None, :]
    near = (np.abs(sizes - expect) <= tol * expect + UNIT).all(axis=0)
    cls[varying & ~tails & near] = LINEAR
    return cls, k0


def expected_events(step):
    """The events a plan of ``step`` expects at each event index of a step of its structure:
    (kind, index) arrays of ``step.length``; kind 1: allocation ``index``, 2: the free of the
    step's request ``index``, 3: the free of the step before's tail ``index``, 0: none of the
    plan's."""
    planned = step.planned
    kind = np.zeros(step.length, np.int8)
    index = np.zeros(step.length, np.int64)
    kind[step.alloc], index[step.alloc] = 1, np.arange(len(step))
    inside = planned & (step.free < step.length)
    kind[step.free[inside]], index[step.free[inside]] = 2, np.flatnonzero(inside)
    tail = planned & step.tails
    kind[step.free[tail] - step.length], index[step.free[tail] - step.length] = \
        3, np.flatnonzero(tail)
    return kind, index


def follows(kind, index, t, op, uid, uids, prev_uids, in_range):
    """Whether event ``t`` of a step (``op``, ``uid``; ``uids``: the step's allocations so
    far, ``prev_uids``: the step before's) is the one a plan expecting (``kind``, ``index``)
    there has; ``in_range``: the uids of blocks at planned places. O(1)."""
    if t >= len(kind):
        return False
    k, j = kind[t], index[t]
    if not op:
        return k == 1 and j == len(uids)
    return (k == 2 and j < len(uids) and uids[j] == uid or
            k == 3 and j < len(prev_uids) and prev_uids[j] == uid or
            k == 0 and uid not in in_range)


class ScaledPlan:
    """A plan of one structure served at any ratio: per request its class and units (``lo``,
    ``hi``: absolute for CONST and OTHER, relative to the linear base for LINEAR) and the
    reference's requested bytes (the ratio's denominator)."""

    def __init__(self, step, cls, nbytes, ref_raw, fixed, base_floor, pad=PAD, low=None):
        self.step, self.ref_raw = step, np.asarray(ref_raw, np.int64)
        planned = step.planned
        self.cls = np.where(planned, cls, UNPLANNED)
        if low is not None:
            # Joint: the requests that are not tails go to the scaled sub-range, those that
            # do not scale at their size over ``low`` (the least ratio planned for).
            fixed_size = ((self.cls == CONST) | (self.cls == OTHER)) & ~step.tails
            nbytes = np.where(fixed_size, _units(nbytes / low) * UNIT, nbytes)
            self.cls = np.where(fixed_size, JOINT, self.cls)
        lin, rest = self.cls >= LINEAR, (self.cls == CONST) | (self.cls == OTHER)
        ms, offsets, b = 0.0, np.full(len(step), -1, np.int64), np.zeros(len(step), np.int64)
        for mask, extra, fix in ((rest, 0, fixed), (lin, pad * UNIT, None)):
            sub = placement.Step(nbytes + extra, step.alloc,
                                 np.where(mask, step.free, placement.ESCAPED), step.stream,
                                 step.length)
            made = placement.plan(sub, budget_ms=1e6, max_requests=1 << 20, fixed=fix)
            offsets[mask], b[mask] = made.offsets[mask], sub.nbytes[mask]
            ms += made.planning_ms
            if fix is not None:
                top = made.nbytes
        self.lo, self.hi = offsets // UNIT, (offsets + b) // UNIT
        self.base = int(_units(max(top, base_floor)))
        self.planning_ms = ms
        self.kind, self.index = expected_events(step)

    def place(self, k, ratio):
        """Request ``k``'s place at ``ratio`` (num, den; None before the step's first linear
        request): (address, bytes it may take), or None when the plan does not place it (or
        scales it and the ratio is not known yet). O(1): a lookup, two multiplies."""
        c = self.cls[k]
        if c == UNPLANNED or c >= LINEAR and ratio is None:
            return None
        lo, hi = int(self.lo[k]), int(self.hi[k])
        if c >= LINEAR:
            num, den = ratio
            lo, hi = self.base - (-lo * num // den), self.base - (-hi * num // den)
        return lo * UNIT, (hi - lo) * UNIT


def _fixed_and_floor(arena, where, events, lo, hi, in_range):
    """The blocks live at event ``lo`` as the constant plan's fixed rows, and the least base
    of the linear sub-range: above every block in the range and every one that stays."""
    rows = pm.obstacles(arena, where, events, lo, hi)
    stays = (rows[:, 3] == pm.NEVER) | np.isin(rows[:, 0], list(in_range.values()))
    return rows, int((rows[stays, 0] + rows[stays, 1]).max(initial=0))


def simulate_scaled(events, step_at, raw, ref="last", other="slot", pad=PAD, joint=False):
    """Replay ``events`` with scale-invariant plans (module docstring); ``raw``: each
    allocation uid's requested bytes. Returns a dict: peak (bytes, page rounded), planned,
    fit, served, refused (requests), plans, steps (planned) and deviated (steps off plan),
    slowest plan's ms."""
    if ref not in REFS or other not in ("slot", "online"):
        raise ValueError(f"ref must be one of {REFS} and other 'slot' or 'online'")
    bounds, steps, mem, where = pm.steps_and_prelude(events, step_at)
    shadow, in_range = pm.Arena(), {}
    history, plans, clean, prev_uids = {}, {}, None, []
    out = dict(planned=0, fit=0, served=0, refused=0, plans=0, steps=0, deviated=0, ms=0.0)
    for s in range(len(step_at)):
        lo, hi = bounds[s], bounds[s + 1]
        plan = None
        if s >= 2 and steps[s - 1].structure() == steps[s - 2].structure():
            key = steps[s - 1].structure()
            sizes, raws = zip(*history[key], strict=True)
            cls, k0 = classify(sizes, raws, steps[s - 1].tails)
            if other == "online":
                cls = np.where(cls == OTHER, UNPLANNED, cls)
            pick = len(sizes) - 1
            if ref == "max" and k0 >= 0:
                pick = int(np.argmax([r[k0] for r in raws]))
            plan = plans.get(key)
            # The range holds nothing, or only the tails of a step this plan served whole.
            settled = plan is not None and (not in_range or clean is plan and
                                            set(in_range) <= set(prev_uids))
            remake = (not settled or ref == "last" or
                      (ref == "max" and k0 >= 0 and raws[pick][k0] > plan.ref_raw[k0]))
            if remake:
                fixed, floor = _fixed_and_floor(mem, where, events, lo, hi, in_range)
                nbytes = np.where(cls == LINEAR, sizes[pick], np.max(sizes, axis=0))
                low = None
                if joint and k0 >= 0:
                    low = max(LOW, min(r[k0] for r in raws) / raws[pick][k0])
                plan = ScaledPlan(steps[s - 1], cls, nbytes, raws[pick], fixed, floor, pad, low)
                plans[key] = plan
                out["plans"] += 1
                out["ms"] = max(out["ms"], plan.planning_ms)
            out["steps"] += 1
        on_plan, ratio, uids = plan is not None, None, []
        for t in range(lo, hi):
            op, uid, n = events[t]
            at_t = t - lo
            on_plan = on_plan and follows(plan.kind, plan.index, at_t, op, uid, uids,
                                          prev_uids, in_range)
            if op:
                at = where.pop(uid)
                mem.release(at)
                if in_range.pop(uid, None) is not None:
                    shadow.release(at)
                continue
            k = len(uids)
            uids.append(uid)
            place = None
            if on_plan:
                if plan.cls[k] == LINEAR and ratio is None:
                    ratio = (int(raw[uid]), int(plan.ref_raw[k]))
                place = plan.place(k, ratio)
            if place is not None:
                out["planned"] += 1
                at, room = place
                if n <= room:
                    out["fit"] += 1
                    if not shadow.take_at(at, n):
                        raise AssertionError(f"step {s} request {k}: planned blocks meet")
                    if mem.take_at(at, n):
                        out["served"] += 1
                        where[uid], in_range[uid] = at, at
                        continue
                    shadow.release(at)
                    out["refused"] += 1
            where[uid] = mem.best_fit(n)
        if plan is not None and not (on_plan and hi - lo == plan.step.length):
            out["deviated"] += 1
        clean = plan if plan is not None and on_plan and hi - lo == plan.step.length else None
        prev_uids = uids
        history.setdefault(steps[s].structure(), []).append(
            (steps[s].nbytes, np.array([raw[u] for u in uids], np.int64)))
    out["peak"] = -(-mem.peak // pm.PAGE) * pm.PAGE
    mem.check()
    shadow.check()
    return out


def run_policy(events, step_at, raw, policy):
    """``simulate_scaled`` by a POLICIES name."""
    ref = policy.split("-")[1]
    return simulate_scaled(events, step_at, raw, ref, "online" if policy.endswith("-online")
                           else "slot", joint=policy.endswith("-joint"))


def main(argv=None):
    args = pm.arguments(__doc__, ("best", "plan-scaled") + POLICIES, argv)
    for events, step_at, raw, floor in pm.replays(args.traces, args.passes):
        for policy in args.policies.split(","):
            if policy in pm.ONLINE:
                pm.report_online(events, step_at, floor, policy)
                continue
            if policy in pm.PLANNED:
                r = pm.simulate_planned(events, step_at, policy)
            else:
                r = run_policy(events, step_at, raw, policy)
            print(f"  {policy}: {r['peak'] / pm.MiB:,.0f} MiB ({r['peak'] / floor:.3f}x);"
                  f" served {r['served']:,} of {r['planned']:,} planned requests"
                  + (f" ({r['fit']:,} fit, {r['refused']:,} refused); {r['steps']} steps"
                     f" planned, {r['deviated']} off plan" if "fit" in r else "")
                  + f"; {r['plans']} plans, slowest {r['ms']:.0f} ms", flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(main())
