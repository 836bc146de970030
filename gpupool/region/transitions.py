"""A planned region's transition plans, mixed into gpupool.region.planned.Planner, whose state
they read and write: the plan of the first entry that a steady plan serves when the entry
before it left blocks live in its way (its tails served elsewhere than their steady places,
buffers kept past the exit), placed around them so that the next entry finds the tails at
their steady places (Note [Planned regions], Note [Transitions repaired]).

A transition is made anew each time the blocks left live lie elsewhere. Where they move at
every entry (a window of buffers kept past the exit, the oldest dropped each step), every
entry needs a transition of its own, placed at its exit: the planning a plan is to pay once
is paid at every step. So TRANSITIONS_MAX transitions made in a row (none reused, no steady
plan in place between them, whatever their signatures) give the installed signature up for
GIVE_UP_EXITS exits, as a second bad entry does (Note [Transitions without end]).

Pure Python and NumPy.
"""

import numpy as np

from gpupool.region import tails as _tails
from gpupool.region.anchors import of_plan as anchors
from gpupool.region.meeting import meeting as _meeting
from gpupool.region.meeting import meets as _meets

__all__ = ["REPAIR_SHARE", "TRANSITIONS_MAX", "Transitions"]

REPAIR_SHARE = 16           # a kept plan is repaired when at most 1 in this many of its planned
                            # requests grew (the repair's work: theirs times the step's requests)
TRANSITIONS_MAX = 8         # transitions made in a row before the signature is given up


class Transitions:
    """The transition plans of :class:`gpupool.region.planned.Planner` (its slots hold their
    state: ``_made_in_a_row``, the transitions made in a row)."""

    __slots__ = ()

    def _in_place(self, plan, base, obstacles):
        """Whether the steady ``plan`` (made at ``base``) serves the next entry as it is: every
        block the last entry left live is a tail at its place in it (no larger) or meets none of its
        places; or, when none of ``obstacles`` (blocks that stay) meets its places either,
        none while both are live: a tail of the last entry until the entry frees it
        (``tails.left_live``), a place from its request's allocation to its free. The plan's
        transition would then pin every request at its steady place. A plan kept although
        blocks that stay meet it (the one placed around them did not fit) gets its
        transition, placed around them too."""
        recorded = self._recorded_steps
        k = recorded.carried[0]
        offset, nbytes, end, tail = _tails.left_live(plan.step, recorded.carried, base,
                                                     recorded.at_start)
        placed = tail.copy()
        placed[tail] = plan.offsets[k[tail]] == offset[tail]     # a tail at its own place
        offset, nbytes, end = offset[~placed], nbytes[~placed], end[~placed]
        if not _meets(plan, np.column_stack([offset, nbytes])):
            return True
        return not _meets(plan, obstacles) and not _meeting(plan, offset, nbytes, end).any()

    def _transition_plan(self, step, steady, base, span, obstacles):
        """The plan of the first entry served: the steady plan's tails where it puts them,
        the other requests placed around them, the obstacles, and the blocks the entry before
        left live (its tails until the entry frees them, anything else throughout), so that
        the next entry finds the tails at their steady places. Repaired from the steady plan
        where it can be (:meth:`_transition_repaired`); the repair is used when it maps no
        more than the plan placed whole would: when its top is within the ``span`` bytes
        mapped (so is the whole one's, or it maps more), else when it is no higher than the
        whole one's, then placed too (counted in ``counts["repairs_refused"]`` when it is
        higher; Note [Transitions repaired]). Counts the transitions made in a row, none
        reused (``_made_in_a_row``: TRANSITIONS_MAX of them give the signature up)."""
        plans = self._counts["plans"]
        fixed = self._fixed(step, base, obstacles)
        pinned = np.where(step.tails & step.planned, steady.offsets, -1)
        made = repair = self._transition_repaired(step, steady, fixed, pinned, span)
        if repair is None or repair.nbytes > span:
            made = self._placed(step, fixed, pinned)
            if repair is not None and repair.nbytes <= made.nbytes:
                made = repair
            elif repair is not None:
                self._counts["repairs_refused"] += 1
        self._fell_back = made.fallback is not None
        self._counts["repairs"] += made is repair
        self._counts["transition_repairs"] += made is repair
        self._made_in_a_row = self._made_in_a_row + 1 if self._counts["plans"] > plans else 0
        return made, anchors(made)

    def _transition_repaired(self, step, steady, fixed, pinned, span):
        """The transition of step repaired from its ``steady`` plan: every request whose steady
        place meets none of the ``fixed`` rows (``_fixed``'s) while both live pinned there, the
        tails at their steady places (``pinned``), the others placed around them and the rows
        (counted as a plan). None when ``repair`` is off, more than 1 in REPAIR_SHARE planned
        requests are to be placed (its work is about theirs times the step's requests), their
        bytes do not fit between the steady plan's top and the ``span`` bytes mapped (a repair
        then mostly maps pages, and maps no more than the whole plan only where both are
        placed), or the repair falls back to first fit (counted in
        ``counts["repairs_refused"]``)."""
        if not self.repair:
            return None
        move = step.planned & (pinned < 0) & _meeting(steady, *fixed[:, [0, 1, 3]].T)
        if REPAIR_SHARE * int(move.sum()) > int(step.planned.sum()) or \
                steady.nbytes + int(step.nbytes[move].sum()) > span:
            return None
        made = self._placed(step, fixed, np.where(step.planned & ~move, steady.offsets, pinned))
        self._counts["repairs_refused"] += made.fallback is not None
        return made if made.fallback is None else None

    def _fixed(self, step, base, obstacles, freed=None):
        """``tails.fixed_rows`` (``freed`` passed on) for a plan of step made at ``base``: the
        obstacles throughout, the blocks the last entry left live until the entry frees them."""
        recorded = self._recorded_steps
        return _tails.fixed_rows(step, recorded.carried, base, obstacles, recorded.at_start, freed)
