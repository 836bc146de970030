"""A planned region's recorded events, read at each exit, made into complete steps: the step of
the entry before the last one (its tails' frees looked up in the last), its signature, and the
blocks the last entry left live (gpupool.region.planned decides from them).

A step that repeats costs its exit no work here. The core compares each exit's events with the
last exit's and hands over none when they are the same (core/planned.pxd, PL_READ): a loop served
by its plan at the same places records the same events entry after entry. What a read makes
depends on its own events and the last read's only (the step of the entry before, its frees
looked up in the last entry; the blocks the last entry left live; whether it freed those of
the entry before first), so once three reads in a row are the same, a read makes what the last
one made, and that is returned without looking at the events (Note [Step time of planned
regions]).

NumPy, the step's assembly compiled (gpupool.region.steps); no device.
"""

import numpy as np

from gpupool.region import placement
from gpupool.region import steps as _steps
from gpupool.region import tails as _tails
from gpupool.region.digests import Signatures as _Signatures

__all__ = ["Recorded", "SAME_READS"]

# Reads in a row the same as the one before, after which a read makes what the last one made:
# the step, the blocks left live and whether they were freed first depend on the events of the
# read and of the read before it (one marker each: an entry per read).
SAME_READS = 2


class Recorded:
    """The events a planned region's core recorded, as complete steps.

    Attributes
    ----------
    carried : tuple of three int64 arrays
        The last entry's blocks live at its exit: their request numbers in it, pointers and
        bytes (``steps.complete``'s order).
    at_start : bool
        Whether the last entry freed the blocks the one before it left live before its own
        first allocation (``tails.freed_first``); true where the one before left none: the
        plan's step's own frees before its first allocation then decide
        (``tails.left_live``; Note [Tails freed at the start]).
    reads, repeats : int
        Reads in all, and those that returned the last read's step without making it.
    """

    def __init__(self):
        # The events since the step before the last: rows (ptr, nbytes, stream), nbytes 0 a
        # free, ptr 0 where an entry starts.
        self._events = np.zeros((0, 3), np.int64)
        self._signature = _Signatures()     # signature(), the last structures' kept
        self.carried = (np.zeros(0, np.int64),) * 3
        self.at_start = False
        self._window = self._events         # the last read's events
        self._one_entry = False             # they hold one entry's marker
        self._same = 0                      # reads in a row the same as the one before
        self._made = (None, None)           # the last read's (step, signature)
        self.reads = self.repeats = 0

    @property
    def repeating(self):
        """Whether the next read, given no events, returns the step this one returned
        without looking at the events (SAME_READS reads in a row the same)."""
        return self._same >= SAME_READS and self._one_entry

    @property
    def kept(self):
        """The events kept for the next read: those since the step before the last, as an
        (n, 3) int64 array of rows (ptr, bytes, stream)."""
        return self._events

    def read(self, events):
        """Fold in the events recorded since the last read and complete a step.

        Parameters
        ----------
        events : numpy.ndarray of int64, shape (n, 3), or a sequence of such rows, or None
            The rows (ptr, bytes, stream) recorded since the last read, in order; None: the
            same as the last read's (the core compared them).

        Returns
        -------
        (step, signature)
            The step of the entry before the last one (a ``placement.Step``) and its
            signature (``digests.signature``, 16 bytes); (None, None) before two entries or
            when that entry made no event.
        """
        self.reads += 1
        if events is None:
            self._same += 1
            if self._same >= SAME_READS and self._one_entry:
                self.repeats += 1
                return self._made
            events = self._window
        else:
            self._same = 0
            self._window = events = np.asarray(events, np.int64).reshape(-1, 3)
            self._one_entry = int(np.count_nonzero(events[:, 0] == 0)) == 1
        self._events = np.concatenate([self._events, events])
        self.at_start = not len(self.carried[1]) or \
            _tails.freed_first(self._events, self.carried[1])
        lo, made, self.carried = _steps.complete(self._events)
        self._events = self._events[lo:]
        if made is None:
            self._made = (None, None)
        else:
            step = placement.Step(*made)
            self._made = (step, self._signature(step))
        return self._made
