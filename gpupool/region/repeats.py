"""A planned region's exits that repeat the exit before, taken short by its planner.

A loop that its plan serves at the same places makes the same events entry after entry: the
core hands such an exit no events (each matched the last read's as it came: pt_log in
core/plantable.pxd), the planner reads the step it made last (region/recorded.py) and folds it
into its Seen without NumPy (seen.remember). What is left of the exit is the same decisions
taken again: no plan asked for, the same bounds for request 0. So once an exit has run whose
every decision an exit of the same inputs would take again (:meth:`Repeats._repeats`), such
an exit takes only what moves (:meth:`Repeats._repeated`): the planner's exits, hits, misses
and read, its Seen's count and the entries its plan served; and :meth:`Repeats.bounds`
answers as it did. Any other exit, and any call that changes the plans (``place``,
``record``, ``record_dropped``, ``no_room``, ``clear``), ends it. See Note [Exits that
repeat] in docs/design.md.

Pure Python; mixed into gpupool.region.planned.Planner, whose state it reads and writes.
"""

from gpupool.region.seen import recount, refit_from

__all__ = ["Repeats"]


class Repeats:
    """The shortcut of :class:`gpupool.region.planned.Planner` for exits that repeat."""

    # The inputs of an exit that an exit of the same inputs repeats (None: no such exit since
    # the last change): its arguments but the events, and the options it reads (Planner.exited
    # makes them); and the bounds given since. Planner.__init__ sets both None.
    __slots__ = ("_repeat", "_bounds")

    def _repeats(self, key, sig, seen, recorded, bad, grew, stopped):
        """``key`` when the exit just made (its inputs ``key``, no action returned) would be
        made again, but for its counts, by the next exit of those inputs; else None. Its
        step (of signature ``sig``, its Seen ``seen``) is the one the next read gives again
        (recorded.Recorded.repeating), folded with request 0's bytes that the next folds in
        too (the last two entries asked the same: a step's events hold rounded sizes), seen
        twice at least (``_wants`` plans nothing new) and not a record step's entry or the
        next (``recorded``; both are implied by the reads repeating, but for a record step
        whose request 0 rounds as before), and not waiting to be planned again (``_later``,
        which counts exits); and the entry was not ``bad`` for the plan, nor would the next
        be (a pool grown counts from the plan's second entry on)."""
        if not self._recorded_steps.repeating or \
                self._firsts[0] != self._firsts[1] or seen.count < 2 or recorded or \
                sig in self._later:
            return None
        if self.current is not None and not self._grown and (
                bad or (grew and not stopped and self._entries_on < 2)):
            return None
        return key

    def _repeated(self, hits, misses):
        """An exit of the inputs of :meth:`_repeats`' last: its counts alone. Returns None,
        as that exit did."""
        step, sig = self._recorded_steps.read(None)    # the same step: counted as read
        self._exits += 1
        self._counts["hits"] += hits
        self._counts["exits_repeated"] = self._recorded_steps.repeats
        self._counts["misses"] += misses
        self._folded = recount(self._seen, sig, self._folded)
        if self.current is not None and not self._grown:
            self._entries_on += 1
        return None

    def bounds(self):
        """``(record_over(), first_under(), refit_from)``, which the core takes together (after
        an exit that repeats, what they were: nothing they read moved but a count already past
        2). ``refit_from``: the request of the installed plan's steps from which on the core
        refits one larger than its place (``seen.refit_from``; -1: none, no plan, or a plan in
        the online way's order)."""
        if self._repeat is not None and self._bounds is not None:
            return self._bounds
        seen = self._seen.get(self.current) if self.current in self._plans else None
        # Under a plan in the online way's order the rest of an entry sent online lays out
        # as a plain region's would: no refits (Note [Requests past their place]).
        online = seen is not None and self._plans[self.current][0].method == "start"
        bounds = (self.record_over(), self.first_under(),
                  refit_from(seen) if seen is not None and not online else -1)
        if self._repeat is not None:
            self._bounds = bounds
        return bounds
