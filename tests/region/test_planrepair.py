"""A kept plan of a step that grew a little is repaired, not placed again whole: the requests
that did not grow keep their places, those that grew are placed around them, and the repair is
used when it needs no more bytes than the kept plan (``Planner._repaired``; Note [Planning
less often: reasons] in docs/design.md)."""

import numpy as np
import pytest
from planned_steps import KIB, MIB, Run, unmirrored, vpool, vsim  # noqa: F401 (fixtures)

from gpupool.region import placement, planned
from gpupool.region.planned import Planner

BASE = 1 << 30
# A long-lived request 0 (8 MiB) and 32 short ones after it, one at a time, each freed before
# the next: 1 MiB and 512 KiB in turn, all at request 0's end, where a 512 KiB one has room to
# grow up to 1 MiB. No request is a tail: the step leaves nothing live.
N = 33
ALLOC = np.arange(N) * 2
FREE = np.concatenate([[2 * N], ALLOC[1:] + 1])
SIZES = np.array([8 * MIB] + [MIB if k % 2 else MIB // 2 for k in range(1, N)])


def step(sizes):
    return placement.Step(sizes, ALLOC, FREE, np.zeros(N), 2 * N + 1)


def planner_with_plan(**options):
    """A planner with SIZES' plan kept at BASE, and that plan."""
    planner = Planner(**options)
    planner._wanted = (b"sig", step(SIZES))
    plan, _ = planner.place(base=BASE, span=64 * MIB, obstacles=[])
    return planner, plan


def grown(sizes, span=64 * MIB, obstacles=(), **options):
    """The plan placed for ``sizes`` after SIZES' was kept: (planner, old plan, new plan)."""
    planner, old = planner_with_plan(**options)
    planner._wanted = (b"sig", step(sizes))
    plan, _ = planner.place(base=BASE, span=span, obstacles=list(obstacles))
    return planner, old, plan


def test_a_request_grown_into_the_room_beside_it_is_a_repair_of_the_kept_plan():
    sizes = SIZES.copy()
    sizes[2] = 768 * KIB                    # under the 1 MiB ones' top: the top stays
    planner, old, plan = grown(sizes)
    assert planner.counts["repairs"] == 1 and planner.counts["repairs_refused"] == 0
    assert planner.counts["plans"] == 2 and plan is planner.plans[-1]
    assert (plan.sizes == step(sizes).nbytes).all() and plan.nbytes == old.nbytes
    others = np.arange(N) != 2
    assert (plan.offsets[others] == old.offsets[others]).all()
    # Only the grown request was placed: a fraction of a whole plan's work.
    whole = placement.plan(step(sizes), strategies=planned.STRATEGIES)
    assert plan.work * 8 < whole.work


def test_a_repair_that_raises_the_top_is_refused_and_the_step_placed_whole():
    sizes = SIZES.copy()
    sizes[2] = 4 * MIB                      # past the room there: above the kept top
    planner, old, plan = grown(sizes)
    assert planner.counts["repairs"] == 0 and planner.counts["repairs_refused"] == 1
    _, _, whole = grown(sizes, repair=False)
    assert (plan.offsets == whole.offsets).all() and plan.nbytes > old.nbytes


def test_a_step_where_many_requests_grew_is_placed_whole_without_a_repair():
    sizes = SIZES.copy()
    sizes[1:5] += 4 * KIB                   # 4 of 33: more than 1 in REPAIR_SHARE
    assert planned.REPAIR_SHARE * 4 > N
    planner, _, plan = grown(sizes)
    assert planner.counts["repairs"] == planner.counts["repairs_refused"] == 0
    _, _, whole = grown(sizes, repair=False)
    assert (plan.offsets == whole.offsets).all()


def test_no_repair_when_blocks_that_stay_meet_the_kept_plan(unmirrored):
    sizes = SIZES.copy()
    sizes[2] = 768 * KIB
    planner, old, _ = grown(sizes, obstacles=[(0, MIB)])     # on request 0's place
    assert old.offsets[0] == 0
    assert planner.counts["repairs"] == planner.counts["repairs_refused"] == 0


def test_repair_off_places_the_grown_step_whole():
    sizes = SIZES.copy()
    sizes[2] = 768 * KIB
    planner, _, _ = grown(sizes, repair=False)
    assert planner.counts["repairs"] == 0 and planner.counts["plans"] == 2


@pytest.mark.parametrize("value", [1, None, "yes"])
def test_repair_must_be_a_bool(value):
    with pytest.raises(TypeError, match="repair must be a bool"):
        Planner(repair=value)


def test_a_planned_region_repairs_its_plan_when_a_request_grows_and_serves_it_whole(vpool):
    frees = [None] + list(range(1, N))      # each short request freed at once
    base = [int(n) for n in SIZES]
    r = Run(vpool)
    for _ in range(4):
        r.entry(base, frees=frees, tails=set())
    bigger = list(base)
    bigger[2] = 768 * KIB
    for _ in range(3):
        hits, misses = r.entry(bigger, frees=frees, tails=set())
    stats = r.region.stats()
    assert stats.plans_repaired == 1 and (hits, misses) == (N, 0)
    r.close()


def test_a_planned_region_s_stats_count_a_refused_repair(vpool):
    frees = [None] + list(range(1, N))
    base = [int(n) for n in SIZES]
    r = Run(vpool)
    for _ in range(4):
        r.entry(base, frees=frees, tails=set())
    bigger = list(base)
    bigger[2] = 4 * MIB                     # above the kept top: the repair is refused
    for _ in range(3):
        r.entry(bigger, frees=frees, tails=set())
    stats, counts = r.region.stats(), r.region.planner.counts
    assert stats.plans_repairs_refused == counts["repairs_refused"] >= 1
    assert stats.plans_repaired == stats.plans_transitions_repaired == 0
    r.close()
