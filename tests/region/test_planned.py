"""Planned regions (Region(plan=True)) on the simulated device: the step is planned once its
signature repeats, later entries take their planned places, and every deviation stays correct."""

import re
import threading

import numpy as np
import pytest
from conftest import check_invariants
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planned_steps import (  # noqa: F401 (fixtures)
    FREES, KIB, MIB, SCALES, SIZES, TAILS, Checked, draw_step, entered, entries, run_step,
    scaled, vpool, vsim,
)

import gpupool
from gpupool.region.options import option_names
from gpupool.region.planned import Planner
from gpupool.testing import SimulatedDevice


def test_later_entries_take_their_planned_places_at_the_same_addresses(vpool):
    region = gpupool.Region(pool=vpool, plan=True, collect=None)
    found, _ = entries(vpool, region, 8)
    stats = region.stats()
    assert stats.planned and stats.plans >= 1 and stats.plan_misses == 0
    # The first step frees no tails of an entry before it: its structure is its own. The
    # second step's repeats at the fourth exit, and entries 5 to 8 are served whole.
    assert stats.plan_hits == 4 * len(SIZES)
    assert all(addrs == found[-1] for addrs in found[4:])
    assert stats.planning_ms >= 0 and stats.plan_bytes >= max(SIZES)


def test_a_planned_step_takes_no_more_memory_than_the_online_one(vsim):
    def peak(plan):
        pool = gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 32, virtual_memory=True))
        entries(pool, gpupool.Region(pool=pool, plan=plan, collect=None), 10)
        return pool.stats().peak_reserved_bytes
    assert peak(True) <= peak(False)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_steps_never_overlap_and_conserve_bytes(data):
    sizes, frees, tails = draw_step(data, 1, 12)
    vary = data.draw(st.booleans())
    pool = gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 32, virtual_memory=True))
    region = gpupool.Region(pool=pool, plan=True, collect=None)
    mem = Checked(pool)
    for e in range(7):
        grown = [s + (e % 2) * 4096 if vary else s for s in sizes]
        with region:
            run_step(mem, grown, frees, tails, e)
        check_invariants(pool)
    mem.live.clear()
    stats = check_invariants(pool)
    assert stats.in_use_bytes == 0


@pytest.mark.parametrize("deviation", ["larger", "extra", "order", "fewer"])
def test_deviating_entries_fall_back_and_stay_correct(vpool, deviation):
    region = gpupool.Region(pool=vpool, plan=True, collect=None)
    _, mem = entries(vpool, region, 5)
    before = region.stats()
    sizes, frees = list(SIZES), list(FREES)
    if deviation == "larger":
        sizes[2] += 1 * MIB
    elif deviation == "extra":
        sizes.insert(1, 700 * KIB)
        frees.insert(1, None)
    elif deviation == "order":
        # (Not request 0: one larger than any step's request 0 starts a record step.)
        sizes[1], sizes[2] = sizes[2], sizes[1]
    else:
        sizes, frees = sizes[:3], frees[:3]
    with region:
        run_step(mem, sizes, frees, {5} if len(sizes) > 5 else set(), 99)
    check_invariants(vpool)
    after = region.stats()
    if deviation == "fewer":
        assert after.plan_hits == before.plan_hits + 3      # a prefix of the step is served
    else:
        assert after.plan_misses > before.plan_misses
    # Back to the planned step: still correct, and served again after the deviation.
    found, _ = entries(vpool, region, 4, mem=mem)
    assert region.stats().plan_hits > after.plan_hits
    mem.live.clear()
    assert check_invariants(vpool).in_use_bytes == 0


def test_another_thread_inside_the_region_is_recorded_and_stays_correct(vpool):
    region = gpupool.Region(pool=vpool, plan=True, collect=None)
    mem = Checked(vpool)
    lock = threading.Lock()

    def worker(e):
        with region.enter_in_thread(), lock:
            mem.allocate(("w", e), 3 * MIB)
            mem.free(("w", e))

    for e in range(6):
        with region:
            run_step(mem, SIZES, FREES, TAILS, e)
            t = threading.Thread(target=worker, args=(e,))
            t.start()
            t.join()
        check_invariants(vpool)
    assert region.stats().plan_hits > 0


def test_scope_process_covers_other_threads(vpool):
    region = gpupool.Region(pool=vpool, plan=True, collect=None, scope="process")
    held = []

    def backward():
        held.append(vpool.allocate(2 * MIB))
        held.clear()

    for _ in range(6):
        with region:
            a = vpool.allocate(1 * MIB)
            t = threading.Thread(target=backward)
            t.start()
            t.join()
            del a
        check_invariants(vpool)
    stats = region.stats()
    assert stats.plan_hits >= 2 * 2 and stats.plan_misses == 0


def test_a_new_signature_is_planned_and_the_cache_is_capped(vpool):
    region = gpupool.Region(pool=vpool, plan={"max_plans": 2}, collect=None)
    mem = Checked(vpool)
    # A step larger than the plan, then two other structures (signatures).
    shapes = [(SIZES, FREES), ([s * 2 for s in SIZES], FREES), (SIZES, [None] * len(SIZES)),
              ([s + 4096 for s in SIZES], [None, 0, 1, 2, 3, None])]
    made = []
    for sizes, frees in shapes:
        entries(vpool, region, 5, sizes=sizes, frees=frees, mem=mem)
        made.append(region.stats().plans)
    assert made[0] < made[1] < made[2] < made[3]    # each planned (again)
    assert len(region.planner.plans) <= 2
    found, _ = entries(vpool, region, 3, sizes=shapes[3][0], frees=shapes[3][1], mem=mem)
    assert found[-1] == found[-2]


def test_a_plan_serving_badly_is_given_up(vpool):
    region = gpupool.Region(pool=vpool, plan=True, collect=None)
    mem = Checked(vpool)
    entries(vpool, region, 5, mem=mem)
    keep = []
    for e in range(4):
        # Something else lives on the planned places now: the step is the plan's, yet most
        # of its requests are refused there.
        with gpupool.uncached():
            keep += [vpool.allocate(256 * KIB) for _ in range(64)]
        with region:
            run_step(mem, SIZES, FREES, TAILS, 100 + e)
        check_invariants(vpool)
    assert region.stats().plans_given_up >= 1


def test_entries_off_the_plans_step_stop_at_once_and_do_not_give_it_up(vpool):
    # (Without record steps: these entries' request 0 asks more than any step's.)
    region = gpupool.Region(pool=vpool, plan={"record": False}, collect=None)
    mem = Checked(vpool)
    entries(vpool, region, 5, mem=mem)
    for e in range(4):
        # Another structure each time: its first request leaves the plan (one miss).
        before = region.stats()
        with region:
            run_step(mem, list(reversed(SIZES)), [None] * len(SIZES), set(), 100 + e)
        check_invariants(vpool)
        after = region.stats()
        assert (after.plan_hits, after.plan_misses) == (before.plan_hits,
                                                        before.plan_misses + 1)
    assert region.stats().plans_given_up == 0


def test_a_plan_on_another_stream_waits_for_the_old_streams_work(vpool, vsim):
    s1, s2 = vsim.create_stream(), vsim.create_stream()
    region = gpupool.Region(pool=vpool, plan=True, collect=None)
    addrs = []
    for _ in range(6):
        with region:
            a = vpool.allocate(1 * MIB, s1)
            a.record_stream(s2)
            vsim.launch(s2)                 # s2 still works on a when it is freed
            addrs.append(a.ptr)
            del a
        check_invariants(vpool)
    assert region.stats().plan_hits >= 2
    assert addrs[-1] == addrs[-2]
    # Each planned take of the place made s1 wait for s2's event (or saw it complete).
    waits = vsim.calls_named("stream_wait_event")
    assert any(stream == s1 for stream, _ in waits)
    vsim.complete()


def test_keep_and_invalidate_escape_a_planned_step(vpool):
    region = gpupool.Region(pool=vpool, plan=True, collect=None, on_exit="invalidate")
    kept = []
    mem = Checked(vpool)
    for e in range(7):
        with region:
            run_step(mem, SIZES, FREES, set(), e)
            b = vpool.allocate(1 * MIB)
            if e == 5:
                kept.append(region.keep(b))
            lost = vpool.allocate(2 * MIB)
            mem.live[("lost", e)] = lost
        check_invariants(vpool)
        assert lost.closed and not kept or not kept[0].closed
        del mem.live[("lost", e)]
    assert region.stats().plan_hits > 0
    with region:                            # the kept buffer's place is not handed out
        mem.live["kept"] = kept[0]
        run_step(mem, SIZES, FREES, set(), 99)
        mem.allocate("b", 1 * MIB)
    check_invariants(vpool)


def test_release_drops_the_plan_and_gives_the_memory_back(vpool):
    region = gpupool.Region(pool=vpool, plan=True, collect=None)
    _, mem = entries(vpool, region, 6, tails=set())
    assert region.planner.current is not None
    region.release()
    assert region.planner.current is None
    vpool.trim()
    assert vpool.stats().reserved_bytes == 0
    hits = region.stats().plan_hits
    entries(vpool, region, 6, tails=set(), mem=mem)     # planned again
    assert region.stats().plan_hits > hits


def test_a_plan_that_does_not_fit_the_memory_is_not_used(vpool):
    planner = Planner()
    step = planner._wanted = None
    from gpupool.region import placement
    step = placement.Step([4096, 4096], [0, 1], [2, 3], [0, 0], 4)
    planner._seen, planner._wanted = {}, (b"sig", step)
    assert planner.place(base=1 << 20, span=4096, obstacles=[]) is None
    assert planner.counts["no_room"] == 1 and planner.current is None
    placed = Planner()
    placed._wanted = (b"sig", step)
    plan, anchors = placed.place(base=1 << 20, span=1 << 20, obstacles=[(0, 4096)])
    assert (plan.offsets >= 4096).all() and len(anchors) == 2


def test_bad_plan_options_are_refused(vpool):
    with pytest.raises(TypeError, match="plan must be"):
        gpupool.Region(pool=vpool, plan="yes")
    with pytest.raises(ValueError, match="max_plans"):
        gpupool.Region(pool=vpool, plan={"max_plans": 0})
    with pytest.raises(TypeError, match=r"^Region\(plan=\.\.\.\): unknown option 'bogus'; "
                       r"the accepted keys are max_plans, max_plan_requests, budget_work, "
                       r"budget_ms, min_hit_rate, record, strategies, repair$"):
        gpupool.Region(pool=vpool, plan={"bogus": 1, "max_plans": 2})
    # A planner option given to Region itself is pointed to plan's dict; Python's own
    # message would name Region's __cinit__.
    with pytest.raises(TypeError, match=r"^Region\(\) got an unexpected keyword argument "
                       r"'strategies'; planner options go in plan: "
                       r"Region\(plan=\{'strategies': \.\.\.\}\)$"):
        gpupool.Region(pool=vpool, strategies=["size"])
    with pytest.raises(TypeError, match=r"^Region\(\) got an unexpected keyword argument "
                       r"'plans'; did you mean 'plan'\?$"):
        gpupool.Region(pool=vpool, plans=True)


BAD_OPTIONS = [
    ("max_plans", 0, ValueError, "an integer >= 1"),
    ("max_plans", 2.5, TypeError, "an integer >= 1"),
    ("max_plans", True, TypeError, "an integer >= 1"),
    ("max_plan_requests", 0, ValueError, "an integer >= 1"),
    ("max_plan_requests", -3, ValueError, "an integer >= 1"),
    ("min_hit_rate", 5, ValueError, "a number from 0 to 1"),
    ("min_hit_rate", -1, ValueError, "a number from 0 to 1"),
    ("min_hit_rate", float("nan"), ValueError, "a number from 0 to 1"),
    ("budget_ms", 0, ValueError, "a number of milliseconds > 0"),
    ("budget_ms", -1, ValueError, "a number of milliseconds > 0"),
    ("budget_ms", "fast", TypeError, "a number of milliseconds > 0"),
    ("budget_work", 0, ValueError, "an integer >= 1"),
    ("budget_work", -5, ValueError, "an integer >= 1"),
    ("budget_work", 1e6, TypeError, "an integer >= 1"),
    ("budget_work", True, TypeError, "an integer >= 1"),
    ("budget_work", "lots", TypeError, "an integer >= 1"),
]


@pytest.mark.parametrize("option, value, error, accepted", BAD_OPTIONS)
def test_a_plan_option_out_of_range_is_refused_naming_it(vpool, option, value, error, accepted):
    with pytest.raises(error) as info:
        gpupool.Region(pool=vpool, plan={option: value})
    assert str(info.value) == f"{option} must be {accepted}, got {value!r}"


@pytest.mark.parametrize("option, value, error, accepted", BAD_OPTIONS + [
    ("record", 1, TypeError, "a bool"), ("repair", None, TypeError, "a bool")])
def test_a_plan_option_assigned_on_a_live_planner_is_checked(vpool, option, value, error,
                                                             accepted):
    # Trial 34's finding 6: options set after construction went unchecked.
    region = gpupool.Region(pool=vpool, plan=True)
    planner = region.planner
    before = getattr(planner, option)
    with pytest.raises(error) as info:
        setattr(planner, option, value)
    assert str(info.value) == f"{option} must be {accepted}, got {value!r}"
    assert getattr(planner, option) == before
    with region:                    # the planner still plans with what it kept
        vpool.allocate(1024).close()


def test_plan_options_assigned_on_a_live_planner_are_kept_as_given_to_it(vpool):
    planner = gpupool.Region(pool=vpool, plan=True).planner
    planner.budget_work, planner.budget_ms, planner.min_hit_rate = np.int64(7), 3, 1
    planner.strategies, planner.record, planner.repair = ["area", "size"], False, np.bool_(0)
    assert (planner.budget_work, planner.budget_ms, planner.min_hit_rate) == (7, 3.0, 1.0)
    assert (type(planner.budget_work), type(planner.budget_ms)) == (int, float)
    assert (planner.strategies, planner.record) == (("area", "size"), False)
    assert planner.repair is False          # NumPy's bool taken, as Region(plan=np.True_) is
    with pytest.raises(ValueError, match=r"'sise' is not one; did you mean 'size'\?$"):
        planner.strategies = ("sise",)
    assert planner.strategies == ("area", "size")


def test_max_plan_requests_lowered_past_the_installed_plans_step_drops_it(vpool):
    # helper-113's finding: every exit then raised ValueError (an envelope no longer kept,
    # compared with the plan's sizes).
    region = gpupool.Region(pool=vpool, plan=True)

    def step():
        entered(region, vpool, (MIB, 2 * MIB, 3 * MIB))
    for _ in range(4):
        step()
    hits = region.stats().plan_hits
    assert hits > 0
    region.planner.max_plan_requests = 2
    step(), step()
    hits = region.stats().plan_hits
    assert region.planner.plans == [] and region.planner.current is None
    step(), step()
    assert region.stats().plan_hits == hits         # the step is not planned any more
    region.planner.max_plan_requests = 3
    for _ in range(4):
        step()
    assert region.stats().plan_hits >= hits + 3     # planned again
    check_invariants(vpool)


def test_a_planners_counts_are_not_replaced(vpool):
    # helper-112's finding: `planner.counts = {}` made every later stats() raise KeyError.
    region = gpupool.Region(pool=vpool, plan=True)
    with pytest.raises(AttributeError, match="counts"):
        region.planner.counts = {}
    with pytest.raises((AttributeError, TypeError)):    # (helper-113: nor cleared, nor set)
        region.planner.counts.clear()
    with pytest.raises(TypeError):
        region.planner.counts["plans"] = 99
    with region:
        vpool.allocate(MIB).close()
    assert region.stats().entries == 1 and region.planner.counts["plans"] == 0


@pytest.mark.parametrize("option, value", [("max_plans", 1), ("max_plan_requests", 3)])
def test_plans_kept_lowered_on_a_live_planner_drop_the_others(vpool, option, value):
    # helper-112's finding: the next plan stored again under a signature kept was dropped by
    # the bound before it was moved last (KeyError from the plan's worker).
    region = gpupool.Region(pool=vpool, plan=True)

    def step(sizes):
        entered(region, vpool, sizes)
    a, b = [4 * MIB, MIB, 3 * MIB], [MIB, 2 * MIB]
    for _ in range(6):
        step(a), step(b)
    assert len(region.planner.plans) == 2
    setattr(region.planner, option, value)
    step([2 * n for n in a])            # a grown, planned again under its signature kept
    step(b)
    region.stats()                      # (a worker's error is raised by the next call)
    assert len(region.planner.plans) == 1
    hits = region.stats().plan_hits
    for _ in range(3):
        step(a), step(b)
    assert len(region.planner.plans) == 1 and region.stats().plan_hits > hits
    check_invariants(vpool)


@pytest.mark.parametrize("name", ["min_hit_rat", "recrod", "strategy", "max_plan", "obstacles"])
def test_a_misspelt_option_assigned_on_a_live_planner_raises(vpool, name):
    # helper-110's finding: a misspelt option was taken as a new attribute, silently.
    planner = gpupool.Region(pool=vpool, plan=True).planner
    names = option_names(Planner)
    before = [getattr(planner, k) for k in names]
    with pytest.raises(AttributeError, match=f"'Planner' object has no attribute '{name}'"):
        setattr(planner, name, 0.9)
    assert not hasattr(planner, name)
    assert [getattr(planner, k) for k in names] == before


@pytest.mark.parametrize("value, error, why", [
    ({"size"}, TypeError, ""), (("size", 3), TypeError, ""), ("size", TypeError, ""),
    ((), ValueError, ""), (("size", "bogus"), ValueError, ": 'bogus' is not one"),
    (("size", "size"), ValueError, ": 'size' is named twice"),
])
def test_bad_strategies_are_refused_naming_them(vpool, value, error, why):
    with pytest.raises(error, match=r"^strategies must be a (tuple \(or list\) of str|non-empty "
                                    r"tuple \(or list\) of distinct names among \[.*\]), got " +
                       re.escape(repr(value) + why) + "$"):
        gpupool.Region(pool=vpool, plan={"strategies": value})


def test_strategies_may_be_a_list_and_are_kept_as_a_tuple(vpool):
    region = gpupool.Region(pool=vpool, plan={"strategies": ["area", "size"]})
    assert region.planner.strategies == ("area", "size")
    with pytest.raises(ValueError, match=r"got \['size', 'size'\]: 'size' is named twice$"):
        gpupool.Region(pool=vpool, plan={"strategies": ["size", "size"]})
    with pytest.raises(TypeError, match=r"got \[1\]$"):         # what was given, not its tuple
        gpupool.Region(pool=vpool, plan={"strategies": [1]})


def test_plan_options_at_the_ends_of_their_ranges_are_taken(vpool):
    region = gpupool.Region(pool=vpool, plan={"max_plans": np.int64(1), "max_plan_requests": 1,
                                               "budget_work": np.int32(1), "budget_ms": 0.5,
                                               "min_hit_rate": 0})
    planner = region.planner
    assert (planner.max_plans, planner.max_plan_requests) == (1, 1)
    assert (planner.budget_work, planner.budget_ms, planner.min_hit_rate) == (1, 0.5, 0.0)
    assert type(planner.budget_work) is int
    assert gpupool.Region(pool=vpool, plan={"min_hit_rate": 1}).planner.min_hit_rate == 1.0


def test_placement_keeps_fixed_and_pinned_bytes():
    from gpupool.region import placement
    step = placement.Step([1024, 1024, 1024], [0, 1, 2], [3, 4, 5], [0, 0, 0], 6)
    made = placement.plan(step, fixed=[(0, 1024, 0, 2)], pinned=[-1, -1, 4096])
    assert made.offsets[2] == 4096
    assert made.offsets[0] >= 1024 and made.offsets[1] >= 1024      # (0, 1024) is taken
    spans = sorted(zip(made.offsets, made.offsets + 1024, strict=True))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert np.array_equal(placement.plan(step).offsets, [0, 1024, 2048])


def test_varying_sizes_of_one_structure_are_served_at_the_envelopes_places(vpool):
    region = gpupool.Region(pool=vpool, plan=True, collect=None)
    mem = Checked(vpool)                    # every allocation checked for overlap
    found = []
    for e, scale in enumerate(SCALES):
        with region:
            found.append(run_step(mem, scaled(scale), FREES, TAILS, e))
        check_invariants(vpool)
    stats = region.stats()
    # Planned from the envelope (the full sizes) at the fourth exit; the transition plan
    # serves entry 4 and the steady plan the rest, each smaller request at its place.
    assert stats.plan_misses == 0 and stats.plan_hits == (len(SCALES) - 4) * len(SIZES)
    assert all(addrs == found[-1] for addrs in found[5:])
    assert len(region.planner.plans) == 1
    assert list(region.planner.plans[0].step.nbytes) == scaled(1.0)
    mem.live.clear()
    assert check_invariants(vpool).in_use_bytes == 0


def test_a_step_larger_than_the_envelope_goes_online_and_is_planned_again(vpool):
    region = gpupool.Region(pool=vpool, plan={"record": False}, collect=None)
    mem = Checked(vpool)

    def entry(scale, e):
        before = region.stats()
        with region:
            run_step(mem, scaled(scale), FREES, TAILS, e)
        check_invariants(vpool)
        after = region.stats()
        return after.plan_hits - before.plan_hits, after.plan_misses - before.plan_misses

    for e, scale in enumerate(SCALES):
        entry(scale, e)
    plans = region.stats().plans
    # The first request asks more than its place: it and the rest of the step go online.
    assert entry(1.5, 50) == (0, 1)
    for e in range(3):
        entry(0.8, 60 + e)
    assert region.stats().plans > plans     # planned again from the grown envelope
    assert entry(1.5, 70) == (len(SIZES), 0)    # now served whole
    assert entry(0.5, 71) == (len(SIZES), 0)
    assert region.stats().plans_given_up == 0
    assert list(region.planner.plans[-1].step.nbytes) == scaled(1.5)
    mem.live.clear()
    assert check_invariants(vpool).in_use_bytes == 0


def test_the_envelopes_kept_are_bounded():
    from gpupool.region import placement
    planner = Planner(max_plan_requests=8)
    for n in range(1, 40):
        # Steps of distinct structures (lengths), each remembered with its envelope.
        step = placement.Step([4096] * n, list(range(n)), list(range(n, 2 * n)), [0] * n,
                              2 * n)
        planner._remember(bytes([n]), step, 4096)
    assert sum(2 * len(s[1]) for s in planner._seen.values()) <= 4 * 8


def test_a_served_block_freed_at_another_event_sends_the_rest_online(vpool):
    region = gpupool.Region(pool=vpool, plan=True, collect=None)
    _, mem = entries(vpool, region, 6)
    before = region.stats()
    # Requests 1 and 0 are freed where the plan frees 0 and 1: the same count of events, but
    # the step leaves the plan at the first of those frees, requests 0 to 2 served.
    with region:
        run_step(mem, SIZES, [None, None, 1, 0, 3, None], TAILS, 99)
    check_invariants(vpool)
    after = region.stats()
    assert (after.plan_hits - before.plan_hits, after.plan_misses - before.plan_misses) == (3, 1)
    mem.live.clear()
    assert check_invariants(vpool).in_use_bytes == 0


@pytest.mark.parametrize("greedy_max, planned", [(len(SIZES) - 1, False), (len(SIZES), True)])
def test_a_step_too_large_for_the_greedy_is_not_planned(vpool, monkeypatch, greedy_max,
                                                        planned):
    # Past GREEDY_MAX planned requests a plan could only be first fit, which places no better
    # than the online way: the step is served online, and no time goes into planning it.
    from gpupool.region import planned as planned_module
    monkeypatch.setattr(planned_module, "GREEDY_MAX", greedy_max)
    region = gpupool.Region(pool=vpool, plan=True, collect=None)
    entries(vpool, region, 6)
    stats = region.stats()
    assert (stats.plans > 0, stats.plan_hits > 0) == (planned, planned)
    if not planned:
        assert stats.planning_ms == 0 and stats.plan_misses == 0


def test_a_plan_of_two_strategies_runs_them_side_by_side_with_one_runs_result(monkeypatch):
    # Each strategy's greedy on a thread of its own (the compiled core runs without the GIL),
    # the plan the same as one strategy after the other: the lower top kept, work summed.
    from gpupool.region import placement
    rng = np.random.default_rng(3)
    n = 300
    alloc = 2 * np.arange(n)                   # allocations at even events, frees at odd
    step = placement.Step(rng.integers(1, 64, n) * placement.ALIGN, alloc,
                          alloc + 2 * rng.integers(0, 40, n) + 1, np.zeros(n, np.int64),
                          2 * n + 100)
    threads, greedy = [], placement._greedy

    def spy(*args, **kwargs):
        threads.append(threading.get_ident())
        return greedy(*args, **kwargs)

    monkeypatch.setattr(placement, "_greedy", spy)
    both = placement.plan(step, strategies=("size", "area"))
    assert len(threads) == 2 and len(set(threads)) == 2
    alone = {name: placement.plan(step, strategies=(name,)) for name in ("size", "area")}
    lower = min(alone.values(), key=lambda p: p.tried[p.method])
    assert np.array_equal(both.offsets, lower.offsets)
    assert both.work == sum(p.work for p in alone.values())
    # Past the budget in all, as one after the other: the second strategy stops where the
    # first left too little, and the first's plan is kept.
    first = alone["size"].work
    capped = placement.plan(step, strategies=("size", "area"), budget_work=first + 1)
    assert capped.method == "size" and np.array_equal(capped.offsets, alone["size"].offsets)


def test_a_failing_strategy_raises_on_the_planning_thread(monkeypatch):
    from gpupool.region import placement

    def broken(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            raise MemoryError("strategy on its own thread")
        return greedy(*args, **kwargs)

    greedy = placement._greedy
    monkeypatch.setattr(placement, "_greedy", broken)
    step = placement.Step(np.full(4, placement.ALIGN), np.arange(4), np.arange(4) + 2,
                          np.zeros(4, np.int64), 8)
    with pytest.raises(MemoryError, match="its own thread"):
        placement.plan(step, strategies=("size", "area"))


def test_no_budget_runs_no_strategy(monkeypatch):
    # As one strategy after the other: nothing left to spend, no greedy runs (the compiled
    # core would read a limit of 0 as none), and the first-fit plan is returned.
    from gpupool.region import placement
    calls = []
    greedy = placement._greedy
    monkeypatch.setattr(placement, "_greedy", lambda *a, **k: calls.append(a) or greedy(*a, **k))
    step = placement.Step(np.full(4, placement.ALIGN), np.arange(4), np.arange(4) + 2,
                          np.zeros(4, np.int64), 8)
    for budget in (0, -1):
        made = placement.plan(step, strategies=("size", "area"), budget_work=budget)
        assert made.method == "first-fit" and made.fallback == "work" and made.work == 0
    assert calls == []


def test_a_strategy_without_a_thread_runs_on_the_planning_thread(monkeypatch):
    # A thread refused (interpreter shutdown, a limit on threads): the strategy runs on the
    # calling thread, the plan the same.
    from gpupool.region import placement
    step = placement.Step(np.full(6, placement.ALIGN), np.arange(6), np.arange(6) + 3,
                          np.zeros(6, np.int64), 12)
    expected = placement.plan(step, strategies=("size", "area"))

    def refused(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refused)
    made = placement.plan(step, strategies=("size", "area"))
    assert np.array_equal(made.offsets, expected.offsets) and made.work == expected.work


@pytest.mark.parametrize("skip_first, first", [(False, 3), (True, 4)])
def test_a_repeating_step_takes_its_places_from_the_fourth_entry(skip_first, first):
    # Region's docstring said "from the third or so entry on"; README's step (1 15 0 6) is
    # served from the fourth entry, planned at the third's exit (the fifth with skip_first).
    pool = gpupool.Pool(upstream=SimulatedDevice(virtual_memory=True))
    region = gpupool.Region(pool=pool, plan=True, skip_first=skip_first)
    hits = []
    for _ in range(first + 2):
        with region:
            x, y = pool.allocate(4 * MIB), pool.allocate(MIB)
            x.close()
            z = pool.allocate(3 * MIB)
            y.close()
            z.close()
        hits.append(region.stats().plan_hits)
    assert hits == [0] * first + [3, 6]
    assert "from the fourth entry on (the fifth with ``skip_first``" in \
        " ".join(gpupool.Region.__doc__.split())
