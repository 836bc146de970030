"""The offline placement model (tools/profile/placement_model.py) on made-up traces: no policy
places two live blocks on one byte, none reserves below the floor, a planned policy plans only
steps whose shape the two steps before share, and a step that scales as predicted is served at
its planned places; plans of the largest step keep their slotted blocks apart."""

import os
import sys

import numpy as np
import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tools", "profile"))

import alloc_trace  # noqa: E402
import max_plan  # noqa: E402
import placement_model  # noqa: E402
import scaled_plan  # noqa: E402

from gpupool.region import placement  # noqa: E402

A, F = alloc_trace.ALLOC, alloc_trace.FREE
MiB = 1 << 20


def varying_trace(scales, extra_at=None):
    """Parameters kept to the end, then a step per scale: an input and activations of that
    scale, a big short-lived chain at the loss, gradients of fixed sizes freed early in the
    next step. ``extra_at``: a step with one more activation (another structure)."""
    rows, live, starts = [], {}, []

    def alloc(n):
        i = sum(1 for r in rows if r[0] == A)
        rows.append((A, i, n, 0))
        live[i] = n
        return i

    def free(i):
        rows.append((F, i, live.pop(i), 0))

    for n in (3, 5, 7):                     # the parameters
        alloc(n * MiB + 100)
    grads = []
    for s, c in enumerate(scales):
        starts.append(len(rows))
        x = alloc(c * MiB)
        for g in grads:
            free(g)
        acts = [alloc(c * (k + 2) * MiB) for k in range(4 + (s == extra_at))]
        chain = [alloc(c * 16 * MiB), alloc(c * 32 * MiB)]
        free(chain[0])
        chain.append(alloc(c * 32 * MiB))
        for i in chain[1:]:
            free(i)
        grads = [alloc(n * MiB + 100) for n in (3, 5, 7)]
        for i in [x] + acts[::-1]:
            free(i)
    return alloc_trace.Trace("varying", *zip(*rows, strict=True),
                             meta={"step_starts": starts})


@pytest.mark.parametrize("passes", [0, 2])
def test_every_policy_keeps_live_blocks_apart_and_reserves_at_least_the_floor(passes):
    events, step_at = placement_model.expand(varying_trace([1, 3, 2, 4, 1, 3]), passes)
    floor = placement_model.floor_bytes(events)
    for policy in placement_model.ONLINE:
        for oracle in (False, True):
            assert placement_model.simulate(events, step_at, policy, oracle) >= floor
    for how in placement_model.PLANNED:
        out = placement_model.simulate_planned(events, step_at, how)   # checks the tiling
        assert out["peak"] >= floor
        assert out["served"] <= out["planned"]


def test_a_step_that_scales_as_predicted_takes_its_planned_places():
    scales = [1, 3, 2, 4, 1, 3]
    events, step_at = placement_model.expand(varying_trace(scales), 0)
    out = placement_model.simulate_planned(events, step_at, "plan-scaled")
    # Steps 3.. are planned, at their first request: the two steps before each share one
    # structure (step 0 frees no gradients, so step 2 follows two shapes).
    assert out["plans"] == len(scales) - 3
    assert out["served"] >= out["planned"] * 0.9 > 0
    # The largest step (scale 4) is planned: best fit leaves the loss chain's first block a
    # hole the next one cannot use; the plan puts them where the floor is reached.
    floor = placement_model.floor_bytes(events)
    assert placement_model.simulate(events, step_at, "best") >= floor + 32 * MiB
    assert out["peak"] <= floor + placement_model.PAGE


def test_plans_are_kept_per_bucket_and_reused_and_plan_kept_serves_a_buckets_first_step_online():
    events, step_at = placement_model.expand(varying_trace([1, 3, 2, 3, 2, 3]), 0)
    out = placement_model.simulate_planned(events, step_at, "plan-bucket")
    assert out["plans"] + out["reused"] == 3
    assert out["reused"] >= 1
    # Planned after a bucket's first step: steps 3 and 4 (scales 3 and 2, new buckets) are
    # served by best fit, step 5 (scale 3 again) from the plan step 3 made.
    kept = placement_model.simulate_planned(events, step_at, "plan-kept")
    assert kept["plans"] + kept["reused"] == 3
    assert kept["planned"] == out["planned"] // 3 > 0 and kept["served"] > 0


def test_a_step_of_another_shape_is_not_planned():
    events, step_at = placement_model.expand(varying_trace([1, 3, 2, 4, 1, 3, 2], extra_at=3), 0)
    out = placement_model.simulate_planned(events, step_at, "plan-scaled")
    # Step 0 frees no gradients and step 3 makes one more activation: steps 4 and 5 follow a
    # step of another shape and are not planned; step 3 is planned on the shape of steps 1
    # and 2 (it misses where its requests differ), step 6 on that of steps 4 and 5.
    assert out["plans"] == 2


def test_arena_take_at_takes_only_free_bytes():
    arena = placement_model.Arena()
    a = arena.grow(4096)
    b = arena.grow(4096)
    assert not arena.take_at(a + 512, 512)          # inside a live block
    arena.release(a)
    assert arena.take_at(a + 512, 1024)             # inside the hole a left
    assert not arena.take_at(a, 1024)               # meets the block just taken
    assert arena.take_at(b + 8192, 512)             # past the top: the range grows
    assert arena.top == b + 8192 + 512
    arena.check()


def _raw_expand(trace, passes):
    raw = {}
    events, step_at = placement_model.expand(trace, passes, raw)
    return events, step_at, raw


@pytest.mark.parametrize("passes", [0, 2])
def test_scaled_plans_keep_the_ranges_blocks_apart_and_reserve_at_least_the_floor(passes):
    events, step_at, raw = _raw_expand(varying_trace([1, 3, 2, 4, 1, 3]), passes)
    floor = placement_model.floor_bytes(events)
    for policy in scaled_plan.POLICIES:
        # Raises AssertionError when a planned place is refused by a block of the range.
        out = scaled_plan.run_policy(events, step_at, raw, policy)
        assert out["peak"] >= floor
        assert out["served"] <= out["fit"] <= out["planned"]
        assert out["steps"] > 0 and out["served"] > 0


def test_scaled_places_of_blocks_live_at_once_never_meet_at_any_ratio():
    events, step_at, raw = _raw_expand(varying_trace([1, 3, 2, 4, 1, 3]), 0)
    bounds = step_at + [len(events)]
    rows = [(op, uid, n, 0) for op, uid, n in events]
    steps = [placement.record_step(rows, bounds[s], bounds[s + 1], bounds[min(s + 2, 6)])
             for s in range(6)]
    sizes = [steps[s].nbytes for s in (3, 4)]
    raws = [np.array([raw[u] for op, u, _ in events[bounds[s]:bounds[s + 1]] if not op])
            for s in (3, 4)]
    cls, k0 = scaled_plan.classify(sizes, raws, steps[4].tails)
    assert k0 == 0 and (cls == scaled_plan.LINEAR).sum() >= 7
    assert (cls[steps[4].tails] != scaled_plan.LINEAR).all()
    plan = scaled_plan.ScaledPlan(steps[4], cls, np.max(sizes, axis=0), raws[1],
                                  np.zeros((0, 4), np.int64), 0)
    step, keep = plan.step, np.flatnonzero(plan.cls != scaled_plan.UNPLANNED)
    for num, den in [(1, 1), (1, 3), (2, 3), (5, 3), (7, 2), (1000, 999), (999, 1000)]:
        places = {k: plan.place(k, (num, den)) for k in keep}
        for i in keep:
            for j in keep[keep > i]:
                if placement.overlaps(step.alloc[i], step.free[i], step.alloc[j], step.free[j],
                                      step.length):
                    (a, m), (b, n) = places[i], places[j]
                    assert a + m <= b or b + n <= a, (num, den, i, j)
        if num >= den:          # a request of the ratio's size fits its place (PAD)
            for k in keep[plan.cls[keep] == scaled_plan.LINEAR]:
                want = -(-step.nbytes[k] * num // den // 512) * 512
                assert want <= places[k][1]


def test_the_ranges_check_fails_when_two_planned_places_meet(monkeypatch):
    events, step_at, raw = _raw_expand(varying_trace([1, 3, 2, 4, 1, 3]), 0)
    monkeypatch.setattr(scaled_plan.ScaledPlan, "place", lambda self, k, ratio: (1 << 30, 1 << 40))
    with pytest.raises(AssertionError, match="planned blocks meet"):
        scaled_plan.simulate_scaled(events, step_at, raw)


@pytest.mark.parametrize("passes", [0, 2])
def test_plans_of_the_largest_step_keep_slotted_blocks_apart_and_reserve_at_least_the_floor(
        passes):
    events, step_at, raw = _raw_expand(varying_trace([1, 3, 2, 4, 1, 3]), passes)
    floor = placement_model.floor_bytes(events)
    for name in max_plan.VARIANTS:
        # Raises AssertionError when a slotted block is refused by another slotted one.
        out = max_plan.run_variant(events, step_at, raw, name)
        assert out["peak"] >= out["steady"] >= floor
        assert out["served"] <= out["planned"] <= out["requests"]
        assert out["replans"] > 0 and out["served"] > 0


def test_the_largest_step_is_planned_and_the_smaller_steps_are_served_whole_at_its_slots():
    scales = [1, 3, 2, 4, 1, 3]
    events, step_at, raw = _raw_expand(varying_trace(scales), 0)
    out = max_plan.simulate_max(events, step_at, raw)
    # After step 2 (the first to repeat the step before's structure) the plan of step 1
    # (scale 3, the largest seen); step 3 (scale 4) misfits at its first request and runs
    # online, then is planned; steps 4 and 5 (scales 1, 3) are served whole at its slots.
    assert out["replans"] == 2 and out["moved"] == 0
    assert out["misfits"] == 1 and out["refused"] == 0
    per_step = out["requests"] // len(scales)
    assert out["served"] == 2 * per_step
    # The run's peak is step 3's (online); from step 4 on the plan's.
    assert out["peak"] >= out["steady"]


def test_a_smaller_steps_blocks_stay_inside_the_largest_steps_slots():
    scales = [1, 3, 2, 4, 1, 3]
    events, step_at, raw = _raw_expand(varying_trace(scales), 0)
    bounds = step_at + [len(events)]
    rows = [(op, uid, n, 0) for op, uid, n in events]
    steps = [placement.record_step(rows, bounds[s], bounds[s + 1], bounds[min(s + 2, 6)])
             for s in range(6)]
    made = placement.plan(steps[3], budget_ms=1e6)
    for s in (1, 2, 4):
        step = steps[s]
        assert step.structure() == steps[3].structure()
        keep = np.flatnonzero(step.planned)
        assert (step.nbytes[keep] <= made.sizes[keep]).all()
        lo, hi = made.offsets, made.offsets + step.nbytes
        for i in keep:
            for j in keep[keep > i]:
                if placement.overlaps(step.alloc[i], step.free[i], step.alloc[j], step.free[j],
                                      step.length):
                    assert hi[i] <= lo[j] or hi[j] <= lo[i], (s, i, j)


def test_the_slotted_check_fails_when_two_slots_meet(monkeypatch):
    events, step_at, raw = _raw_expand(varying_trace([1, 3, 2, 4, 1, 3]), 0)
    real = placement.plan

    def stacked(step, **kwargs):
        made = real(step, **kwargs)
        made.offsets[:] = np.where(made.offsets >= 0, 1 << 30, -1)
        return made

    monkeypatch.setattr(max_plan.placement, "plan", stacked)
    with pytest.raises(AssertionError, match="slotted blocks meet"):
        max_plan.simulate_max(events, step_at, raw)


def test_max_plan_rejects_unknown_modes():
    events, step_at, raw = _raw_expand(varying_trace([1, 3, 2]), 0)
    with pytest.raises(ValueError, match="misfit"):
        max_plan.simulate_max(events, step_at, raw, misfit="never")
    with pytest.raises(ValueError, match="by must be"):
        max_plan.simulate_max(events, step_at, raw, by="area")
    with pytest.raises(ValueError, match="record must be"):
        max_plan.simulate_max(events, step_at, raw, record="always")


def test_a_record_step_is_planned_at_its_first_request_and_served_whole():
    scales = [1, 3, 2, 4, 1, 3]
    events, step_at, raw = _raw_expand(varying_trace(scales), 0)
    out = max_plan.run_variant(events, step_at, raw, "plan-record")
    # Step 3 (scale 4) passes the plan's r_max (step 1's scale 3): planned at its first
    # request for sizes scaled by 4/3, it fits them (its sizes scale exactly) and is served
    # whole; steps 4 and 5 at the slots of the plan re-made after it.
    assert len(out["record_ms"]) == 1 and out["record_off"] == 0
    assert out["misfits"] == 0 and out["refused"] == 0
    per_step = out["requests"] // len(scales)
    assert out["served"] == 3 * per_step
    # Records of their structure: step 0 and step 5 (the last: the replay shows no tails
    # freed after it), each a structure of its own; step 1 (the first of the rest), step 3.
    assert out["records"] == 4
    plain = max_plan.run_variant(events, step_at, raw, "plan-max-envelope")
    assert out["peak"] <= plain["peak"] and plain["record_ms"] == []


def test_a_record_step_of_another_structure_leaves_its_request_0_plan():
    events, step_at, raw = _raw_expand(varying_trace([1, 3, 2, 4, 1, 3], extra_at=3), 0)
    out = max_plan.run_variant(events, step_at, raw, "plan-record")
    assert len(out["record_ms"]) == 1 and out["record_off"] == 1


def test_the_slotted_check_covers_the_request_0_plan(monkeypatch):
    events, step_at, raw = _raw_expand(varying_trace([1, 3, 2, 4]), 0)
    real, calls = placement.plan, []

    def second_stacked(step, **kwargs):
        made = real(step, **kwargs)
        calls.append(step)
        if len(calls) == 2:                 # the record step's plan, made at its request 0
            made.offsets[:] = np.where(made.offsets >= 0, 1 << 30, -1)
        return made

    monkeypatch.setattr(max_plan.placement, "plan", second_stacked)
    with pytest.raises(AssertionError, match="step 3 request 1: slotted blocks meet"):
        max_plan.run_variant(events, step_at, raw, "plan-record")


def test_predicted_sizes_scale_only_the_requests_that_varied():
    events, step_at, raw = _raw_expand(varying_trace([1, 3, 2]), 0)
    bounds = step_at + [len(events)]
    rows = [(op, uid, n, 0) for op, uid, n in events]
    step = placement.record_step(rows, bounds[1], bounds[2], bounds[3])
    made = placement.plan(step, budget_ms=1e6)
    varied = np.arange(len(step)) % 2 == 0
    kept = max_plan._Kept(made, 0, r_max=3 * MiB, varied=varied)
    pred = max_plan.predicted(kept, 4 * MiB)
    assert pred.structure() == step.structure()
    assert (pred.nbytes[~varied] == step.nbytes[~varied]).all()
    want = -(-step.nbytes[varied] * 4 // 3 // placement.ALIGN) * placement.ALIGN
    assert (pred.nbytes[varied] >= want - placement.ALIGN).all()
    assert (pred.nbytes[varied] >= step.nbytes[varied]).all()
    assert (pred.nbytes % placement.ALIGN == 0).all()


def test_expected_records_of_iid_draws():
    assert max_plan.expected_records([7], 12) == pytest.approx(1.0)
    assert max_plan.expected_records([1, 2], 2) == pytest.approx(1.25)
    assert max_plan.expected_records([1, 2], 0) == 0.0
    harmonic = sum(1 / k for k in range(1, 13))
    assert max_plan.expected_records(np.arange(10 ** 6), 12) == pytest.approx(harmonic, abs=1e-3)
    # A small set: below its size; as the run grows, sum_v p_v / P(draw >= v) (a value
    # past which none is drawn again ends the records): 1/4 + (1/2) / (3/4) + 1.
    assert max_plan.expected_records([1, 2, 2, 3], 10 ** 4) == pytest.approx(23 / 12)
    assert max_plan.expected_records([1, 2, 2, 3], 5) < 23 / 12
    assert max_plan.expected_records(np.arange(5), 10 ** 4) == pytest.approx(137 / 60)
    # Against counted records of seeded draws.
    rng = np.random.default_rng(0)
    draws = np.array([1, 2, 2, 3, 5])
    runs = rng.choice(draws, size=(20000, 6))
    counted = np.mean([sum(x > max(run[:k], default=0) for k, x in enumerate(run))
                       for run in runs])
    assert counted == pytest.approx(max_plan.expected_records(draws, 6), abs=0.03)
    with pytest.raises(ValueError, match="draws"):
        max_plan.expected_records([], 3)


def test_shape_draws_hold_every_ratio_the_workloads_draw():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import _models
    for batches, low, high in _models.CHECKPOINTED.values():
        draws = set(max_plan.shape_draws(batches, low, high).tolist())
        assert len(draws) <= len(batches) * (high - low + 1)
        for b, n in _models.batch_shapes(200, batches, (low, high)):
            assert b * n in draws
