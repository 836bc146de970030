"""The work a planned region does at an exit besides the greedy placement: the plan goes to
the core, and the blocks in its way to the planner, as arrays (no Python loop over the
step's requests), each step's masks are made once per layout, not once per block the entry
left live, and a plan's floor only when it is asked for (Note [Planner bookkeeping])."""

import numpy as np
from planned_steps import Run, scaled, vpool, vsim  # noqa: F401 (fixtures)

from gpupool.region import placement, planned

# A step of 40 requests, 20 of them tails (live at the exit, freed by the next entry).
N = 40
SIZES = [(1 + k % 7) << 20 for k in range(N)]
FREES = [None if k < 2 or k % 2 else k - 2 for k in range(N)]
TAILS = set(range(1, N, 2))
SCALES = [1.0, 1.0, 1.0, 0.7, 0.9, 0.6, 0.8, 0.75, 0.95, 0.65, 1.0, 0.85]


def sized(scale):
    return [int(n * scale) // 512 * 512 for n in SIZES]


def run(pool, **region):
    r = Run(pool, **region)
    for scale in SCALES:
        r.entry(sized(scale), FREES, TAILS)
    return r


class Counted(np.ndarray):
    """An int64 array that counts the Python-level reads of its items."""

    reads = 0

    def __getitem__(self, key):
        Counted.reads += 1
        return super().__getitem__(key)


def test_a_plan_goes_to_the_core_without_a_loop_over_its_requests(vpool, monkeypatch):
    place, installs = planned.Planner.place, []

    def counted(self, *args):
        placed = place(self, *args)
        if placed is not None:
            plan, anchors = placed
            plan.offsets = plan.offsets.view(Counted)
            installs.append(len(plan.offsets))
            placed = plan, anchors.view(Counted)
        return placed
    monkeypatch.setattr(planned.Planner, "place", counted)
    r = run(vpool)
    assert installs and r.region.stats().plan_hits
    assert Counted.reads <= 4 * len(installs) < N


def test_the_blocks_in_a_plans_way_reach_the_planner_as_an_array(vpool, monkeypatch):
    place, seen = planned.Planner.place, []

    def spy(self, base, span, obstacles):
        seen.append(obstacles)
        return place(self, base, span, obstacles)
    monkeypatch.setattr(planned.Planner, "place", spy)
    run(vpool)
    assert seen
    assert all(isinstance(o, np.ndarray) and o.dtype == np.int64 and o.ndim == 2 and
               o.shape[1] == 2 for o in seen)


def test_a_steps_tails_mask_is_made_once_per_plan_not_per_block_left_live(vpool,
                                                                          monkeypatch):
    made = [0]

    def tails(step):
        made[0] += 1
        return step.free >= step.length
    monkeypatch.setattr(placement.Step, "tails", property(tails))
    layouts = [0]
    place = planned.Planner.place

    def counted(self, *args):
        layouts[0] += 1
        return place(self, *args)
    monkeypatch.setattr(planned.Planner, "place", counted)
    r = run(vpool)
    stats = r.region.stats()
    assert stats.plans >= 1 and stats.plan_hits
    # Each layout reads it a few times (the blocks left live, the transition's pins, the
    # conflicts table); one read per tail left live would be 20 a layout more.
    assert made[0] <= 6 * layouts[0] < len(TAILS) * layouts[0]


def test_a_plans_floor_is_made_only_when_asked_for(vpool, monkeypatch):
    calls = [0]
    floor = placement.step_floor

    def counted(step):
        calls[0] += 1
        return floor(step)
    monkeypatch.setattr(placement, "step_floor", counted)
    r = run(vpool)
    assert r.region.stats().plans and calls[0] == 0
    for plan in r.region.planner.plans:
        keep = plan.step.planned
        assert plan.floor == placement.floor_bytes(
            plan.step.nbytes[keep], plan.step.alloc[keep], plan.step.free[keep],
            plan.step.length) <= plan.nbytes
    assert calls[0] == len(r.region.planner.plans)
