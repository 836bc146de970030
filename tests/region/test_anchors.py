"""A plan's anchors (gpupool.region.anchors, behind planned.anchors) are the NumPy
reference's (greedy_reference.anchors), on the greedy's plans and on arbitrary offsets with
many equal ends."""

import numpy as np
import pytest
from greedy_reference import anchors as reference
from hypothesis import given, settings
from hypothesis import strategies as st
from test_greedy import cases

from gpupool.region import anchors as compiled
from gpupool.region.placement import ALIGN, ESCAPED, Plan, Step, plan
from gpupool.region.planned import anchors


def escaping(step, every):
    """``step`` with every ``every``-th request escaped."""
    free = step.free.copy()
    free[::every] = ESCAPED
    return Step(step.nbytes, step.alloc, free, step.stream, step.length)


@settings(max_examples=150, deadline=None)
@given(cases(), st.integers(2, 7))
def test_the_anchors_of_a_plan_are_the_reference_ones(case, every):
    step = escaping(case[0], every)
    made = plan(step, strategies=(case[1],), share_streams=case[2])
    assert anchors(made).tolist() == reference(made).tolist()


@settings(max_examples=150, deadline=None)
@given(cases(), st.integers(2, 7), st.data())
def test_the_anchors_of_any_offsets_are_the_reference_ones(case, every, data):
    step = escaping(case[0], every)
    units = data.draw(st.lists(st.integers(0, 6), min_size=len(step), max_size=len(step)))
    offsets = np.where(step.planned, np.array(units) * ALIGN, -1)
    made = Plan(step, offsets, method="size")
    got = anchors(made)
    assert got.tolist() == reference(made).tolist()
    assert (got[~step.planned] == -1).all()


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="same length"):
        compiled.anchors([0, 512], [512], [0, 1], [2, 3], [True, True])
