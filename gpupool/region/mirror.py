"""A plan's places moved as a whole: mirrored (each place as far from the top as it lay from
the base) or shifted up. The greedy placement puts the largest places lowest; mirrored, they
lie at the top, next to the range's end, where a request larger than its place, sent the online
way, grows the range by the difference instead of by all of its bytes (Note [Plans mirrored] in
docs/design.md; only for a plan around nothing that stays in the range). Shifted: the first-fit
fallback's places moved above the blocks that stay. NumPy."""

import numpy as np

from gpupool.region import placement

__all__ = ["mirrored", "shifted"]


def _moved(plan, offsets):
    """``plan`` with its planned requests at ``offsets`` (the others stay -1), its record of
    how it was made kept."""
    return placement.Plan(plan.step, np.where(plan.step.planned, offsets, -1),
                          method=plan.method, fallback=plan.fallback, tried=plan.tried,
                          planning_ms=plan.planning_ms, work=plan.work)


def mirrored(plan):
    """``plan`` (a ``placement.Plan``) with each planned request's offset ``top - (offset +
    size)``, ``top`` its bytes rounded up to ``placement.ALIGN``: the same peak, the same
    requests apart, the offsets still multiples of ``placement.ALIGN`` (the sizes are)."""
    top = -(-plan.nbytes // placement.ALIGN) * placement.ALIGN
    return _moved(plan, top - plan.offsets - plan.step.nbytes)


def shifted(plan, nbytes):
    """``plan`` with every planned request's offset ``nbytes`` higher."""
    return _moved(plan, plan.offsets + nbytes)
