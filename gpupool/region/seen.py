"""What a planned region's planner remembers of the complete steps of one signature: how often
it saw them, their sizes' envelope and least, request 0's most and least bytes, and whether the
envelope costs more than a step needs (gpupool.region.planned keeps one per signature).

An envelope plan serves every step of its structure that is no larger, and reserves what the
envelope's step needs at its peak. Where the sizes move together (a batch or a length scaling
them all, as in every recorded run) that is the largest step's own peak. Where they vary each on
its own, no step asks every size's most at once, and the envelope's peak passes every step's:
a plan of it reserves memory the online way does not (Note [Envelopes that no step needs]).

NumPy; no device.
"""

from typing import NamedTuple

import numpy as np

from gpupool.region import placement

__all__ = ["SLACK", "Seen", "fits", "fold", "record_top"]

SLACK = 0.01        # an envelope whose floor passes the most of its steps' by more is not planned


class Seen(NamedTuple):
    """One signature's steps, as the planner keeps them.

    Attributes
    ----------
    count : int
        Complete steps seen.
    envelope, low : numpy.ndarray of int64
        Their sizes' elementwise most and least (bytes, rounded as ``placement.Step``'s);
        empty where the steps are too long to plan.
    r_max, r_min : int
        The most and least bytes their request 0 asked (0: none asked).
    floor : int
        The most of the floors (``placement.step_floor``: bytes live at once) of the steps that
        grew the envelope since its first; 0 while none has (the envelope is a step's own).
    """

    count: int = 0
    envelope: np.ndarray = None
    low: np.ndarray = None
    r_max: int = 0
    r_min: int = 0
    floor: int = 0


def fold(seen, step, first, max_requests):
    """``seen`` (a :class:`Seen`, or None: none yet) with one more complete ``step``
    (``placement.Step``), whose request 0 asked ``first`` bytes, folded in: its sizes into the
    envelope and least, ``first`` into the most and least, and where the step grows the
    envelope, the floors of the envelope before it (the first time) and of the step into
    ``floor``. A step longer than ``max_requests`` keeps no sizes; a step of another length
    starts the sizes afresh."""
    count, envelope, low, r_max, r_min, floor = seen if seen is not None else Seen()
    if len(step) > max_requests:
        envelope = low = step.nbytes[:0]        # never planned: no sizes kept
    elif envelope is None or len(envelope) != len(step):
        envelope = low = step.nbytes
        r_max = r_min = floor = 0
    else:
        if (step.nbytes > envelope).any():
            floor = max(floor or placement.step_floor(step, envelope), placement.step_floor(step))
        envelope = np.maximum(envelope, step.nbytes)
        low = np.minimum(low, step.nbytes)
    r_min = min(r_min or int(first), int(first) or r_min)
    return Seen(count + 1, envelope, low, max(r_max, int(first)), r_min, floor)


def fits(seen, step):
    """Whether a plan of ``step`` (the envelope's step of ``seen``) reserves about what the
    largest of the steps measured needs: its floor at most ``1 + SLACK`` times ``seen.floor``
    (true while no step grew the envelope)."""
    return not seen.floor or placement.step_floor(step) <= (1 + SLACK) * seen.floor


def record_top(seen):
    """The most request 0 of a record step of the signature ``seen`` may ask: its steps' most
    times the factor it varied by (most over least; no room past the most where it never
    varied: Note [Record steps that leave nothing])."""
    return seen.r_max * seen.r_max // seen.r_min if seen.r_min else 0
