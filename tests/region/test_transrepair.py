"""A transition is repaired from its steady plan, not placed whole, where few of the steady places
meet the blocks it must be placed around (``Planner._transition_repaired``): those places are
placed again, every other request keeps its steady place, and the repair is used when it maps
no more than the plan placed whole would (Note [Transitions repaired] in docs/design.md)."""

import numpy as np
from hypothesis import given, settings, strategies as st
from planned_steps import recorded, unmirrored  # noqa: F401 (fixture)
from test_placement import clashes, steps

from gpupool.region import placement, planned, tails
from gpupool.region.meeting import meeting
from gpupool.region.planned import Planner

MIB = 1 << 20
BASE = 1 << 30
# 33 requests of 1 MiB, all live until the step's end: the steady plan stacks them, request
# k at k MiB (the greedy's order: the same size, the earliest allocated first).
N = 33
STEP = placement.Step([MIB] * N, np.arange(N), np.full(N, N), np.zeros(N), N + 1)


def transition(carried, span=64 * MIB, obstacles=(), **options):
    """A planner that installs STEP's steady plan at BASE, then its transition around
    ``carried`` ((request of the entry before, offset from BASE, bytes) rows), as after an
    install of another signature: (planner, steady plan, transition plan)."""
    planner = Planner(**options)
    planner._wanted = (b"sig", STEP)
    steady, _ = planner.place(base=BASE, span=span, obstacles=[])
    k, offset, nbytes = np.array(carried, np.int64).reshape(-1, 3).T
    planner._recorded_steps.carried = (k, offset + BASE, nbytes)
    planner._wanted, planner.current = (b"sig", STEP), b"other"
    plan, _ = planner.place(base=BASE, span=span, obstacles=list(obstacles))
    assert planner._transition
    return planner, steady, plan


def served(plan, carried):
    """Which of STEP's requests ``plan`` serves with the ``carried`` blocks (none a tail of
    STEP's: each held throughout the entry) in the range."""
    return placement.servable(plan, STEP, [(off, n, placement.ESCAPED, -1)
                                           for _, off, n in carried])


def test_a_block_on_one_steady_place_moves_that_request_alone(unmirrored):
    carried = [(N + 1, 5 * MIB, MIB)]       # no request of STEP's: live throughout
    planner, steady, plan = transition(carried)
    assert steady.offsets[5] == 5 * MIB and steady.nbytes == N * MIB
    assert planner.counts["transition_repairs"] == planner.counts["repairs"] == 1
    assert planner.counts["plans"] == 2               # the steady plan, the repair
    others = np.arange(N) != 5
    assert (plan.offsets[others] == steady.offsets[others]).all()
    assert plan.offsets[5] == N * MIB and plan.nbytes == (N + 1) * MIB
    # The same hits as the plan placed whole, at a fraction of its work; no overlap.
    _, _, whole = transition(carried, repair=False)
    assert served(plan, carried).all() and served(whole, carried).all()
    assert plan.nbytes == whole.nbytes and plan.work * 8 < whole.work
    assert clashes(plan) == []


def test_no_repair_where_the_places_to_move_do_not_fit_above_the_steady_plan():
    # The memory mapped ends at the steady plan's top: the moved place would map a page.
    planner, steady, plan = transition([(N + 1, 5 * MIB, MIB)], span=N * MIB)
    assert planner.counts["plans"] == 2 and planner.counts["transition_repairs"] == 0
    assert planner.counts["repairs_refused"] == 0 and plan.offsets[5] != steady.offsets[5]


def test_a_repair_past_the_memory_mapped_is_used_when_no_higher_than_the_whole_plan(unmirrored):
    # A block left live just above the steady plan's top (no place meets it) pushes the moved
    # place past the memory mapped: the plan placed whole is made too, and maps as much.
    carried = [(N + 1, 5 * MIB, MIB), (N + 2, N * MIB, MIB)]
    planner, steady, plan = transition(carried, span=(N + 1) * MIB)
    assert planner.counts["plans"] == 3 and planner.counts["transition_repairs"] == 1
    assert plan.offsets[5] == (N + 1) * MIB and planner.counts["repairs_refused"] == 0
    others = np.arange(N) != 5
    assert (plan.offsets[others] == steady.offsets[others]).all()


def test_a_transition_where_many_places_meet_the_blocks_is_placed_whole():
    carried = [(N + 1, 4 * MIB, 3 * MIB)]     # 3 of 33 places: more than 1 in REPAIR_SHARE
    assert planned.REPAIR_SHARE * 3 > N
    planner, _, plan = transition(carried)
    assert planner.counts["transition_repairs"] == planner.counts["repairs"] == 0
    _, _, whole = transition(carried, repair=False)
    assert (plan.offsets == whole.offsets).all() and served(plan, carried).all()


def test_a_block_that_stays_on_a_steady_place_moves_it_too(unmirrored):
    # A kept plan under a block that stays (the one around it does not fit the span): its
    # transition is placed around that block too. Here the places to move do not fit above
    # the steady plan in the memory mapped: the transition is placed whole; with room, the
    # repair moves the places under that block and under the blocks left live.
    planner = Planner()
    planner._wanted = (b"sig", STEP)
    steady, _ = planner.place(base=BASE, span=N * MIB, obstacles=[])
    planner._recorded_steps.carried = (np.array([N + 1]), np.array([BASE + 9 * MIB]), np.array([MIB]))
    planner._wanted, planner.current = (b"sig", STEP), b"other"
    obstacles = np.array([(20 * MIB, MIB)])
    plan, _ = planner.place(base=BASE, span=N * MIB, obstacles=obstacles)
    assert planner.plans[-1] is steady and planner._transition
    assert planner.counts["transition_repairs"] == 0 and plan.offsets[20] != 20 * MIB
    fixed = planner._fixed(STEP, BASE, obstacles)
    repair = planner._transition_repaired(STEP, steady, fixed, np.full(N, -1), 64 * MIB)
    moved = np.flatnonzero(repair.offsets != steady.offsets).tolist()
    assert moved == [9, 20] and repair.offsets[moved].min() >= N * MIB


def test_repair_off_places_every_transition_whole():
    planner, _, _ = transition([(N + 1, 5 * MIB, MIB)], repair=False)
    assert planner.counts["transition_repairs"] == planner.counts["repairs"] == 0


@settings(max_examples=150, deadline=None)
@given(steps(max_requests=40), st.data())
def test_a_transition_never_meets_the_blocks_it_is_placed_around(step, data):
    """Random steps and blocks left live (some at their tails' steady places): the transition,
    repaired or whole, overlaps nothing but where the plan placed whole does too (a tail
    pinned at its steady place), keeps the steady places it does not move, and is no higher
    than the plan placed whole unless within the memory mapped."""
    planner = Planner()
    planner._wanted = (b"sig", step)
    steady, _ = planner.place(base=BASE, span=1 << 40, obstacles=[])
    tails = np.flatnonzero(step.tails & step.planned)
    rows = [(int(k), int(steady.offsets[k]), int(step.nbytes[k]))
            for k in tails if data.draw(st.booleans())]
    for _ in range(data.draw(st.integers(0, 3))):
        rows.append((len(step) + 1, data.draw(st.integers(0, 64)) * 512 * 1024,
                     data.draw(st.integers(1, 16)) * 512 * 1024))
    rows = [r for r in rows if not any(r[1] < o + n and o < r[1] + r[2] and r != (k, o, n)
                                       for k, o, n in rows)]      # live blocks share no bytes
    span = data.draw(st.sampled_from([steady.nbytes, 1 << 40]))
    plans = []
    for repair in (True, False):
        p = Planner(repair=repair)
        p._wanted = (b"sig", step)
        p.place(base=BASE, span=span, obstacles=[])
        k, offset, nbytes = np.array(rows, np.int64).reshape(-1, 3).T
        p._recorded_steps.carried = (k, offset + BASE, nbytes)
        p._wanted, p.current = (b"sig", step), b"other"
        placed = p.place(base=BASE, span=span, obstacles=[])
        if placed is None or not p._transition:
            return
        plans.append((p, placed[0]))
    (p, plan), (_, whole) = plans
    assert clashes(plan) == []
    fixed = p._fixed(step, BASE, np.zeros((0, 2), np.int64))
    met = meeting(plan, *fixed[:, [0, 1, 3]].T)
    assert not (met & ~step.tails).any() or plan.fallback is not None
    assert (met <= meeting(whole, *fixed[:, [0, 1, 3]].T) | ~step.tails).all()
    assert (plan.offsets[step.tails] == steady.offsets[step.tails]).all()
    if p.counts["transition_repairs"]:
        moved = plan.offsets != steady.offsets
        assert planned.REPAIR_SHARE * int(moved.sum()) <= int(step.planned.sum())
        assert plan.nbytes <= max(span, whole.nbytes)


def test_llama_ckpts_replay_repairs_transitions_with_the_same_hits_and_less_work(monkeypatch):
    """The recorded llama-ckpt trace (30 steps) replayed under a planned region on the
    simulated device (tools/profile/long_replay.py): its transitions after an install are
    repaired, served with the same hits and misses at the same peak as placed whole, for
    less greedy work. The rule that takes the blocks left live as freed at the entry's start
    (``tails.freed_first``) is off: with it, the replay makes no transition
    (tests/region/test_tailsfirst.py)."""
    monkeypatch.setattr(tails, "freed_first", lambda events, ptr: False)
    trace, long_replay = recorded(monkeypatch, "llama-ckpt")
    repairs = []
    monkeypatch.setattr(Planner, "_transition_repaired", _counted(repairs))
    (_, _, peak, _, stats), = long_replay.long_replay(trace, 0, plan=True)
    monkeypatch.setattr(Planner, "_transition_repaired", lambda *args: None)
    (_, _, whole_peak, _, whole), = long_replay.long_replay(trace, 0, plan=True)
    used = sum(made is not None for made in repairs)
    assert used >= 1 and stats.plans_repaired == whole.plans_repaired + used
    assert stats.plans_transitions_repaired == used and whole.plans_transitions_repaired == 0
    assert (stats.plan_hits, stats.plan_misses) == (whole.plan_hits, whole.plan_misses)
    assert peak == whole_peak and stats.planning_work < whole.planning_work


def _counted(made):
    """Planner._transition_repaired, each result appended to ``made``."""
    original = Planner._transition_repaired

    def repaired(planner, *args):
        made.append(original(planner, *args))
        return made[-1]
    return repaired
