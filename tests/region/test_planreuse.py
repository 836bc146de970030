"""A planned region does not place the same inputs twice: a plan made from the same step, the
same blocks in its way and the same pinned places as one made before is that one, reused
(``Planner._placed``; Note [Planning less often: reasons] in docs/design.md)."""

import itertools

import numpy as np
from conftest import check_invariants
from planned_steps import MIB, Checked, vpool, vsim  # noqa: F401 (fixtures)

import gpupool
from gpupool.region import placement, planned
from gpupool.region.planned import Planner
from gpupool.testing import SimulatedDevice

# Two structures taking turns (sizes per request; the last one the entry's tail), each exit
# installing the other's plan through a transition: the tail of the entry before is freed
# after request 0, whose place it may hold.
A = [1 * MIB, 2 * MIB, 3 * MIB, 4 * MIB]
B = [2 * MIB, 3 * MIB, 1 * MIB, MIB // 2, 5 * MIB]


def alternating(pool, entries=24):
    """A planned region's entries of A and B in turn; per entry (hits, misses, the
    addresses of its requests), and the region."""
    region, mem, seen = gpupool.Region(pool=pool, collect=None, plan=True), Checked(pool), []
    for k in range(entries):
        sizes, before = (A, B)[k % 2], region.stats()
        with region:
            addrs = [mem.allocate(("step", k, 0), sizes[0]).ptr]
            if ("tail", k - 1) in mem.live:
                mem.free(("tail", k - 1))
            addrs += [mem.allocate(("step", k, j), n).ptr for j, n in enumerate(sizes[1:-1], 1)]
            for key in [key for key in mem.live if key[0] == "step"]:
                mem.free(key)
            addrs.append(mem.allocate(("tail", k), sizes[-1]).ptr)
        check_invariants(pool)
        after = region.stats()
        seen.append((after.plan_hits - before.plan_hits,
                     after.plan_misses - before.plan_misses, addrs))
    return seen, region


def test_structures_taking_turns_stop_planning_once_their_transitions_are_made(vpool):
    _, region = alternating(vpool, 12)
    plans = region.stats().plans
    _, more = alternating(gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 32,
                                                                virtual_memory=True)), 24)
    assert more.stats().plans == plans
    assert more.stats().plans_reused >= 12


def test_a_reused_plan_serves_as_the_plan_made_again(vpool, monkeypatch):
    reused, _ = alternating(vpool)
    fresh = itertools.count()       # every plan's inputs new: each placed again
    monkeypatch.setattr(planned, "_digest", lambda *args: next(fresh))
    monkeypatch.setattr(planned, "_TRANSITIONS_MAX", 1 << 30)   # (so none is given up for it)
    made, region = alternating(gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 32,
                                                                     virtual_memory=True)))
    assert region.stats().plans_reused == 0 and region.stats().plans > 12
    base_reused, base_made = reused[0][2][0], made[0][2][0]
    for (h1, m1, a1), (h2, m2, a2) in zip(reused, made, strict=True):
        assert (h1, m1) == (h2, m2)
        assert [a - base_reused for a in a1] == [a - base_made for a in a2]


STEP = placement.Step([1 << 20, 2 << 20, 1 << 20], [0, 1, 2], [3, 4, 5], [0, 0, 0], 6)


def test_a_kept_plan_met_by_blocks_is_not_placed_again_around_the_same_blocks():
    planner = Planner()
    planner._wanted = (b"sig", STEP)
    planner.place(base=1 << 30, span=8 << 20, obstacles=[])
    assert planner.counts["plans"] == 1          # nothing left live: no transition
    kept = planner.plans[-1]
    # A block that stays meets the kept plan, and the plan around it does not fit: the kept
    # one stays. The next exits bring the same block and step: nothing is placed again.
    for plans in (2, 2, 2):
        planner._wanted = (b"sig", STEP)
        plan, _ = planner.place(base=1 << 30, span=4 << 20, obstacles=[(0, 1 << 20)])
        assert plan is kept and planner.counts["plans"] == plans
    assert planner.counts["reused"] == 2
    # Other blocks are other inputs: placed anew.
    planner._wanted = (b"sig", STEP)
    planner.place(base=1 << 30, span=4 << 20, obstacles=[(1 << 20, 1 << 20)])
    assert planner.counts["plans"] == 3


def test_the_plans_kept_for_reuse_are_bounded():
    planner = Planner(max_plan_requests=7)
    for k in range(planned.REUSE_MAX + 4):
        planner._placed(STEP, np.array([[0, (k + 1) << 12]], np.int64))
        assert sum(len(p.offsets) for p in planner._made_from.values()) <= 7
    many = Planner()
    for k in range(planned.REUSE_MAX + 4):
        many._placed(STEP, np.array([[0, (k + 1) << 12]], np.int64))
    assert len(many._made_from) == planned.REUSE_MAX
    # The oldest were dropped: placed again; the newest are reused.
    many._placed(STEP, np.array([[0, 1 << 12]], np.int64))
    many._placed(STEP, np.array([[0, (planned.REUSE_MAX + 4) << 12]], np.int64))
    assert many.counts["plans"] == planned.REUSE_MAX + 5 and many.counts["reused"] == 1


def test_a_plan_with_other_options_is_placed_anew():
    planner = Planner()
    planner._placed(STEP, np.zeros((0, 2), np.int64))
    planner.budget_work = 1
    planner._placed(STEP, np.zeros((0, 2), np.int64))
    planner.budget_work, planner.strategies = placement.BUDGET_WORK, ("size",)
    planner._placed(STEP, np.zeros((0, 2), np.int64))
    assert planner.counts["plans"] == 3 and planner.counts["reused"] == 0


def test_a_plan_cut_by_the_wall_clock_is_not_reused():
    # budget_ms is a safety net of wall-clock time: a plan it cut short depends on the
    # machine's load, not on its inputs alone, so the same inputs are placed again.
    n = 200
    alloc = 2 * np.arange(n)
    step = placement.Step(np.full(n, 1 << 20), alloc, alloc + 3, np.zeros(n, np.int64), 2 * n)
    planner = Planner(budget_ms=1e-6)
    fixed = np.zeros((0, 2), np.int64)
    first = planner._placed(step, fixed)
    assert first.fallback == "time"
    again = planner._placed(step, fixed)
    assert again is not first and planner.counts["plans"] == 2
    assert planner.counts["reused"] == 0
