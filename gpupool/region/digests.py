"""Digests of a planned region's steps (gpupool.region.planned): a step's signature, which
steps of one structure share (hashed again only for a structure other than the last few
steps', :class:`Signatures`), and the digest of a plan's inputs, by which a plan made before is
reused. blake2b over the NumPy arrays' bytes; no device."""

import hashlib
import numbers

import numpy as np


def signature(step):
    """A step's signature: a digest of its structure (``Step.structure``: its length and each
    request's allocation, free and stream, without sizes; 16 bytes). Steps of one signature
    differ only in their sizes, and share one plan made from their envelope."""
    h = hashlib.blake2b(digest_size=16)
    for part in step.structure()[1:]:
        h.update(part)
    h.update(step.length.to_bytes(8, "little"))
    return h.digest()


class Signatures:
    """:func:`signature` of each step given, the last ``kept`` structures' remembered: a step
    of one of them (a training loop's steps repeat a few structures) is compared with its
    last step, elementwise, rather than hashed again, at a fraction of the cost (Note [Step
    time of planned regions]). The signatures are :func:`signature`'s. Holds those steps
    (their arrays are not written after).

    Parameters
    ----------
    kept : int
        Structures remembered, the least recently given dropped past it; >= 1.

    Raises
    ------
    TypeError
        ``kept`` is not an integer (a bool is not).
    ValueError
        ``kept`` is below 1.
    """

    def __init__(self, kept=4):
        if isinstance(kept, bool) or not isinstance(kept, numbers.Integral):
            raise TypeError(f"kept must be an integer >= 1, got {kept!r}")
        if kept < 1:
            raise ValueError(f"kept must be an integer >= 1, got {kept!r}")
        self._kept, self._steps = kept, []      # (step, signature), the last given first

    def __call__(self, step):
        """The signature of ``step`` (a ``placement.Step``), 16 bytes."""
        found = next((i for i, (last, _) in enumerate(self._steps) if _same_structure(last, step)),
                     None)
        sig = signature(step) if found is None else self._steps.pop(found)[1]
        self._steps = [(step, sig)] + self._steps[:self._kept - 1]
        return sig


def _same_structure(one, other):
    """Whether steps ``one`` and ``other`` have one structure (``Step.structure``'s parts
    equal), compared without making it."""
    return one.length == other.length and len(one) == len(other) and \
        np.array_equal(one.alloc, other.alloc) and np.array_equal(one.free, other.free) and \
        np.array_equal(one.stream, other.stream)


def plan_digest(step, fixed, pinned, options):
    """A digest of a plan's inputs: the step (its sizes, events, streams and length), the
    ``fixed`` rows, the ``pinned`` offsets (None: none) and ``options`` (the planner's
    budgets and strategies, a tuple); 16 bytes. The placement is a function of these, so
    equal digests give equal plans."""
    h = hashlib.blake2b(repr((step.length, options, pinned is None)).encode(), digest_size=16)
    for part in (step.nbytes, step.alloc, step.free, step.stream, fixed,
                 () if pinned is None else pinned):
        part = np.ascontiguousarray(part, np.int64)
        h.update(repr(part.shape).encode())
        h.update(part.tobytes())
    return h.digest()
