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

__all__ = ["ROOM_SHARE", "ROOM_STEPS", "SCALE_SHARE", "SCALE_SLACK", "SCALE_TOLERANCE",
           "SEEN_MAX", "SLACK", "Exceeds", "Seen", "fits", "fold", "recount", "record_over",
           "record_sizes", "record_top", "refit_from", "remember", "with_room"]

SLACK = 0.01        # an envelope whose floor passes the most of its steps' by more is not planned
SEEN_MAX = 64       # signatures remembered (how often each was seen), oldest dropped
SCALE_SLACK = 1     # bytes past request 0's in a record step's scale (Note [Record scale])
SCALE_TOLERANCE = 0.02      # a varied size's least off request 0's scale by more is off it
SCALE_SHARE = 0.25  # a share of the varied sizes' bytes off request 0's scale past which no record
ROOM_SHARE = 0.1    # a size that varied by at most this share of its most gets that much room
ROOM_STEPS = 3      # ... times this over the steps it varied across less one, while that is more


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


def fold(seen, step, first, max_requests, same=False):
    """``seen`` (a :class:`Seen`, or None: none yet) with one more complete ``step``
    (``placement.Step``), whose request 0 asked ``first`` bytes, folded in: its sizes into the
    envelope and least, ``first`` into the most and least, and where the step grows the
    envelope, the floors of the envelope before it (the first time) and of the step into
    ``floor``. A step longer than ``max_requests`` keeps no sizes; a step of another length
    starts the sizes afresh. ``same``: ``seen`` is what this returned for this very ``step``
    and ``max_requests``, so its sizes are in already (no larger anywhere than the envelope,
    no smaller than the least, no floor grows): only the count and ``first`` are folded in,
    with no NumPy (:func:`remember`)."""
    count, envelope, low, r_max, r_min, floor = seen if seen is not None else Seen()
    if same:
        pass
    elif len(step) > max_requests:
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


def remember(seens, sig, step, first, max_requests, last=None):
    """Count a complete ``step`` of signature ``sig``, whose request 0 asked ``first`` bytes,
    in ``seens`` (an OrderedDict of :class:`Seen` by signature, the least recently seen
    first): :func:`fold` it into sig's and drop the least recently seen past SEEN_MAX
    signatures or ``4 * max_requests`` requests of envelopes in all. ``last``: the memo the
    call before returned (None: none). Returns ``(sig's Seen, memo)``.

    A step that repeats costs nothing here but the count: its exits read the step object made
    last (region/recorded.py), which the call before folded into the very Seen found now, and
    ``seens`` holds what it held after that call (only this writes it; its length checked
    too), so fold's ``same`` holds, and so does the bound, which needs no look again."""
    old = seens.pop(sig, None)
    same = last is not None and old is last[0] and step is last[1] and \
        max_requests == last[2] and len(seens) + 1 == last[3]
    seens[sig] = now = fold(old, step, first, max_requests, same)
    while not same and len(seens) > 1 and (len(seens) > SEEN_MAX or sum(
            2 * len(s.envelope) for s in seens.values()) > 4 * max_requests):
        seens.popitem(last=False)
    return now, (now, step, max_requests, len(seens))


def recount(seens, sig, last):
    """:func:`remember` again of the step its last call (``last``: that call's memo) folded
    into sig's Seen, with the ``first`` folded in then: one more count, the rest as fold
    would make it again (as it is; sig stays the most recently seen). Returns the memo for
    the next call (region/repeats.py)."""
    seen = seens[sig]
    # (tuple.__new__: Seen's own __new__ is Python, a call as costly as the rest here)
    seens[sig] = now = tuple.__new__(Seen, (seen[0] + 1, *seen[1:]))
    return (now,) + last[1:]


class Exceeds:
    """Whether an envelope asks more than a plan's sizes anywhere (``(envelope >
    nbytes).any()``, two int64 arrays that are never written once made), the last answer
    given again for the same two: a step that repeats keeps its envelope (:func:`remember`)
    and its plan."""

    __slots__ = ("_last",)

    def __init__(self):
        self._last = (None, None, False)

    def __call__(self, envelope, nbytes):
        was, under, out = self._last
        if was is not envelope or under is not nbytes:
            out = bool((envelope > nbytes).any())
            self._last = (envelope, nbytes, out)
        return out


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


def record_over(seens, sig):
    """The most bytes request 0 of the steps of any signature seen twice in ``seens`` asked
    (their ``r_max``), when those of ``sig`` asked that most and :func:`record_top` leaves room
    past it; else 0 (``Planner.record_over``, which the core reads at every exit). Where sig's
    request 0 varied by at most ROOM_SHARE of its most (a jitter, not a scale), that
    variation again above it: the plan's places have that room (:func:`with_room`), and
    a record plan of sizes scaled by so little would predict nothing (Note [Room for
    jitter])."""
    most = 0                        # (a loop: max over a generator took 4x as long)
    for seen in seens.values():
        if seen.count >= 2 and seen.r_max > most:
            most = seen.r_max
    own = seens.get(sig) or Seen()
    if not (own.r_max >= most and record_top(own) > own.r_max):
        return 0
    spread = own.r_max - own.r_min
    return most + (spread if spread <= own.r_max * ROOM_SHARE else 0)


def refit_from(seen):
    """The first request of the signature ``seen``'s steps from which on the core refits a
    request larger than its place (core/planned.pxd's pl_refit) rather than sending the rest
    of the entry online: the last whose size varied among its steps (0: none did), so that
    no request after it is expected to pass its place too; -1 where ``seen`` keeps no sizes
    (Note [Requests past their place])."""
    if seen.envelope is None or not len(seen.envelope):
        return -1
    varied = np.flatnonzero(seen.envelope != seen.low)
    return int(varied[-1]) if len(varied) else 0


def record_sizes(seen, nbytes):
    """The sizes (int64 bytes, rounded as ``placement.Step``'s) predicted for a record step
    of the signature ``seen`` whose request 0 asks ``nbytes``: those that varied among its
    steps at their most times (``nbytes`` + SCALE_SLACK) over the most request 0 asked, at
    least their most; the others at their most. None where the sizes did not scale with
    request 0: a size that varied whose least is off its most times request 0's least over
    its most by more than SCALE_TOLERANCE (plus request 0's byte and a rounding), as where
    each size varies on its own (Note [Record scale])."""
    envelope, low = seen.envelope, seen.low
    varied = envelope != low
    if seen.r_min and varied.any():
        expected = envelope[varied] * (seen.r_min / seen.r_max)
        off = np.abs(low[varied] - expected) > \
            expected * (SCALE_TOLERANCE + 1 / seen.r_min) + placement.ALIGN
        if envelope[varied][off].sum() > SCALE_SHARE * envelope[varied].sum():
            return None
    scale = (nbytes + SCALE_SLACK) / seen.r_max
    scaled = np.ceil(envelope * scale / placement.ALIGN).astype(np.int64) * placement.ALIGN
    return np.where(varied, np.maximum(scaled, with_room(seen)), envelope)


def with_room(seen):
    """The sizes a plan of the signature ``seen`` gives its places (int64 bytes): the
    envelope, and a size that varied by at most ROOM_SHARE of its most (a jitter, not a
    scale) that variation again above it, times ROOM_STEPS over ``seen.count - 1`` while that
    is more than once (whole ``placement.ALIGN``): such a size's next step passes its most by
    a little as often as not, by more the fewer steps its spread was seen over, and a request
    larger than its place goes online, where it can make the pool grow (Note [Room for
    jitter])."""
    spread = seen.envelope - seen.low
    room = spread if seen.count - 1 >= ROOM_STEPS else \
        -(-spread * ROOM_STEPS // max(seen.count - 1, 1) // placement.ALIGN) * placement.ALIGN
    return seen.envelope + np.where(spread <= seen.envelope * ROOM_SHARE, room, 0)
