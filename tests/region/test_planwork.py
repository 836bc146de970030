"""The planning budget in work (gpupool.region.placement's ``budget_work``): a plan depends on
its step and its arguments alone, never on the clock; past the work budget the plan falls back
to first fit and says so; a planned region passes the option on and counts which limit
stopped its plans. Note [Planning budget in work] in docs/design.md."""

import itertools

import numpy as np
import pytest
from planned_steps import entries, vpool, vsim  # noqa: F401 (fixtures)

import gpupool
from gpupool.region import placement
from gpupool.region.placement import BUDGET_MS, Step, plan


def busy_step(n=600, seed=0):
    """A step of ``n`` requests of long, overlapping lifetimes: the greedy reads the clock
    about n / 64 times and examines many candidate places."""
    rng = np.random.default_rng(seed)
    alloc = np.arange(n) * 2
    free = np.minimum(alloc + 1 + rng.integers(1, 200, n) * 2, 2 * n - 1)
    return Step(rng.integers(1, 1 << 20, n), alloc, free, np.zeros(n), 2 * n)


def jumping_clock(seconds):
    """A perf_counter that moves ``seconds`` at each reading (a loaded machine's)."""
    ticks = itertools.count()
    return lambda: next(ticks) * seconds


@pytest.mark.parametrize("jump", [1e-3, 0.05, 0.1])
def test_the_same_plan_under_any_clock(monkeypatch, jump):
    step = busy_step()
    steady = plan(step)
    assert steady.fallback is None and steady.method == "size"
    # About 11 readings: 1.1 s at 0.1 s each, past the 200 ms wall-clock budget that once
    # decided, within the wall-clock cap that is now a safety net.
    monkeypatch.setattr(placement.time, "perf_counter", jumping_clock(jump))
    assert 11 * jump * 1e3 < BUDGET_MS
    moved = plan(step)
    assert moved.fallback is None and moved.method == steady.method
    assert np.array_equal(moved.offsets, steady.offsets) and moved.work == steady.work


def test_past_the_work_budget_the_plan_falls_back_to_first_fit_whatever_the_clock(
        monkeypatch):
    step = busy_step()
    full = plan(step)
    assert full.work > 0
    monkeypatch.setattr(placement.time, "perf_counter", lambda: 0.0)      # never moves
    cut = [plan(step, budget_work=full.work // 2, budget_ms=np.inf) for _ in range(2)]
    for p in cut:
        assert p.fallback == "work" and p.method == "first-fit" and p.tried == {}
        # It stopped at the first block past the budget: one block's work at most beyond.
        assert full.work // 2 < p.work < full.work
    assert np.array_equal(cut[0].offsets, cut[1].offsets) and cut[0].work == cut[1].work
    assert np.array_equal(cut[0].offsets, placement._first_fit(step, step.planned))
    assert plan(step, budget_work=full.work).fallback is None       # exactly enough
    assert "fallback: work" in repr(cut[0])


def test_the_wall_clock_cap_still_stops_a_plan_and_says_so(monkeypatch):
    monkeypatch.setattr(placement.time, "perf_counter", jumping_clock(10.0))
    p = plan(busy_step(), budget_ms=1e3)
    assert p.fallback == "time" and p.method == "first-fit"


def test_a_later_strategy_past_the_work_budget_keeps_the_first():
    step = busy_step(200)
    first = plan(step, strategies=("size",))
    both = plan(step, strategies=("size", "area"), budget_work=first.work + 1)
    assert both.fallback is None and both.method == "size" and set(both.tried) == {"size"}
    assert np.array_equal(both.offsets, first.offsets) and both.work > first.work


def test_the_work_counts_the_comparisons_made():
    # The compiled core checks each block placed so far and each fixed row against the block
    # it places: block k (in the strategy's order) makes k comparisons, plus one per fixed row
    # (none of these fits a gap before the scan ends), whether their lifetimes meet or not.
    n = 100
    apart = Step([4096] * n, np.arange(n) * 2, np.arange(n) * 2 + 1, [0] * n, 2 * n)
    nested = Step(np.arange(n, 0, -1) * 4096, np.arange(n), 2 * n - np.arange(n), [0] * n,
                  2 * n + 1)
    pairs = n * (n - 1) // 2
    assert plan(apart).work == plan(nested).work == pairs
    assert plan(apart, fixed=[(0, 4096)]).work == pairs + n
    assert plan(nested, fixed=[(0, 4096), (4096, 4096)]).work == pairs + 2 * n


def test_a_planned_region_passes_the_work_budget_on_and_counts_what_stopped_it(vpool):
    tight = gpupool.Region(pool=vpool, plan={"budget_work": 1}, collect=None)
    entries(vpool, tight, 6)
    stats = tight.stats()
    assert stats.plans >= 1 and stats.plans_past_work == stats.plans
    assert stats.plans_past_time == stats.plans_past_requests == 0
    assert tight.planner.counts["past_work"] == stats.plans
    roomy = gpupool.Region(pool=vpool, plan=True, collect=None)
    entries(vpool, roomy, 6)
    stats = roomy.stats()
    assert stats.plans >= 1 and stats.plans_past_work == stats.plans_past_time == 0
    # The plans kept are among those made (transitions are made and not kept).
    assert stats.planning_work >= sum(p.work for p in roomy.planner.plans) > 0


def test_budgets_beyond_int64_are_no_limit():
    # The compiled core's limits are int64: larger budgets (and infinity) mean none, not an
    # OverflowError out of a region's exit.
    step = Step([4096] * 50, np.arange(50), np.arange(50) + 50, [0] * 50, 100)
    full = plan(step)
    for budgets in ({"budget_ms": 1e13}, {"budget_ms": float("inf")},
                    {"budget_work": 2**70}, {"budget_work": float("inf")}):
        made = plan(step, **budgets)
        assert made.fallback is None and np.array_equal(made.offsets, full.offsets), budgets
