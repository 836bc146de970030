"""The compiled greedy placement (gpupool.region.greedy, behind placement._greedy) places every
request at the offset the NumPy reference (greedy_reference.py, with its n-by-n mask) gives,
for every strategy, streams shared or not, fixed ranges and pinned requests; and it stops past
its work limit or its time budget."""

import numpy as np
import pytest
from greedy_reference import busy_mask, greedy, scan_work
from hypothesis import given, settings
from hypothesis import strategies as st
from test_placement import steps

from gpupool.region import greedy as compiled
from gpupool.region.placement import ALIGN, ESCAPED, STRATEGIES, Step, _greedy, _order, plan

FOREVER = np.iinfo(np.int64).max


@st.composite
def cases(draw, max_requests=40):
    """A step's planned requests (those of test_placement's steps, tails crossing the period
    included, sizes drawn again from few values so that ties in size and offset are common), a
    strategy, whether streams share, fixed ranges (some for the whole step) and pinned
    requests."""
    drawn = draw(steps(max_requests, streams=3))
    keep = drawn.planned
    n, length = int(keep.sum()), drawn.length
    units = draw(st.lists(st.sampled_from([1, 2, 3, 8, 64, 1000]), min_size=n, max_size=n))
    step = Step(np.array(units, np.int64) * ALIGN, drawn.alloc[keep], drawn.free[keep],
                drawn.stream[keep], length)
    m = draw(st.integers(0, 4))
    lo = np.array(draw(st.lists(st.integers(0, 64), min_size=m, max_size=m)), np.int64) * ALIGN
    hi = lo + np.array(draw(st.lists(st.integers(1, 16), min_size=m, max_size=m)),
                       np.int64) * ALIGN
    first = np.array(draw(st.lists(st.integers(0, length), min_size=m, max_size=m)), np.int64)
    end = np.array([draw(st.sampled_from([FOREVER, int(f) + draw(st.integers(1, length))]))
                    for f in first], np.int64)
    pinned = np.array([draw(st.sampled_from([-1, -1, -1, 0, 8 * ALIGN, 100 * ALIGN]))
                       for _ in range(n)], np.int64)
    strategy = draw(st.sampled_from(sorted(STRATEGIES)))
    return step, strategy, draw(st.booleans()), (lo, hi, first, end), pinned


def both(step, strategy, share, fixed, pinned, work_limit=0):
    """The reference's offsets and the compiled (offsets, work, why)."""
    sizes, starts, ends = step.nbytes, step.alloc, step.free
    want = greedy(sizes, starts, ends, busy_mask(starts, ends, step.stream, step.length, share),
                  *STRATEGIES[strategy], fixed, pinned)
    got = _greedy(sizes, starts, ends, (step.stream, step.length, share), *STRATEGIES[strategy],
                  None, fixed, pinned, work_limit)
    return want, got


@settings(max_examples=400, deadline=None)
@given(cases())
def test_the_compiled_greedy_places_as_the_reference(case):
    want, (got, work, why) = both(*case)
    assert why is None and got.tolist() == want.tolist()
    assert work >= 0


@settings(max_examples=60, deadline=None)
@given(cases(), st.integers(1, 50))
def test_past_the_work_limit_it_stops(case, limit):
    _, (full, needed, _) = both(*case)
    _, (got, work, why) = both(*case, work_limit=limit)
    if needed > limit:
        assert got is None and why == "work" and limit < work <= needed
    else:
        assert why is None and got.tolist() == full.tolist() and work == needed


def test_past_the_time_budget_it_stops():
    n = 200
    step = Step([ALIGN] * n, np.arange(n), np.arange(n) + n, [0] * n, 2 * n)
    none = np.zeros(0, np.int64)
    offsets, work, status = compiled.place(step.nbytes, step.alloc, step.free, step.stream,
                                           step.length, False, np.arange(n), "first",
                                           (none,) * 4, np.full(n, -1), 0, 0)
    assert status == compiled.PAST_TIME and work > 0
    offsets, work, status = compiled.place(step.nbytes, step.alloc, step.free, step.stream,
                                           step.length, False, np.arange(n), "first",
                                           (none,) * 4, np.full(n, -1), 0, -1)
    assert status == compiled.DONE and sorted(offsets.tolist()) == [ALIGN * k for k in range(n)]


@pytest.mark.parametrize("change, message", [
    (dict(fit="worst"), "fit must be"),
    (dict(starts=np.zeros(2, np.int64)), "same length"),
    (dict(order=np.array([0, 3])), "order must hold"),
    (dict(fixed=(np.zeros(1, np.int64),) * 3 + (np.zeros(2, np.int64),)), "four arrays"),
])
def test_bad_input_is_refused(change, message):
    none = np.zeros(0, np.int64)
    args = dict(sizes=np.full(3, ALIGN), starts=np.arange(3), ends=np.arange(3) + 1,
                streams=np.zeros(3), period=4, share_streams=False, order=np.arange(3),
                fit="first", fixed=(none,) * 4, pinned=np.full(3, -1))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        compiled.place(**args)


@settings(max_examples=60, deadline=None)
@given(cases())
def test_plan_keeps_the_reference_offsets(case):
    """plan() over a whole step (escaped requests, fixed ranges given as pairs) keeps the
    offsets of the reference's greedy."""
    step, strategy, share, fixed, pinned = case
    free = step.free.copy()
    free[::5] = ESCAPED
    step = Step(step.nbytes, step.alloc, free, step.stream, step.length)
    pairs = np.column_stack([fixed[0], fixed[1] - fixed[0]])
    p = plan(step, strategies=(strategy,), share_streams=share, fixed=pairs, pinned=pinned,
             budget_ms=1e6)
    idx = np.flatnonzero(step.planned)
    forever = np.full(len(pairs), FOREVER)
    want = greedy(step.nbytes[idx], step.alloc[idx], step.free[idx],
                  busy_mask(step.alloc[idx], step.free[idx], step.stream[idx], step.length,
                            share),
                  *STRATEGIES[strategy], (fixed[0], fixed[1], np.zeros(len(pairs)), forever),
                  pinned[idx])
    assert p.method == strategy
    assert p.offsets[idx].tolist() == want.tolist()


@settings(max_examples=300, deadline=None)
@given(cases(), st.sampled_from([4, 5, 16, 64]))
def test_the_time_index_places_as_the_scan_of_every_placed_request(case, buckets):
    """With the index by time (``buckets``), the offsets are those of the scan of every placed
    request, the strategy's order, fit, streams, fixed ranges and pinned requests as drawn."""
    step, strategy, share, fixed, pinned = case
    order_key, fit = STRATEGIES[strategy]
    order = _order(step.nbytes, step.alloc, step.free, order_key)
    args = (step.nbytes, step.alloc, step.free, step.stream, step.length, share, order, fit,
            fixed, pinned)
    scan, scan_work, scan_status = compiled.place(*args)
    index, index_work, index_status = compiled.place(*args, buckets=buckets)
    assert scan_status == index_status == compiled.DONE
    assert index.tolist() == scan.tolist() and index_work == scan_work


@settings(max_examples=300, deadline=None)
@given(cases(), st.sampled_from([4, 5, 16, 64]), st.integers(1, 400))
def test_the_time_index_stops_where_the_scan_does(case, buckets, limit):
    """Past a work limit, the index stops at the same request, with the same work and the
    same offsets placed up to it, as the scan of every placed request."""
    step, strategy, share, fixed, pinned = case
    order_key, fit = STRATEGIES[strategy]
    order = _order(step.nbytes, step.alloc, step.free, order_key)
    args = (step.nbytes, step.alloc, step.free, step.stream, step.length, share, order, fit,
            fixed, pinned, limit)
    scan = compiled.place(*args)
    index = compiled.place(*args, buckets=buckets)
    assert index[1:] == scan[1:]
    assert index[0].tolist() == scan[0].tolist()


def test_a_negative_index_is_refused():
    none = np.zeros(0, np.int64)
    with pytest.raises(ValueError, match="buckets must be"):
        compiled.place(np.full(2, ALIGN), np.arange(2), np.arange(2) + 1, np.zeros(2), 4, False,
                       np.arange(2), "first", (none,) * 4, np.full(2, -1), buckets=-1)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_a_step_large_enough_for_the_index_places_and_stops_as_the_scan(fraction):
    """Past INDEX_FROM requests the default turns the index on: the same offsets and work as
    the scan of every placed request, and a work limit cuts both at the same request."""
    n = compiled.INDEX_FROM + 64
    rng = np.random.default_rng(7)
    alloc = np.sort(rng.choice(3 * n - 1, n, replace=False))
    free = np.minimum(alloc + rng.integers(1, n // 2, n), 3 * n - 1)
    free[1::97] = 3 * n + alloc[1::97] // 2             # tails, living on in the next entry
    step = Step(rng.integers(1, 64, n) * ALIGN, alloc, free, np.zeros(n), 3 * n)
    none = np.zeros(0, np.int64)
    args = (step.nbytes, step.alloc, step.free, step.stream, step.length, False,
            _order(step.nbytes, step.alloc, step.free, "size"), "first", (none,) * 4,
            np.full(n, -1))
    _, needed, _ = compiled.place(*args, buckets=0)
    limit = int(needed * fraction)
    scan = compiled.place(*args, limit, buckets=0)
    index = compiled.place(*args, limit)
    assert scan[2] == (compiled.DONE if fraction == 1.0 else compiled.PAST_WORK)
    assert index[1:] == scan[1:] and index[0].tolist() == scan[0].tolist()


@settings(max_examples=300, deadline=None)
@given(cases(), st.sampled_from([0, 4, 16]))
def test_the_work_is_that_of_the_scan_of_every_placed_request(case, buckets):
    """The work the core counts (what its work limit stops) is, request for request, that of
    the reference's scan of every placed request, with the index by time or without."""
    step, strategy, share, fixed, pinned = case
    order_key, fit = STRATEGIES[strategy]
    order = _order(step.nbytes, step.alloc, step.free, order_key)
    args = (step.nbytes, step.alloc, step.free, step.stream, step.length, share, order, fit,
            fixed, pinned)
    want, want_work = scan_work(*args)
    got, work, status = compiled.place(*args, buckets=buckets)
    assert status == compiled.DONE
    assert got.tolist() == want.tolist() and work == want_work
