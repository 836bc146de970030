"""A planned region's per-exit bookkeeping (gpupool.region.steps, behind
``recorded.Recorded.read``) gives the steps, the carried blocks (in their order) and the events
kept that the Python loops it replaces gave (steps_reference.complete_step), on random event
lists: pointers allocated again, freed twice, freed without an allocation, entries without
events, tails and escaped requests; and ``tails.freed_first``, compiled, answers as the NumPy
scan it replaces (steps_reference.freed_first)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from steps_reference import complete_step as reference
from steps_reference import freed_first as freed_first_reference

from gpupool.region import steps, tails
from gpupool.region.placement import Step
from gpupool.region.recorded import Recorded

MARK = (0, 0, 0)


@st.composite
def event_lists(draw):
    """Rows (ptr, nbytes, stream): mostly frees of a live pointer and allocations of a free
    one, some of any pointer of a few; markers where entries start."""
    n_ptrs = draw(st.integers(1, 8))
    # Pointers a page apart, or a power of two apart that makes many share the table's hash
    # slots (the compiled bookkeeping's pointer table probes past them).
    spacing = draw(st.sampled_from([4096, 1 << 40, 1 << 59]))
    live, events = set(), []
    for _ in range(draw(st.integers(0, 60))):
        kind = draw(st.sampled_from(["alloc", "alloc", "free", "free", "any", "mark"]))
        if kind == "mark":
            events.append(MARK)
            continue
        ptr = draw(st.integers(1, n_ptrs)) * spacing
        if kind == "alloc" or (kind == "any" and draw(st.booleans())):
            free = [p for p in range(spacing, (n_ptrs + 1) * spacing, spacing) if p not in live]
            if kind == "alloc" and free:
                ptr = draw(st.sampled_from(free))
            live.add(ptr)
            events.append((ptr, draw(st.integers(1, 5000)), draw(st.integers(0, 2))))
        else:
            if kind == "free" and live:
                ptr = draw(st.sampled_from(sorted(live)))
            live.discard(ptr)
            events.append((ptr, 0, 0))
    return events


def compiled(events):
    """(events kept, step, carried) by the compiled bookkeeping, as the reference gives them."""
    rows = np.asarray(events, np.int64).reshape(-1, 3)
    lo, made, carried = steps.complete(rows)
    return [tuple(r) for r in rows[lo:].tolist()], made, as_dict(carried)


def as_dict(carried):
    """Carried blocks (arrays of request numbers, pointers, bytes) as the reference's dict."""
    k, ptr, nbytes = (a.tolist() for a in carried)
    return dict(zip(k, zip(ptr, nbytes)))


def same_step(made, step):
    if step is None:
        return made is None
    nbytes, alloc, free, stream, length = made
    got = Step(nbytes, alloc, free, stream, length)
    return got.structure() == step.structure() and got.nbytes.tolist() == step.nbytes.tolist()


@settings(max_examples=400, deadline=None)
@given(event_lists())
def test_the_compiled_bookkeeping_is_the_reference(events):
    kept, step, carried = reference(events)
    got_kept, made, got_carried = compiled(events)
    assert got_kept == [tuple(e) for e in kept]
    assert list(got_carried.items()) == list(carried.items())
    assert same_step(made, step)


@settings(max_examples=100, deadline=None)
@given(st.lists(event_lists(), min_size=1, max_size=5))
def test_the_planner_keeps_the_reference_steps_across_exits(batches):
    """Exit after exit, the planner's steps and carried blocks are the reference's run on the
    events it would have kept."""
    recorded = Recorded()
    kept = []
    for batch in batches:
        kept, step, carried = reference(kept + list(batch))
        made, _ = recorded.read(np.asarray(batch, np.int64).reshape(-1, 3))
        assert list(as_dict(recorded.carried).items()) == list(carried.items())
        assert [tuple(r) for r in recorded.kept.tolist()] == [tuple(e) for e in kept]
        assert (made is None) == (step is None)
        if step is not None:
            assert made.structure() == step.structure()
            assert made.nbytes.tolist() == step.nbytes.tolist()


@settings(max_examples=400, deadline=None)
@given(event_lists(), st.data())
def test_freed_first_is_the_numpy_scan(events, data):
    """Asked about the pointers of the events (some of them, or others), or with a free of
    every block of the entry before put first in the last entry."""
    pointers = sorted({e[0] for e in events if e[0]} | {1 << 12, 1 << 45})
    ptr = data.draw(st.lists(st.sampled_from(pointers), max_size=6))
    if data.draw(st.booleans()) and any(e == MARK for e in events):
        last = max(i for i, e in enumerate(events) if e == MARK)
        events = events[:last + 1] + [(p, 0, 0) for p in ptr] + events[last + 1:]
    assert tails.freed_first(events, ptr) == freed_first_reference(events, ptr)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="3 columns"):
        steps.complete(np.zeros((2, 4), np.int64))
    with pytest.raises(ValueError, match="3 columns"):
        steps.freed_first(np.zeros((2, 4), np.int64), np.zeros(1, np.int64))
