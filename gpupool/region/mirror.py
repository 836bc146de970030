"""A plan's layout mirrored: each place moved to the same distance from the top as it lay from
the base. The greedy placement puts the largest places lowest; mirrored, they lie at the top,
next to the range's end, where a request larger than its place, sent the online way, grows the
range by the difference instead of by all of its bytes (Note [Plans mirrored] in
docs/design.md). Only for a plan around nothing that stays in the range. NumPy."""

import numpy as np

from gpupool.region import placement

__all__ = ["mirrored"]


def mirrored(plan):
    """``plan`` (a ``placement.Plan``) with each planned request's offset ``top - (offset +
    size)``, ``top`` its bytes rounded up to ``placement.ALIGN``: the same peak, the same
    requests apart, the offsets still multiples of ``placement.ALIGN`` (the sizes are)."""
    top = -(-plan.nbytes // placement.ALIGN) * placement.ALIGN
    step = plan.step
    return placement.Plan(step, np.where(step.planned, top - plan.offsets - step.nbytes, -1),
                          method=plan.method, tried=plan.tried, planning_ms=plan.planning_ms,
                          work=plan.work)
