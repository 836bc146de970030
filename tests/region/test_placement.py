"""The planner of a planned region (gpupool.region.placement): every plan is valid (no two
requests live at once share bytes, every request inside the range, the range at least the
floor, the conflicts exact), simple steps reach the floor, the budget falls back to first fit,
and a plan serves exactly the requests it can."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool.region.placement import (
    ALIGN,
    ESCAPED,
    Plan,
    Step,
    envelope,
    floor_bytes,
    overlaps,
    plan,
    record_step,
    servable,
)


def clashes(p):
    """Pairs (i, j) of planned requests that live at once (or, on different streams, ever) and
    share bytes under plan ``p``: brute force, independent of the planner."""
    s, found = p.step, []
    for i in np.flatnonzero(s.planned):
        for j in np.flatnonzero(s.planned):
            if j <= i:
                continue
            at_once = overlaps(s.alloc[i], s.free[i], s.alloc[j], s.free[j], s.length)
            if (at_once or s.stream[i] != s.stream[j]) and \
                    p.offsets[i] < p.offsets[j] + s.nbytes[j] and \
                    p.offsets[j] < p.offsets[i] + s.nbytes[i]:
                found.append((int(i), int(j)))
    return found


def expected_conflicts(p, i):
    s = p.step
    return [j for j in np.flatnonzero(s.planned)
            if j != i and (j < i or s.tails[j]) and
            p.offsets[j] < p.offsets[i] + s.nbytes[i] and p.offsets[i] < p.offsets[j] + s.nbytes[j]]


@st.composite
def steps(draw, max_requests=30, streams=1):
    """A step: requests allocated in order, each freed later in it, in the next entry (before
    its own next allocation) or never; sizes of 1 B to 4 MiB."""
    n = draw(st.integers(1, max_requests))
    length = 2 * n + draw(st.integers(0, 4))
    alloc = sorted(draw(st.lists(st.integers(0, length - 1), min_size=n, max_size=n,
                                 unique=True)))
    free = []
    for a in alloc:
        kind = draw(st.sampled_from(["inside", "inside", "inside", "tail", "escaped"]))
        if kind == "tail" and a > 0:
            free.append(length + draw(st.integers(0, a - 1)))
        elif kind == "escaped" or a == length - 1:
            free.append(ESCAPED)
        else:
            free.append(draw(st.integers(a + 1, length - 1)))
    nbytes = draw(st.lists(st.integers(1, 1 << 22), min_size=n, max_size=n))
    stream = draw(st.lists(st.integers(0, streams - 1), min_size=n, max_size=n))
    return Step(nbytes, alloc, free, stream, length)


def check_valid(p):
    s = p.step
    assert clashes(p) == []
    planned = s.planned
    assert (p.offsets[planned] >= 0).all() and (p.offsets[~planned] == -1).all()
    assert (p.offsets[planned] % ALIGN == 0).all()
    assert (p.offsets[planned] + s.nbytes[planned] <= p.nbytes).all()
    assert p.floor <= p.nbytes <= int(s.nbytes[planned].sum())
    for i in range(len(s)):
        want = expected_conflicts(p, i) if planned[i] else []
        assert p.conflicts(i).tolist() == want


@settings(max_examples=150, deadline=None)
@given(steps())
def test_every_greedy_plan_is_valid(step):
    p = plan(step)
    assert p.method == "size" and p.fallback is None
    check_valid(p)


@settings(max_examples=100, deadline=None)
@given(steps(streams=3), st.sampled_from(["size", "size-best", "lifetime", "lifetime-best",
                                          "area"]))
def test_every_strategy_keeps_streams_apart(step, strategy):
    p = plan(step, strategies=(strategy,))
    check_valid(p)
    assert p.events.shape == (0, 2)


@settings(max_examples=100, deadline=None)
@given(steps(streams=3))
def test_the_first_fit_fallback_is_valid(step):
    p = plan(step, max_requests=0)
    if step.planned.any():
        assert p.method == "first-fit" and p.fallback == "requests"
    check_valid(p)


@settings(max_examples=60, deadline=None)
@given(steps(streams=2))
def test_shared_streams_list_their_events(step):
    p = plan(step, share_streams=True)
    s = p.step
    want = sorted((int(i), int(j)) for i in range(len(s)) for j in range(i + 1, len(s))
                  if s.planned[i] and s.planned[j] and s.stream[i] != s.stream[j] and
                  p.offsets[i] < p.offsets[j] + s.nbytes[j] and
                  p.offsets[j] < p.offsets[i] + s.nbytes[i])
    assert sorted(map(tuple, p.events.tolist())) == want
    # no pair of requests live at once shares bytes, whatever their streams
    assert all(s.stream[i] != s.stream[j] for i, j in clashes(p))


def test_the_checker_and_the_conflicts_can_fail():
    step = Step([1024, 1024], [0, 1], [2, 3], [0, 0], 4)
    p = plan(step)
    assert p.conflicts(1).tolist() == []
    p.offsets[1] = p.offsets[0]                    # both at one place while both live
    assert clashes(p) == [(0, 1)]
    assert expected_conflicts(p, 1) == [0]


@settings(max_examples=100, deadline=None)
@given(steps(), st.data())
def test_the_conflicts_of_any_offsets_are_exact_and_of_the_places_made(step, data):
    """Places that meet (not a valid plan) list every pair; the table, made at the first
    call, is of the places as the plan was made with them, moved since or not."""
    units = data.draw(st.lists(st.integers(0, 6), min_size=len(step), max_size=len(step)))
    p = Plan(step, np.where(step.planned, np.array(units) * ALIGN, -1), method="size")
    want = [expected_conflicts(p, i) if step.planned[i] else [] for i in range(len(step))]
    p.offsets[:] = np.where(step.planned, 1 << 30, -1)
    assert [p.conflicts(i).tolist() for i in range(len(step))] == want


def test_a_chain_of_layers_reaches_the_floor():
    # A forward pass: each activation lives until the next layer's output exists.
    mib = 1 << 20
    step = Step([4 * mib, 8 * mib, 2 * mib, 8 * mib, 1 * mib], [0, 1, 3, 5, 7],
                [2, 4, 6, 8, 9], [0] * 5, 10)
    p = plan(step)
    assert p.floor == 12 * mib                      # events 1-2: 4 + 8 MiB
    assert p.nbytes == p.floor


def test_nested_lifetimes_reach_the_floor():
    # A forward and its backward: the activation of layer k lives until layer k's gradient.
    mib = 1 << 20
    sizes = [5 * mib, 3 * mib, 7 * mib, 1 * mib]
    n = len(sizes)
    alloc = list(range(n))
    free = [2 * n - 1 - k for k in range(n)]
    p = plan(Step(sizes, alloc, free, [0] * n, 2 * n))
    assert p.floor == sum(sizes) == p.nbytes


def test_a_tail_is_kept_clear_of_the_next_entry():
    # Request 1 lives from event 2 into the next entry (to its event 1); request 0 lives over
    # [0, 1): in the next entry both are live at once.
    step = Step([1 << 20, 1 << 20], [0, 2], [1, 4 + 1], [0, 0], 4)
    p = plan(step)
    assert p.floor == 2 << 20 and p.offsets[0] != p.offsets[1]
    assert p.conflicts(0).tolist() == p.conflicts(1).tolist() == []
    alone = plan(Step([1 << 20, 1 << 20], [0, 2], [1, 3], [0, 0], 4))
    assert alone.nbytes == 1 << 20


def test_streams_never_share_unless_asked():
    step = Step([1 << 20, 1 << 20], [0, 2], [1, 3], [0, 7], 4)
    assert plan(step).nbytes == 2 << 20
    shared = plan(step, share_streams=True)
    assert shared.nbytes == 1 << 20 and shared.events.tolist() == [[0, 1]]


def test_the_time_budget_falls_back_to_first_fit():
    rng = np.random.default_rng(0)
    n = 600
    alloc = np.arange(n) * 2
    free = alloc + 1 + rng.integers(1, 200, n) * 2
    free = np.minimum(free, 2 * n - 1)
    step = Step(rng.integers(1, 1 << 20, n), alloc, free, np.zeros(n), 2 * n)
    p = plan(step, budget_ms=0.0)
    assert p.fallback == "time" and p.method == "first-fit" and p.tried == {}
    check_valid(p)
    q = plan(step, budget_ms=1e6)
    assert q.fallback is None and q.nbytes <= p.nbytes


def test_a_later_strategy_past_the_budget_keeps_the_first():
    step = Step([1 << 20] * 200, np.arange(200), np.arange(200) + 200, [0] * 200, 400)
    p = plan(step, strategies=("size", "area"), budget_ms=1e6)
    assert set(p.tried) == {"size", "area"}


def test_escaped_requests_are_not_placed():
    step = Step([1024, 2048], [0, 1], [ESCAPED, 2], [0, 0], 3)
    p = plan(step)
    assert p.offsets.tolist() == [-1, 0] and p.nbytes == 2048 and p.floor == 2048


@pytest.mark.parametrize("args, match", [
    (([1], [0, 1], [2], [0], 3), "same length"),
    (([0], [0], [1], [0], 2), "nbytes > 0"),
    (([8, 8], [1, 1], [2, 3], [0, 0], 4), "increasing"),
    (([8], [1], [1], [0], 4), "not after its allocation"),
    (([8], [1], [0], [0], 4), "not after its allocation"),
])
def test_bad_steps_raise(args, match):
    with pytest.raises(ValueError, match=match):
        Step(*args)


def test_record_step_reads_a_trace():
    events = [(0, 0, 100, 0), (0, 1, 600, 0), (1, 0, 100, 0), (0, 2, 50, 0), (0, 3, 9, 0),
              (1, 1, 600, 0),                       # the next entry frees 1 (a tail) ...
              (1, 2, 50, 0), (1, 3, 9, 0)]          # ... 2 after its own next allocation
    step = record_step(events, 0, 5, 8)
    assert step.nbytes.tolist() == [512, 1024, 512, 512]
    assert step.alloc.tolist() == [0, 1, 3, 4]
    assert step.free.tolist() == [2, 5, 6, 7]
    assert step.tails.tolist() == [False, True, True, True]
    assert record_step(events, 0, 5).free.tolist() == [2, ESCAPED, ESCAPED, ESCAPED]
    # freed in the next entry after that entry allocates the request again: escaped
    late = [(0, 0, 100, 0), (1, 0, 100, 0), (0, 1, 100, 0), (0, 2, 100, 0), (1, 1, 100, 0)]
    assert record_step(late, 0, 2, 5).free.tolist() == [1]
    assert record_step(late, 2, 3, 5).free.tolist() == [ESCAPED]


def test_a_request_freed_before_the_next_entrys_first_allocation_is_a_tail():
    # Request 0, allocated at the step's event 0, is freed by the next entry before it
    # allocates anything: a tail (freed at that entry's event 0), although no free can come
    # before that entry's own event 0. Request 1, freed there after an allocation, escapes.
    events = [(0, 0, 100, 0), (0, 1, 100, 0), (0, 2, 100, 0), (1, 2, 0, 0),
              (1, 0, 0, 0), (0, 3, 100, 0), (1, 1, 0, 0)]
    step = record_step(events, 0, 4, 7)
    assert step.free.tolist() == [4, ESCAPED, 3] and step.tails.tolist() == [True, False, False]
    # Such a free may come after the event of the request's own next allocation (a step of
    # another structure frees it first): a tail all the same, placed clear of every request.
    wide = Step([512, 512], [0, 1], [5, 2], [0, 0], 3)
    assert wide.tails.tolist() == [True, False]
    p = plan(wide)
    assert p.offsets[0] >= p.offsets[1] + 512 or p.offsets[1] >= p.offsets[0] + 512


def test_floor_counts_the_period():
    assert floor_bytes([10, 10], [0, 8], [4, 12]) == 10
    assert floor_bytes([10, 10], [0, 8], [4, 12], period=10) == 20


# ---------------------------------------------------------------------------------------------
# Envelopes and which requests a plan serves


def test_an_envelope_serves_every_step_of_its_structure_no_larger():
    a = Step([1024, 4096, 512], [0, 1, 3], [2, 4, 5], [0, 0, 0], 6)
    b = Step([2048, 1024, 512], [0, 1, 3], [2, 4, 5], [0, 0, 0], 6)
    env = envelope([a, b])
    assert env.nbytes.tolist() == [2048, 4096, 512]
    p = plan(env)
    assert servable(p, a).all() and servable(p, b).all()
    bigger = Step([2048, 8192, 512], [0, 1, 3], [2, 4, 5], [0, 0, 0], 6)
    assert servable(p, bigger).tolist() == [True, False, True]
    other_stream = Step([2048, 1024, 512], [0, 1, 3], [2, 4, 5], [0, 1, 0], 6)
    assert servable(p, other_stream).tolist() == [True, False, True]


def test_envelope_refuses_other_structures():
    a = Step([1024], [0], [1], [0], 2)
    with pytest.raises(ValueError, match="structure"):
        envelope([a, Step([1024], [0], [ESCAPED], [0], 2)])
    with pytest.raises(ValueError, match="no steps"):
        envelope([])


def test_a_request_living_longer_than_planned_keeps_its_place():
    # Planned: 0 over [0, 1), 1 over [2, 3): one place. If 0 lives on past 1's allocation,
    # 1 must not take the place.
    p = plan(Step([1024, 1024], [0, 2], [1, 3], [0, 0], 4))
    assert p.offsets[0] == p.offsets[1]
    late = Step([1024, 1024], [0, 1], [3, 2], [0, 0], 4)
    assert servable(p, late).tolist() == [True, False]


def test_carried_blocks_hold_their_bytes():
    # Event 2 frees a block of another plan, carried in at offset 0.
    step = Step([1024, 1024], [0, 3], [1, 4], [0, 0], 6)
    p = plan(step)
    assert p.offsets.tolist() == [0, 0]
    assert servable(p, step, [(0, 512, 2, -1)]).tolist() == [False, True]
    assert servable(p, step, [(0, 512, ESCAPED, -1)]).tolist() == [False, False]
    assert servable(p, step, [(4096, 512, ESCAPED, -1)]).tolist() == [True, True]


def test_a_tail_of_the_entry_before_is_checked_through_the_conflicts():
    # Request 1 is a tail freed at the next entry's event 0, before request 0 (over [1, 2))
    # is allocated, so the two share one place; event 0 frees the entry before's request 1.
    step = Step([1 << 20, 1 << 20], [1, 3], [2, 6], [0, 0], 6)
    p = plan(step)
    assert p.offsets.tolist() == [0, 0] and p.nbytes == 1 << 20
    assert p.conflicts(0).tolist() == [1] and p.conflicts(1).tolist() == [0]
    assert servable(p, step, [(0, 1 << 20, 0, 1)]).all()
    assert servable(p, step, [(0, 1 << 20, ESCAPED, 1)]).tolist() == [False, False]
    # the same block, but not known as the plan's tail: checked by address, same answer
    assert servable(p, step, [(0, 1 << 20, ESCAPED, -1)]).tolist() == [False, False]
    assert servable(p, step, [(0, 1 << 20, 0, -1)]).all()


@settings(max_examples=120, deadline=None)
@given(steps(streams=2), st.data())
def test_served_requests_never_share_live_bytes(planned_step, data):
    """Whatever step a plan meets (any structure, any sizes), the requests it serves never
    hold the same bytes at once: checked by replaying the served requests' lifetimes."""
    p = plan(planned_step)
    step = data.draw(steps(streams=2))
    served = servable(p, step)
    assert len(served) == len(step)
    live = []
    order = sorted([(int(t), 0, k) for k, t in enumerate(step.alloc) if served[k]] +
                   [(int(t), -1, k) for k, t in enumerate(step.free)
                    if served[k] and 0 <= t < step.length])
    for _, op, k in order:
        lo, hi = p.offsets[k], p.offsets[k] + p.sizes[k]
        if op == -1:
            live.remove(k)
            continue
        assert step.nbytes[k] <= p.sizes[k]
        assert not any(p.offsets[j] < hi and lo < p.offsets[j] + p.sizes[j] for j in live)
        live.append(k)
    if step.structure() == planned_step.structure():
        assert (served == ((step.nbytes <= p.sizes) & step.planned)).all()


def test_plan_repr_says_what_was_kept():
    p = plan(Step([1024], [0], [1], [0], 2), max_requests=0)
    assert isinstance(p, Plan) and "first-fit, fallback: requests" in repr(p)
