"""Which places of a plan blocks meet (gpupool.region.meeting), checked against every pair of a
place and a block, on random places and blocks."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gpupool.region import placement
from gpupool.region.meeting import meeting, meets

FOREVER = np.iinfo(np.int64).max


@st.composite
def cases(draw):
    """A plan of random places (some escaped) and random blocks, in units of 512 bytes."""
    n = draw(st.integers(0, 12))
    length = 2 * n + 2
    alloc = np.arange(n) * 2
    free = [draw(st.sampled_from([placement.ESCAPED, a + 1, length + a // 2]))
            if a + 1 < length else placement.ESCAPED for a in alloc]
    free = [f if f == placement.ESCAPED or f < length + a else placement.ESCAPED
            for f, a in zip(free, alloc)]
    sizes = draw(st.lists(st.integers(1, 8), min_size=n, max_size=n))
    step = placement.Step(np.array(sizes, np.int64) * 512, alloc, free, np.zeros(n), length)
    offsets = [draw(st.integers(0, 16)) * 512 if f != placement.ESCAPED else -1 for f in free]
    m = draw(st.integers(0, 6))
    offset = np.array(draw(st.lists(st.integers(-4, 20), min_size=m, max_size=m)), np.int64)
    nbytes = np.array(draw(st.lists(st.integers(0, 6), min_size=m, max_size=m)), np.int64)
    end = draw(st.lists(st.sampled_from([0, 1, 3, 7, length, FOREVER]), min_size=m, max_size=m))
    return (placement.Plan(step, offsets, method="size"), offset * 512, nbytes * 512,
            np.array(end, np.int64))


@settings(max_examples=300, deadline=None)
@given(cases())
def test_meeting_is_every_place_that_shares_bytes_with_a_block_while_both_live(case):
    plan, offset, nbytes, end = case
    step = plan.step
    want = np.zeros(len(step), bool)
    for k in np.flatnonzero(step.planned):
        lo, hi = plan.offsets[k], plan.offsets[k] + step.nbytes[k]
        want[k] = any(a < hi and lo < a + b and b > 0 and step.alloc[k] < e
                      for a, b, e in zip(offset, nbytes, end))
    assert meeting(plan, offset, nbytes, end).tolist() == want.tolist()
    # In space alone: the blocks kept throughout.
    some = nbytes > 0
    forever = meeting(plan, offset, nbytes, np.full(len(end), FOREVER))
    assert meets(plan, np.column_stack([offset, nbytes])[some]) == bool(forever.any())


def test_blocks_given_in_arrays_of_different_lengths_are_refused():
    step = placement.Step([512], [0], [1], [0], 2)
    plan = placement.Plan(step, [0], method="size")
    with pytest.raises(ValueError, match="same length"):
        meeting(plan, [0, 512], [512], [1])
