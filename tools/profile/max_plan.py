"""Plans of the largest step in the offline placement model (``placement_model.py``): one exact
plan per structure, made between steps from the largest step of that structure seen, serving
the smaller steps at its offsets unscaled, with O(1) work per request.

The steps' request sizes grow with the step's ratio ``r`` (batch x length), read from the
step's first request's requested bytes. After a step whose structure repeats the step before's,
the model takes the largest step of that structure seen (``by``: ``r``, or its floor, the most
bytes its requests hold at once) and, when it is larger than the reference its structure's plan
was made from (or no plan exists), makes a new plan from it (a *re-plan*): ``placement.plan``
of that step's sizes and lifetimes around the blocks live then (the step's tails until the
structure's free of them, any other block for good), as a region planning at its exits
would. The same reference is placed again (``moved``, counted among the re-plans) when a block
the plan does not know holds a slot's bytes while the slot is used. A step is served with the
plan of the step before's structure: request ``k`` at its slot ``[o_k, o_k + b_k)`` when its
size is at most ``b_k`` and those bytes are free. Each event is compared with the plan's event
at that index (a lookup); the first mismatch sends the rest of the step to best fit. A request
larger than its slot sends the rest of the step to best fit (``misfit="rest"``) or only itself
(``"request"``); a slot whose bytes a block holds (one placed by best fit) sends only that
request to best fit (counted as ``refused``).

Why no two slotted blocks meet: the plan places the reference's requests so that two whose
lifetimes meet (tails across the step's boundary included) have disjoint slots; a step of the
structure has the same lifetimes (each event is checked), and a request no larger than its slot
stays inside it, so a smaller step's blocks shrink within the larger step's slots. The model
checks it: blocks served at their slots are also kept in a second ``Arena``, and a slotted
request refused there raises AssertionError. That arena holds, at a step's start, only the
tails of a step before served under the same plan and on it to its end; any other block there
leaves it (it is one the argument does not cover: the memory's arena still keeps it apart).

Variants (``VARIANTS``): ``plan-max`` (by ``r``, misfit: rest of the step); ``-request`` (a
misfit sends only itself to best fit); ``-floor`` (the reference by floor); ``-envelope`` (the
plan of the elementwise largest sizes over the structure's steps seen, re-made when a step has
a request larger than its slot); ``-margin`` (the reference's sizes plus ``MARGIN``, re-made
when ``r`` passes the reference's by more than that); ``-one`` (one plan in all: a repeating
structure other than the plan's replaces it); ``plan-record`` (``-envelope``, and a *record*
step, one whose ``r`` passes the most over the steps its structure's plan was made from, is
served from a plan made at its first request, of the plan's structure with the sizes that
varied among those steps scaled by ``r / r_max`` and the others at their most seen: a request
larger than its place goes to best fit alone; after the step the plan is re-made exactly);
``plan-record-all`` (a record only when ``r`` passes every plan's ``r_max``: a step of another
structure whose ``r`` a plan of its own covers is not planned at its first request).
``expected_records``: the record steps a run of ``n`` i.i.d. shape draws expects. Run from the
repository root::

    PYTHONPATH=$PWD python tools/profile/max_plan.py [TRACE ...] [--passes N]

Output: per trace and replay, the peak MiB and its ratio to the floor; the re-plans; the share
of the steps' requests served at their slot; and the steady peak, the most bytes to the highest
live block's end from the step after the last re-plan on (page rounded): what a range that
gave back its unused top would hold then. The run's peak is what an out-of-memory error sees.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))

import _models  # noqa: E402
import numpy as np  # noqa: E402
import placement_model as pm  # noqa: E402
import scaled_plan  # noqa: E402

from gpupool.region import placement  # noqa: E402

MARGIN = 0.05               # -margin: the share added to the reference's sizes
VARIANTS = {
    "plan-max": {},
    "plan-max-request": {"misfit": "request"},
    "plan-max-floor": {"by": "floor"},
    "plan-max-envelope": {"by": "envelope"},
    "plan-max-margin": {"margin": MARGIN},
    "plan-max-one": {"one": True},
    "plan-record": {"by": "envelope", "record": "structure"},
    "plan-record-all": {"by": "envelope", "record": "all"},
}


def _measure(step, first_raw, by):
    """A step's size for choosing the reference: its first request's requested bytes (``r``)
    or its floor in bytes."""
    if by == "floor":
        keep = step.planned
        return placement.floor_bytes(step.nbytes[keep], step.alloc[keep], step.free[keep],
                                     step.length)
    return int(first_raw)


def fixed_rows(mem, where, step, uids):
    """The blocks live after ``step`` (its allocations' ``uids``) as ``placement.plan``'s
    fixed rows for a step of its structure: the step's tails until the structure frees them,
    any other block for good (an escaped request, a block of the prelude)."""
    tail_free = {uids[k]: int(step.free[k] - step.length) for k in np.flatnonzero(step.tails)}
    rows = [(at, mem.used[at], 0, tail_free.get(uid, pm.NEVER)) for uid, at in where.items()]
    return np.array(rows, np.int64).reshape(-1, 4)


class _Kept:
    """One structure's plan: the ``placement.Plan``, the reference's measure (the most it
    covers), and the events it expects (``scaled_plan.expected_events``); ``r_max``: the most
    first-request bytes over the structure's steps it was made from, ``varied``: which of its
    requests' sizes differed among them (record: those scale)."""

    def __init__(self, plan, covers, r_max=0, varied=None):
        self.plan, self.covers, self.r_max, self.varied = plan, covers, r_max, varied
        self.kind, self.index = scaled_plan.expected_events(plan.step)


def predicted(kept, first_raw):
    """A record step's sizes as ``kept`` predicts them from its first request's requested
    bytes ``first_raw``: the requests whose sizes varied scaled by ``first_raw / r_max`` from
    the plan's (their most seen), the others at the plan's; a ``placement.Step`` of the plan's
    structure."""
    step = kept.plan.step
    scaled = np.ceil(step.nbytes * (first_raw / kept.r_max) / pm.ALIGN) * pm.ALIGN
    nbytes = np.where(kept.varied, np.maximum(scaled, step.nbytes), step.nbytes)
    return placement.Step(nbytes.astype(np.int64), step.alloc, step.free, step.stream,
                          step.length)


def simulate_max(events, step_at, raw, by="r", misfit="rest", margin=0.0, one=False,
                 record=None):
    """Replay ``events`` with plans of the largest step (module docstring); ``raw``: each
    allocation uid's requested bytes.

    Parameters
    ----------
    by : {"r", "floor", "envelope"}
        The reference's measure, or the elementwise largest sizes seen.
    misfit : {"rest", "request"}
        What a request larger than its slot sends to best fit.
    margin : float
        The share added to the reference's sizes (and to the ``r`` its plan covers).
    one : bool
        One plan in all, instead of one per structure.
    record : {None, "structure", "all"}
        A step of a planned structure whose first request's requested bytes pass the plan's
        ``r_max`` (a record; ``"all"``: and every plan's) is served from a plan made at that
        request of its predicted sizes (``predicted``; a request larger than its slot goes to
        best fit alone).

    Returns
    -------
    dict
        peak and steady (bytes, page rounded), replans, requests (the steps' allocations),
        planned (those with a slot), served (at their slot), misfits, refused, slowest ms;
        records (steps whose first request's bytes pass every earlier step's of their
        structure), record_ms (each request-0 plan's ms, in step order), record_off (those
        planned steps that left their plan: another structure).

    Raises
    ------
    ValueError
        An unknown ``by`` or ``misfit``.
    AssertionError
        Two slotted blocks meet (the argument above fails), or the arenas' tiling breaks.
    """
    if by not in ("r", "floor", "envelope") or misfit not in ("rest", "request"):
        raise ValueError("by must be 'r', 'floor' or 'envelope' and misfit 'rest' or 'request'")
    if record not in (None, "structure", "all"):
        raise ValueError("record must be None, 'structure' or 'all'")
    bounds, steps, mem, where = pm.steps_and_prelude(events, step_at)
    shadow, in_range = pm.Arena(), {}
    kept, seen = {}, {}
    out = dict(requests=0, planned=0, served=0, misfits=0, refused=0, replans=0, moved=0,
               ms=0.0, records=0, record_ms=[], record_off=0)
    prev_uids, clean, last_replan = [], None, -1
    reach = []                                # per step: the highest end live at its start
    top_alloc = []                            # per step: the highest end it allocated
    for s in range(len(step_at)):
        lo, hi = bounds[s], bounds[s + 1]
        ref = kept.get(steps[s - 1].structure()) if s else None
        # Only the tails of a step served to its end under this plan stay checked.
        for uid in [u for u in in_range if ref is None or clean is not ref]:
            shadow.release(in_range.pop(uid))
        reach.append(max((a + n for a, n in mem.used.items()), default=0))
        on_plan, uids, high, step_misfit, at_record = ref is not None, [], 0, misfit, False
        for t in range(lo, hi):
            op, uid, n = events[t]
            on_plan = on_plan and scaled_plan.follows(ref.kind, ref.index, t - lo, op, uid,
                                                      uids, prev_uids, in_range)
            if op:
                mem.release(where.pop(uid))
                if uid in in_range:
                    shadow.release(in_range.pop(uid))
                continue
            k = len(uids)
            uids.append(uid)
            out["requests"] += 1
            if record and on_plan and k == 0 and raw[uid] > (
                    ref.r_max if record == "structure" else
                    max(kp.r_max for kp in kept.values())):
                # A record: planned now for its predicted sizes around the blocks live now.
                made = placement.plan(predicted(ref, raw[uid]), budget_ms=1e6,
                                      max_requests=1 << 20,
                                      fixed=fixed_rows(mem, where, steps[s - 1], prev_uids))
                ref, step_misfit, at_record = _Kept(made, raw[uid]), "request", True
                out["record_ms"].append(made.planning_ms)
            at = None
            if on_plan and ref.plan.offsets[k] >= 0:
                out["planned"] += 1
                slot = int(ref.plan.offsets[k])
                if n > ref.plan.sizes[k]:
                    out["misfits"] += 1
                    on_plan = step_misfit == "request"
                else:
                    if not shadow.take_at(slot, n):
                        raise AssertionError(f"step {s} request {k}: slotted blocks meet")
                    if mem.take_at(slot, n):
                        at = in_range[uid] = slot
                        out["served"] += 1
                    else:
                        shadow.release(slot)
                        out["refused"] += 1
            where[uid] = mem.best_fit(n) if at is None else at
            high = max(high, where[uid] + n)
        top_alloc.append(high)
        done = ref is not None and on_plan and hi - lo == ref.plan.step.length
        out["record_off"] += at_record and not done
        clean, prev_uids = (ref if done else None), uids
        # Between steps: re-plan when this step repeats the one before and is larger than
        # its structure's reference.
        key = steps[s].structure()
        size = 0 if by == "envelope" else _measure(steps[s], raw[uids[0]], by)
        first = int(raw[uids[0]]) if uids else 0
        out["records"] += first > max((f for _, _, f in seen.get(key, ())), default=-1)
        seen.setdefault(key, []).append((size, steps[s], first))
        if not s or steps[s - 1].structure() != key:
            continue
        have = kept.get(key)
        r_max = max(f for _, _, f in seen[key])
        varied = (np.array([st.nbytes for _, st, _ in seen[key]]) != steps[s].nbytes).any(0)
        if by == "envelope":
            step = placement.envelope(st for _, st, _ in seen[key])
            grow = have is None or (steps[s].nbytes > have.plan.sizes).any()
        else:
            size, step, _ = max(seen[key], key=lambda seen_step: seen_step[0])
            grow = have is None or size > have.covers
            if margin:
                step = placement.Step(np.ceil(step.nbytes * (1 + margin)), step.alloc,
                                      step.free, step.stream, step.length)
        fixed = fixed_rows(mem, where, steps[s], uids)
        if not grow:
            # The same reference placed again when a block the plan does not know (one best
            # fit left for good, or a tail off its slot) holds a slot's bytes while it is used.
            if not pm.meets(have.plan, fixed):
                continue
            step, size, r_max, varied = have.plan.step, have.covers, have.r_max, have.varied
            out["moved"] += 1
        made = placement.plan(step, budget_ms=1e6, max_requests=1 << 20, fixed=fixed)
        if one:
            kept.clear()
        kept[key] = _Kept(made, size if not grow else size * (1 + margin), r_max, varied)
        out["replans"] += 1
        out["ms"] = max(out["ms"], made.planning_ms)
        last_replan = s
    out["peak"] = -(-mem.peak // pm.PAGE) * pm.PAGE
    after = last_replan + 1
    steady = max(reach[after:] + top_alloc[after:], default=0) if after < len(reach) else 0
    out["steady"] = -(-steady // pm.PAGE) * pm.PAGE
    mem.check()
    shadow.check()
    return out


def expected_records(draws, n):
    """The expected number of record steps among ``n`` steps whose ratio is drawn i.i.d.,
    each of ``draws`` equally likely (repeats weigh more): a step is a record when its ratio
    passes every earlier step's, the first step included.

    Step ``k`` (0-based) is a record with value ``v`` with probability ``p_v F(v)^k``,
    ``F(v)`` the probability of a draw below ``v``; summed over ``k``: ``sum_v p_v (1 -
    F(v)^n) / (1 - F(v))``. For ``n`` draws of distinct values (continuous) this is the
    harmonic number ``H_n ~ ln n + 0.577``. As ``n`` grows it tends to ``sum_v p_v / (1 -
    F(v))`` (``H_m`` for ``m`` equally likely values), below the number of distinct values.

    Raises
    ------
    ValueError
        No draws, or ``n < 0``.
    """
    draws = np.asarray(draws, np.float64)
    if not draws.size or n < 0:
        raise ValueError("expected records need draws and n >= 0")
    values, counts = np.unique(draws, return_counts=True)
    p = counts / draws.size
    below = np.concatenate(([0.0], np.cumsum(p)[:-1]))
    return float((p * (1 - below ** n) / (1 - below)).sum())


def shape_draws(batches, low, high):
    """Every equally likely ratio (batch x length) of ``bench/_models.batch_shapes``: a batch
    of ``batches``, a length uniform in ``[low, high]``."""
    return np.outer(batches, np.arange(low, high + 1)).ravel()


def report_expected(counts=(12, 45, 100, 1000, 10000)):
    """Print the expected record steps of the checkpointed workloads' draws and ``H_n``."""
    for name, (batches, low, high) in _models.CHECKPOINTED.items():
        draws = shape_draws(batches, low, high)
        cells = ", ".join(f"n={n}: {expected_records(draws, n):.2f}" for n in counts)
        print(f"{name} ({len(np.unique(draws)):,} ratios): expected records {cells},"
              f" n->inf: {expected_records(draws, 1 << 40):.2f}")
    harmonic = ", ".join(f"n={n}: {np.sum(1 / np.arange(1, n + 1)):.2f}" for n in counts)
    print(f"continuous (H_n): {harmonic}")


def run_variant(events, step_at, raw, name):
    """``simulate_max`` by a VARIANTS name."""
    return simulate_max(events, step_at, raw, **VARIANTS[name])


def main(argv=None):
    args = pm.arguments(__doc__, ("best",) + tuple(VARIANTS), argv)
    for events, step_at, raw, floor in pm.replays(args.traces, args.passes):
        for policy in args.policies.split(","):
            if policy in pm.ONLINE:
                pm.report_online(events, step_at, floor, policy)
                continue
            r = run_variant(events, step_at, raw, policy)
            print(f"  {policy}: {r['peak'] / pm.MiB:,.0f} MiB ({r['peak'] / floor:.3f}x);"
                  f" steady {r['steady'] / pm.MiB:,.0f} MiB ({r['steady'] / floor:.3f}x);"
                  f" {r['replans']} re-plans ({r['moved']} moved);"
                  f" served {r['served']:,} of {r['requests']:,} requests"
                  f" ({r['served'] / max(r['requests'], 1):.1%}), {r['misfits']:,}"
                  f" misfits, {r['refused']:,} refused; slowest {r['ms']:.0f} ms"
                  + (f"; {r['records']} record steps, {len(r['record_ms'])} planned at"
                     f" request 0 ({', '.join(f'{ms:.0f}' for ms in r['record_ms'])} ms),"
                     f" {r['record_off']} of them left it (another structure)"
                     if VARIANTS[policy].get("record") else ""), flush=True)
    if any(VARIANTS.get(policy, {}).get("record") for policy in args.policies.split(",")):
        report_expected()
    return 0

if __name__ == "__main__":
    sys.exit(main())
