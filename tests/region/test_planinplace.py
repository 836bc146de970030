"""A steady plan is installed without a transition plan when the blocks the entry before left
live meet none of its places while both are live (``Planner._in_place``): a tail freed
before any place it lies on is allocated is no obstacle (Note [Planning less often:
reasons] in docs/design.md)."""

import numpy as np
from planned_steps import (  # noqa: F401 (fixtures)
    SCALES,
    SIZE_ORDERS,
    Run,
    scaled,
    unmirrored,
    vpool,
    vsim,
)

from gpupool.region import placement
from gpupool.region.planned import Planner

MIB = 1 << 20
BASE = 1 << 30
# Requests 0 and 1 freed in the step; request 2 its tail, freed at the next entry's event 0.
STEP = placement.Step([MIB, MIB, MIB], [1, 2, 5], [3, 4, 6], [0, 0, 0], 6)


def placed(carried, obstacles=(), span=8 * MIB):
    """A planner that installs STEP's plan at BASE, the entry before having left ``carried``
    ((request, offset from BASE, bytes) rows) live; the planner and its (Plan, anchors)."""
    planner = Planner()
    k, offset, nbytes = np.array(carried, np.int64).reshape(-1, 3).T
    planner._recorded_steps.carried = (k, offset + BASE, nbytes)
    planner._wanted = (b"sig", STEP)
    return planner, planner.place(base=BASE, span=span, obstacles=list(obstacles))


def test_a_tail_freed_before_the_places_it_lies_on_needs_no_transition(unmirrored):
    planner, (plan, _) = placed([(2, MIB, MIB)])
    steady = planner.plans[-1]
    # The tail (request 2 of the entry before, freed at event 0) lies on request 1's place,
    # allocated at event 2: the steady plan serves at once.
    assert plan is steady and not planner._transition
    assert steady.offsets[1] == MIB and planner.counts["plans"] == 1


def test_a_block_left_live_for_good_on_a_place_needs_a_transition():
    # Request 0 of the entry before is no tail: live throughout the next entry.
    planner, (plan, _) = placed([(0, MIB, MIB)])
    assert planner._transition and planner.counts["plans"] == 2
    assert plan is not planner.plans[-1]
    assert plan.offsets[1] != MIB             # placed off the block's bytes


def test_a_kept_plan_under_blocks_that_stay_keeps_its_transition():
    planner = Planner()
    planner._wanted = (b"sig", STEP)
    planner.place(base=BASE, span=8 * MIB, obstacles=[])
    steady = planner.plans[-1]
    # The blocks that stay meet the kept plan, the plan around them does not fit: the kept
    # plan stays, and the transition is placed around them and the tail left live.
    planner._recorded_steps.carried = (np.array([2]), np.array([BASE + steady.offsets[1]]), np.array([MIB]))
    planner._wanted = (b"sig", STEP)
    plan, _ = planner.place(base=BASE, span=2 * MIB, obstacles=[(0, MIB // 2)])
    assert planner.plans[-1] is steady and planner._transition and plan is not steady


def test_a_planned_region_of_tails_freed_first_installs_its_plan_at_once(vpool):
    r = Run(vpool)
    for scale in SCALES:
        hits, misses = r.entry(scaled(scale))
    # The tail of the entry before is freed at the entry's start: one plan, no transition,
    # and every later entry served whole.
    assert r.region.stats().plans == 1 and not r.region.planner._transition
    assert (hits, misses) == (6, 0)
    r.close()


def test_a_block_at_a_tails_place_but_larger_than_it_needs_a_transition(unmirrored):
    # Request 1 is the tail (freed at the next entry's event 1), placed below request 0's
    # place, allocated at event 0. A block of the entry before at the tail's place but larger
    # than it (a record plan's predicted size, another structure's request) reaches request
    # 0's place while both are live: it is not the tail at its place.
    step = placement.Step([MIB, 2 * MIB, MIB], [0, 2, 4], [3, 7, 5], [0, 0, 0], 6)
    planner = Planner(strategies=SIZE_ORDERS)
    planner._wanted = (b"sig", step)
    steady, _ = planner.place(base=BASE, span=8 * MIB, obstacles=[])
    assert steady.offsets[1] == 0 and steady.offsets[0] == 2 * MIB
    planner._recorded_steps.carried = (np.array([1]), np.array([BASE]), np.array([3 * MIB]))
    planner._wanted, planner._fresh = (b"sig", step), True
    plan, _ = planner.place(base=BASE, span=8 * MIB, obstacles=[])
    assert planner._transition and plan is not steady
    # The steady plan would miss request 0 (its bytes held); the transition serves it.
    carried = [(0, 3 * MIB, 1, -1)]
    assert not placement.servable(steady, step, carried)[0]
    assert placement.servable(plan, step, carried).all()
