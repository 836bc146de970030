"""A step's signature (gpupool.region.digests): :class:`Signatures`, which compares a step with
the last steps of the structures it remembers instead of hashing it again, gives
:func:`signature`'s digest for every step of a random sequence of steps of a few structures,
sizes varying; it hashes only a structure it does not remember."""

import pytest

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool.region import digests
from gpupool.region.placement import ESCAPED, Step


@st.composite
def steps_of_few_structures(draw):
    """Steps of a few structures: each a step of 1-4 requests, or one of them again with other
    sizes, with one event moved, one free escaped or the stream changed."""
    made = []
    for _ in range(draw(st.integers(1, 12))):
        if made and draw(st.booleans()):
            base = draw(st.sampled_from(made))
            alloc, free, stream = base.alloc.copy(), base.free.copy(), base.stream.copy()
            change = draw(st.sampled_from(["sizes", "free", "escaped", "stream"]))
            if change == "free" and free[-1] != ESCAPED and free[-1] + 1 < base.length:
                free[-1] += 1
            elif change == "escaped":
                free[-1] = ESCAPED
            elif change == "stream":
                stream[0] += 1
            nbytes = [draw(st.integers(1, 1 << 20)) for _ in range(len(base))]
            made.append(Step(nbytes, alloc, free, stream, base.length))
            continue
        n = draw(st.integers(1, 4))
        alloc = np.arange(n) * 2
        made.append(Step([draw(st.integers(1, 1 << 20)) for _ in range(n)], alloc, alloc + 1,
                         [draw(st.integers(0, 1)) for _ in range(n)],
                         2 * n + draw(st.integers(0, 2))))
    return made


@settings(max_examples=200, deadline=None)
@given(steps_of_few_structures(), st.integers(1, 4))
def test_signatures_are_the_digests(steps, kept):
    signatures = digests.Signatures(kept)
    for step in steps:
        assert signatures(step) == digests.signature(step)


def test_a_remembered_structure_is_not_hashed_again(monkeypatch):
    hashed = []
    monkeypatch.setattr(digests, "signature", lambda step: hashed.append(step) or b"sig")
    signatures = digests.Signatures(kept=2)
    one = Step([512, 1024], [0, 1], [2, 3], [0, 0], 4)
    other = Step([512, 1024], [0, 1], [2, 3], [0, 1], 4)
    third = Step([512], [0], [1], [0], 2)
    for step in (one, Step([2048, 512], [0, 1], [2, 3], [0, 0], 4), other, one, other):
        signatures(step)
    assert hashed == [one, other]       # one and other alternate, both remembered
    signatures(third)                   # third drops one, the least recently given
    signatures(other)
    assert hashed == [one, other, third]
    signatures(one)
    assert hashed == [one, other, third, one]


@pytest.mark.parametrize("kept, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError),
                                         (True, TypeError), ("2", TypeError)])
def test_bad_kept_is_refused(kept, error):
    with pytest.raises(error, match="kept must be an integer >= 1, got"):
        digests.Signatures(kept)
