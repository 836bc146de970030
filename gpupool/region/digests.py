"""Digests of a planned region's steps (gpupool.region.planned): a step's signature, which
steps of one structure share, and the digest of a plan's inputs, by which a plan made before
is reused. blake2b over the NumPy arrays' bytes; no device."""

import hashlib

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
