"""What a planned region (``Region(plan=True)``) serves its next entry from: its steps, recorded
by the core, their signatures, the plans it keeps and when it gives one up.

The core records the region's allocations and frees in order, with a marker where each entry starts
(core/plantable.pxd). At each exit the step before the one that just ended is complete (the entry
that just ended has freed its tails), so it becomes a :class:`placement.Step`, keyed by its
signature: its structure (the order of its allocations and frees, their streams), without sizes.
Each signature keeps its envelope, the elementwise most of the sizes its steps asked for. A
signature seen twice is planned from its envelope (:func:`placement.plan`, within a budget of
work), and planned again when a step asks more than the plan covers; the next entry is served from
the plan of the last complete step's signature, request k at its place whenever it asks no more
than the place's bytes (a smaller step's blocks lie inside the envelope's places, so they stay
apart as those do). Steps of fixed sizes are the case where the envelope is the step itself.

A record step (an entry whose request 0 asks more bytes than any step of a signature seen
twice, its plan kept or not, while the installed plan's steps asked the most of those, whatever
the steps before it) is planned at that request: the core sends the request online and swaps
the region's record slow path in for the allocation's (core/planned.pxd, ``pl_record``), which
calls :meth:`Planner.record_plan`; the plan is the installed plan's structure, the sizes that varied
among its signature's steps scaled by the request's bytes over the most a step's request 0
asked, placed around the blocks live then, and the entry's later requests are served from it (a
request larger than its place misses alone; places past the mapped end map pages). The entry
after it keeps that plan when the record entry left a block at its places (else the steady plan
serves it at once); the next gets a transition plan of the grown envelope (or its steady
plan at once, when the blocks left live meet none of its places while live). Once a record step
has been planned, transition plans map pages for their places too (the record plan leaves the
online way no room past its own top), and so does a signature's steady plan kept at the range's
base, or that one placed again around blocks that stay in its way.

A plan holds no memory: its places are addresses in the pool's segments (the core chooses the range
where the region's own step already lies, core/planned.pxd), taken when they are free, so a
deviating step costs misses that go the online way. The core compares each event of an entry with
the plan's step (request k's event, stream and size, the free of a served block at its event) and
sends the rest of the entry online at the first difference (another structure, a request larger
than its place, unless refitted in a plan by size where no later size varied: Note [Requests
past their place]; request 0 far under the least its steps asked: :meth:`Planner.first_under`); such
an entry does not count against the plan. One whose requests on the plan's step get less than
``min_hit_rate`` served at their places, or during which (after the first entry, where the tails of
the entry before still lie outside the plan) the region's requests grew the pool, has the plan
placed again around the blocks in its way; a second such entry gives the plan up for GIVE_UP_EXITS
exits, and so do TRANSITIONS_MAX transitions made in a row (region/transitions.py). See Note
[Planned regions] in docs/design.md.

Pure Python and NumPy; the region (region/region.pyx) moves the events and the plans between
this and the core.
"""

from collections import OrderedDict
from types import MappingProxyType

import numpy as np

from gpupool.region import options as _options
from gpupool.region import placement
from gpupool.region.anchors import of_plan as anchors
from gpupool.region.digests import plan_digest as _digest
from gpupool.region.digests import signature
from gpupool.region.meeting import meets as _meets
from gpupool.region.mirror import mirrored as _mirrored
from gpupool.region.mirror import shifted as _shifted
from gpupool.region.recorded import Recorded as _Recorded
from gpupool.region.repeats import Repeats as _Repeats
from gpupool.region.seen import SEEN_MAX
from gpupool.region.seen import Exceeds as _Exceeds
from gpupool.region.seen import fits as _fits
from gpupool.region.seen import record_over as _record_over
from gpupool.region.seen import record_sizes as _record_sizes
from gpupool.region.seen import record_top as _record_top
from gpupool.region.seen import remember as _remember
from gpupool.region.seen import with_room as _with_room
from gpupool.region.transitions import REPAIR_SHARE
from gpupool.region.transitions import TRANSITIONS_MAX as _TRANSITIONS_MAX
from gpupool.region.transitions import Transitions as _Transitions

__all__ = ["Planner", "anchors", "signature"]

STRIKES = 2                 # bad entries before a plan is given up
RETRY_EXITS = 2             # exits before a plan that did not fit is tried again, doubled
                            # each time it does not fit again, up to GIVE_UP_EXITS
GIVE_UP_EXITS = 64          # exits before a plan given up is made again
REUSE_MAX = 16              # plans kept by the digest of what they were made from
GREEDY_MAX = 8192           # planned requests a step may have to be planned: the greedy's work
                            # grows as their square (Note [Planned regions])
# The greedy strategies each plan tries, the lowest kept, ties to the first: the online way's
# order unless another places lower (Note [Plans in the online way's order]); size x lifetime
# fills the holes of blocks the online era scattered (Note [Plans in two orders]).
STRATEGIES = ("start", "size", "area")
UNDER = 4                   # request 0 under 1 / UNDER of the least its plan's steps asked is
                            # off the plan's step (:meth:`Planner.first_under`)
MIRROR = True               # plans mirrored (Note [Plans mirrored])


class Planner(_Repeats, _Transitions):
    """A planned region's decisions.

    Parameters
    ----------
    max_plans : int
        Plans kept (one per signature), the least recently used dropped past it; >= 1.
    max_plan_requests : int
        Requests of the kept plans together (their host memory), the least recently used
        dropped past it; a step of more requests than this is never planned; >= 1.
    budget_work : int
        Work per greedy strategy of a plan, pooled: ``placement.plan``'s ``budget_work`` is
        this times the strategies (units of one candidate place examined), shared in their
        order, so a strategy may use what another left. It bounds planning the same on any
        machine and load, so the same steps get the same plans; >= 1.
    budget_ms : float
        Milliseconds of wall-clock time one plan's greedy placement may take
        (``placement.plan``'s ``budget_ms``), a safety net for the allocating thread; > 0.
    min_hit_rate : float
        Share of an entry's planned requests that must be served at their place; 0 to 1.
    record : bool
        Plan a record step at its first request (:meth:`record_plan`): an entry of the installed
        plan's structure whose request 0 asks past its steps' most, where it varied among them
        (up to that most times the factor it varied by: ``seen.record_top``). False: such an
        entry runs online up to its first request larger than its place, as any larger step.
    strategies : tuple (or list) of str
        The greedy strategies each plan runs, the plan of the lowest top kept (within the
        pooled ``budget_work``), ties to the first, and a steady plan the first's within the
        memory mapped: keys of ``placement.STRATEGIES`` (``"start"``: allocation order, the
        online way's; ``"size"``, ``"area"``: by size, by size x lifetime; ``"lifetime"``;
        ``"size-best"``, ``"lifetime-best"``: best fit), side by side, each on a thread of
        its own (about the time of the slowest); not empty, no name twice.
    repair : bool
        Try a kept plan repaired for a step that grew (:meth:`_repaired`: only the requests
        that grew placed again), and a transition repaired from its steady plan
        (:meth:`_transition_repaired`), before placing the step whole.

    Raises
    ------
    TypeError
        An option of another type: an integer (not a bool) for the first two and
        ``budget_work``, a real number for ``budget_ms`` and ``min_hit_rate``, a bool for
        ``record`` and ``repair``, a tuple or list of strings for ``strategies``.
        The message names the option, its value and what it accepts.
    ValueError
        An option out of its range (NaN included), named with its value and the range, or
        ``strategies`` empty or naming a strategy not in ``placement.STRATEGIES``. The options
        are the planner's attributes, checked when assigned; any other assigned: AttributeError.
    """
    (max_plans, max_plan_requests, budget_work, budget_ms, min_hit_rate, strategies, repair,
     record) = map(_options.option, _OPTIONS := ("max_plans", "max_plan_requests",
                   "budget_work", "budget_ms", "min_hit_rate", "strategies", "repair", "record"))
    __slots__ = tuple("_" + k for k in _OPTIONS) + (    # no others: a misspelt one raises
        "_firsts", "_recorded", "_record_places", "_fresh", "_recorded_steps", "_seen", "_folded",
        "_exceeds", "_plans", "_later", "_waits", "_made_from", "_exits", "current", "base",
        "_transition", "_grown", "_past", "_fell_back", "_relayout", "_entries_on", "_strikes",
        "_wanted", "_counts", "_made_in_a_row")

    def __init__(self, max_plans=4, max_plan_requests=1 << 16,
                 budget_work=placement.BUDGET_WORK, budget_ms=placement.BUDGET_MS,
                 min_hit_rate=0.5, record=True, strategies=STRATEGIES, repair=True):
        self.max_plans, self.max_plan_requests = max_plans, max_plan_requests
        self.budget_work, self.budget_ms, self.min_hit_rate = budget_work, budget_ms, min_hit_rate
        self.record, self.strategies, self.repair = record, strategies, repair
        self._repeat = self._bounds = self._wanted = None   # (_wanted: the step to place)
        self._firsts = []           # the last two entries' request 0's requested bytes
        self._recorded = 0          # exits since a record step's plan was installed (0: none)
        self._record_places = np.zeros(0, np.int64)     # its places' addresses
        self._fresh = False         # the next plan installed is a transition (after a record)
        self._recorded_steps = _Recorded()  # the events read, made into complete steps
        self._seen = OrderedDict()
        self._folded, self._exceeds = None, _Exceeds()      # (seen.remember's memos)
        self._plans = OrderedDict()     # signature -> (Plan, anchors)
        self._later = OrderedDict()     # signature -> the exit before which it is not planned
        self._waits = OrderedDict()     # signature -> exits its last plan not fitting waited
        self._made_from = OrderedDict()     # digest of a plan's inputs -> the plan made
        self.current = None         # the signature whose plan is installed
        self.base = 0               # the address of its range (0: none)
        self._transition = False    # the plan installed is the current one's transition
        self._grown = False         # the step to plan asks more than the current plan covers
        self._past = False          # the steady plan installed may map pages (:meth:`place`)
        self._fell_back = False     # the last plan made is first fit (its fallback's limit)
        self._relayout = False      # the current plan served its last entry badly
        self._entries_on = 0        # entries served by the current plan so far
        self._exits = self._strikes = self._made_in_a_row = 0
        # "work": the plans' work units in all; "past_*": plans that fell back to first fit,
        # by the limit that stopped them (placement.Plan.fallback); "reused": plans not made
        # again, their inputs the same as a plan's made before (:meth:`_placed`); "repairs",
        # "repairs_refused": kept plans and transitions repaired, and repairs not used
        # (:meth:`_repaired`, :meth:`_transition_repaired`); "transition_repairs": the latter;
        # "exits_repeated": exits whose step was the last exit's, not made again
        # (region/recorded.py); "envelopes_refused": plans not made, their envelope's floor
        # past its steps' (region/seen.py).
        self._counts = {"plans": 0, "planning_ms": 0.0, "work": 0, "hits": 0, "misses": 0,
                        "installs": 0, "given_up": 0, "no_room": 0, "records": 0, "reused": 0,
                        "record_ms": 0.0, "records_dropped": 0, "past_work": 0, "repairs": 0,
                        "past_time": 0, "past_requests": 0, "repairs_refused": 0,
                        "transition_repairs": 0, "exits_repeated": 0, "envelopes_refused": 0}

    def exited(self, events, hits, misses, grew, stopped=False, first=0):
        """An entry has exited: ``events`` recorded since the last call (rows of ptr, bytes,
        stream as integers, an (n, 3) int64 array or any sequence of such rows; bytes 0: a
        free; ptr 0: an entry starts; None: the same rows as the last call's), the entry's
        planned requests served (``hits``) and not (``misses``, the request that left the
        plan's step included when it ``stopped``), whether its requests grew the pool, and
        its request 0's requested bytes (``first``; 0: it made none). An entry that left the
        plan's step (another structure, or larger) is not the plan's failure: only the
        requests refused on the plan's step count against it. Returns ``"layout"`` when a
        plan is to be installed (the region then asks the core where it goes and calls
        :meth:`place`), ``"clear"`` to serve the next entry online, or None to keep what is
        installed."""
        key = (hits, misses, grew, stopped, first, self.min_hit_rate, self.max_plan_requests,
               self.record)
        if events is None and key == self._repeat:
            return self._repeated(hits, misses)     # (region/repeats.py)
        self._repeat = self._bounds = None
        step, sig = self._recorded_steps.read(events)
        self._firsts = (self._firsts + [int(first)])[-2:]
        self._exits += 1
        self._counts["hits"] += hits
        self._counts["exits_repeated"] = self._recorded_steps.repeats
        self._counts["misses"] += misses
        action = None
        self._grown = False
        if step is not None:
            seen = self._remember(sig, step, self._firsts[0])
            kept = self._plans.get(sig)
            if kept is not None and len(seen.envelope) != len(kept[0].step):
                # Its sizes are no longer kept (max_plan_requests lowered past its length):
                # nor is its plan.
                del self._plans[sig]
                kept = None
                if sig == self.current:
                    self.current, action = None, "clear"
            self._grown = sig == self.current and kept is not None and \
                self._exceeds(seen.envelope, kept[0].step.nbytes)
        recorded, self._recorded = self._recorded, (self._recorded + 1) % 3 \
            if self._recorded else 0
        if recorded == 1 and not self._record_held():
            # The record step's entry left no block at its plan's places (it made request 0
            # alone, or freed all): nothing ties the next entry to that plan, whose places
            # lie around request 0's block; the steady plan serves it (Note [Record steps
            # that leave nothing]).
            self._recorded, recorded = 0, 2
        # The entry after a record step's (whose tails lie at that plan's places) gets a
        # transition plan, of the envelope grown by the record step when it has completed.
        self._fresh = self._fresh or recorded == 2
        bad = False
        if self.current is not None and not self._grown:
            # A step larger than the plan is not the plan's fault: it is planned again; nor
            # are the record step's entry and the next, served by a plan of predicted sizes.
            self._entries_on += 1
            tried = hits + misses - bool(stopped)
            bad = not recorded and ((tried and hits < self.min_hit_rate * tried) or
                                    (grew and self._entries_on > 1 and not stopped))
            self._strikes += bool(bad)
            # A bad entry has the plan placed again around the blocks in its way; a second
            # gives it up for GIVE_UP_EXITS exits. A transition that the entry left at its
            # start (another structure's) was laid out around the blocks of the entry before
            # it, which are gone: it is laid out again around this entry's.
            self._relayout = bool(bad) or (self._transition and stopped and not hits)
            if self._strikes >= STRIKES or self._made_in_a_row >= _TRANSITIONS_MAX:
                self._made_in_a_row = 0
                self._later[self.current] = self._exits + GIVE_UP_EXITS
                self._plans.pop(self.current, None)
                self.current = None
                self._counts["given_up"] += 1
                action = "clear"
        if step is not None and self._wants(sig, step, seen.count):
            wanted = placement.Step(_with_room(seen), step.alloc, step.free, step.stream,
                                    step.length)
            if _fits(seen, wanted):
                self._wanted = (sig, wanted)
                return "layout"
            # Its sizes vary each on its own: no step needs the envelope's memory, and a plan
            # of smaller sizes would miss (Note [Envelopes that no step needs]).
            self._counts["envelopes_refused"] += 1
            self._plans.pop(sig, None)
            self._later[sig] = self._exits + RETRY_EXITS    # (each check sorts a step)
            if sig == self.current:
                self.current, action = None, "clear"
        if (self._relayout or self._fresh) and self.current in self._plans:
            self._wanted = (self.current, self._plans[self.current][0].step)
            return "layout"
        if action is None and step is not None:
            self._repeat = self._repeats(key, sig, seen, recorded, bad, grew, stopped)
        return action

    def _wants(self, sig, step, count):
        """Whether a complete step of signature sig, seen ``count`` times, is planned now."""
        if self._later.get(sig, 0) > self._exits:
            return False
        self._later.pop(sig, None)
        while len(self._later) > SEEN_MAX:
            self._later.popitem(last=False)
        # Right after a record step's entry its plan stays (its tails lie at its places).
        return not (count < 2 or (sig == self.current and (self._recorded == 2 or (
                    not self._transition and not self._grown and not self._relayout and
                    not self._fresh))) or
                    len(step) > self.max_plan_requests or not step.planned.any() or
                    int(step.planned.sum()) > GREEDY_MAX)

    def _remember(self, sig, step, first):
        """Count a complete step of signature sig, whose request 0 asked ``first`` bytes, and
        fold its sizes into the signature's envelope (their elementwise most, bytes), their
        elementwise least, and the most and least ``first`` (a record step's plan scales the
        requests whose sizes varied by its own request 0's bytes over the most; far under the
        least, request 0 is off the plan's step: :meth:`first_under`). Returns its
        ``seen.Seen``. Bounded: SEEN_MAX signatures and ``4 * max_plan_requests`` requests of
        envelopes in all, the least recently seen dropped past either (``seen.remember``)."""
        now, self._folded = _remember(self._seen, sig, step, first, self.max_plan_requests,
                                      self._folded)
        return now

    def place(self, base, span, obstacles):
        """The plan to install for the step :meth:`exited` asked a layout for, as ``(Plan,
        anchors)``: the one kept for its signature when it was made at ``base`` and none of
        ``obstacles`` (an (m, 2) array of (offset from base, bytes) that stay where they are)
        meets its places, else a new one placed around them (when that one does not fit the
        ``span`` bytes of memory from ``base`` and the one kept does, the kept one stays);
        None when neither fits (mapping more for it would cost memory the online way does not
        take; the signature is planned again RETRY_EXITS exits later, when the blocks in the
        way may have gone, the wait doubled at each plan that still does not fit). Once a
        record step has been planned, a plan kept at ``base`` for a step no larger, or that
        one placed again around the obstacles, is installed past ``span`` (its places map
        pages, :meth:`growing`): the record plan mapped up to its own top only, and the plan
        kept, its places under blocks that stay refused, sends a share of each entry online,
        which maps past it anyway (Note [Record steps of another structure])."""
        self._repeat = None             # (region/repeats.py)
        sig, step = self._wanted
        obstacles = np.asarray(obstacles, np.int64).reshape(-1, 2)
        old = self._plans.get(sig)
        steady = self._steady(sig, step, base, obstacles, span)
        kept = old is not None and old[2] == base and not (step.nbytes > old[0].step.nbytes).any()
        self._past = kept and steady[0].nbytes > span and steady[0].fallback is None and \
            self._recorded_once()
        if steady[0].nbytes > span and not self._past and kept and old[0].nbytes <= span:
            # The plan kept fits where the one around the blocks in its way does not: it
            # stays, its places under those blocks refused.
            self._plans[sig] = old
            steady = old[:2]
        if steady[0].nbytes > span and not self._past:
            self._plans.pop(sig, None)
            wait = self._waits[sig] = min(2 * self._waits.get(sig, RETRY_EXITS // 2),
                                          GIVE_UP_EXITS)
            while len(self._waits) > SEEN_MAX:
                self._waits.popitem(last=False)
            self._later[sig] = self._exits + wait
            self.no_room()
            return None
        self._relayout = False
        again = self.current == sig and not self._grown and not self._fresh
        if not again:
            self.current, self._entries_on, self._strikes, self._fresh = sig, 0, 0, False
            self._counts["installs"] += 1
        if self._in_place(steady[0], base, obstacles):
            self._transition, self._made_in_a_row = False, 0
            return steady
        # The last entry's blocks (tails served elsewhere than their steady places) are in
        # the steady plan's way: a transition plan places the next entry around them.
        self._transition = True
        return self._transition_plan(step, steady[0], base, span, obstacles)

    def record_over(self):
        """The requested bytes of request 0 past which an entry served by the installed plan
        is a record step (0: none is): the most that the steps of any signature seen twice
        asked (those ``_seen`` remembers; plus request 0's jitter, ``seen.record_over``),
        when the installed plan's own steps asked that most; where another signature's asked
        more, a request 0 past both is more likely of that one's structure (Note [Record
        steps of another structure]). None either where ``_record_top`` leaves no room past
        the most (request 0 never varied: Note [Record steps that leave nothing])."""
        if not self.record or self.current not in self._plans:
            return 0
        return _record_over(self._seen, self.current)

    def first_under(self):
        """The requested bytes of request 0 under which an entry served by the installed plan
        is off its step and goes online (0: none is): a quarter of the least its signature's
        steps asked (UNDER; Note [A first request far under the plan's]): its requests taken
        at places made for far larger ones would stay there when it leaves the structure."""
        seen = self._seen.get(self.current) if self.current in self._plans else None
        return seen.r_min // UNDER if seen is not None else 0

    def growing(self):
        """Whether the plan :meth:`place` returned last may map pages for its places past
        the memory mapped, once a record step has been planned: a transition (its steady plan
        fits, but the blocks the entry before left live, and its tails at their steady places,
        may push it past) placed greedily (first fit past the budget puts every place above
        the blocks that stay: mapping for it would cost what the online way does not), or a
        steady plan that :meth:`place` installed past the memory mapped."""
        if not self._transition:
            return self._past
        return self._recorded_once() and not self._fell_back

    def _recorded_once(self):
        """Whether a record step has been planned: its plan mapped up to its own top only, so
        the plans installed after it may map pages past the memory mapped."""
        return self.record and self._counts["records"] > 0

    def record_plan(self, nbytes, base, obstacles, ptr=None):
        """The plan of a record step, made at its request 0 (which asked ``nbytes`` bytes and
        went online, to address ``ptr``), as ``(Plan, anchors)``: the installed plan's
        structure, its sizes ``seen.record_sizes``'s (those that varied scaled by ``nbytes``
        over the most request 0 asked); request 0 not placed. Placed around
        ``obstacles`` ((offset from ``base``, bytes) rows that stay; request 0's block among
        them, at ``ptr`` only until the step frees it) and the entry before's blocks (its
        tails until this entry frees them). Its places may pass the memory mapped (the core
        maps pages for them on an expandable upstream). None when the installed plan's
        signature has no sizes kept or its sizes did not scale with request 0
        (``record_sizes``), when ``nbytes`` passes ``_record_top`` (more likely
        another step's request 0, and the scaled sizes would map pages that the online way
        does not), or when the placement fell back to first fit (past a budget: every place
        above the blocks that stay, pages mapped for them; ``counts["records_dropped"]``)."""
        self._repeat = None             # (region/repeats.py)
        seen, kept = self._seen.get(self.current), self._plans.get(self.current)
        if not self.record or seen is None or kept is None or not seen.r_max or \
                len(seen.envelope) != len(kept[0].step) or nbytes > _record_top(seen):
            return None
        sizes = _record_sizes(seen, nbytes)
        if sizes is None:
            return None
        step = kept[0].step
        free = step.free.copy()
        free[0] = placement.ESCAPED
        predicted = placement.Step(sizes, step.alloc, free, step.stream, step.length)
        freed = None if ptr is None or not step.planned[0] or step.tails[0] else \
            (int(ptr) - int(base), int(nbytes), int(step.free[0]))
        made = self._made(predicted, self._fixed(predicted, base, obstacles, freed), above=True)
        self._counts["records"] += 1
        self._counts["record_ms"] += made.planning_ms
        if made.fallback is not None:
            self._counts["records_dropped"] += 1
            return None
        self._recorded = 1
        self._record_places = made.offsets[made.offsets >= 0] + int(base)
        return made, anchors(made)

    def _record_held(self):
        """Whether the record step's entry left a block live at one of its plan's places."""
        return bool(np.isin(self._recorded_steps.carried[1], self._record_places).any())

    def record_dropped(self):
        """The plan :meth:`record_plan` returned last was not installed (an event of the entry, on
        another thread, came while it was made): the entry goes on online, as one that left
        the plan's step. Counted in ``counts["records_dropped"]`` (and in ``"records"``)."""
        self._repeat = None             # (region/repeats.py)
        self._recorded = 0
        self._counts["records_dropped"] += 1

    def _made(self, step, fixed, pinned=None, above=False, enough=0):
        """A new plan of step around the ``fixed`` rows (``placement.plan``'s), counted, the
        lowest of the strategies' or the first's within ``enough`` bytes (Note [Plans within
        the memory mapped]; in the pooled ``budget_work``), mirrored (MIRROR) where
        nothing stays (no rows, no pins) and, with ``above`` (a record step's), above the rows
        (Note [Plans mirrored]), unless in the online way's order ("start"). The first-fit plan
        (past GREEDY_MAX planned requests or a budget) places nothing around them: its places
        move above the highest."""
        made = placement.plan(step, budget_work=self.budget_work * len(self.strategies),
                              budget_ms=self.budget_ms, max_requests=GREEDY_MAX, fixed=fixed,
                              pinned=pinned, strategies=self.strategies, enough=enough)
        self._fell_back = made.fallback is not None
        self._counts["plans"] += 1
        self._counts["planning_ms"] += made.planning_ms
        self._counts["work"] += made.work
        if MIRROR and made.fallback is None and made.method != "start" and (above or not len(
                fixed) and (pinned is None or (pinned < 0).all())):
            made = _mirrored(made, fixed, pinned)   # the largest places above what stays on top
        if made.fallback is not None:
            self._counts["past_" + made.fallback] += 1
            if len(fixed):
                made = _shifted(made, int((fixed[:, 0] + fixed[:, 1]).max()))
        return made

    def _placed(self, step, fixed, pinned=None, enough=0):
        """:meth:`_made`'s plan of step around ``fixed`` with ``pinned``, or the one made
        before from the same inputs (their digest; the placement is a function of them): a
        signature whose plan kept meets blocks that stay, and whose plan around them does not
        fit, is planned at each exit from the same step and blocks; a run of a few
        structures meets the same transitions again. The REUSE_MAX plans made last are kept,
        of ``max_plan_requests`` requests in all, but none that took ``budget_ms`` (a
        strategy may have stopped on the wall clock, which depends on the load); a reuse is
        counted in ``counts["reused"]``, not in ``"plans"``."""
        key = _digest(step, fixed, pinned,
                      (self.budget_work, self.budget_ms, self.strategies, enough))
        made = self._made_from.get(key)
        if made is not None:
            self._made_from.move_to_end(key)
            self._fell_back = made.fallback is not None
            self._counts["reused"] += 1
            return made
        made = self._made(step, fixed, pinned, enough=enough)
        if made.planning_ms >= self.budget_ms:
            return made             # perhaps cut by the wall clock: not a function of the inputs
        self._made_from[key] = made
        while len(self._made_from) > 1 and (len(self._made_from) > REUSE_MAX or sum(
                len(p.offsets) for p in self._made_from.values()) > self.max_plan_requests):
            self._made_from.popitem(last=False)
        return made

    def _steady(self, sig, step, base, obstacles, span):
        """The plan kept for sig, or, when step grew past it, that one repaired, or a new one
        around the obstacles (the first strategy's within ``span`` bytes, ``_made``'s)."""
        kept = self._plans.get(sig)
        usable = kept is not None and kept[2] == base and not _meets(kept[0], obstacles)
        if not usable or (step.nbytes > kept[0].step.nbytes).any():
            made = self._repaired(kept[0], step, obstacles, span) if usable else None
            made = self._placed(step, obstacles, enough=span) if made is None else made
            self._plans[sig] = kept = (made, anchors(made), base)
            self._plans.move_to_end(sig)    # the others go first (max_plans may have fallen)
            while len(self._plans) > 1 and (len(self._plans) > self.max_plans or sum(
                    len(p.offsets) for p, _, _ in self._plans.values()) > self.max_plan_requests):
                self._plans.popitem(last=False)
        self._plans.move_to_end(sig)
        return kept[:2]

    def _repaired(self, old, step, obstacles, span):
        """Kept plan ``old`` (at the base, met by none of ``obstacles``) repaired for step, of
        its structure and larger: the requests that did not grow pinned at their places, those
        that did placed around them and the obstacles (counted as a plan). None, and the step
        placed whole, when ``repair`` is off, more than 1 in REPAIR_SHARE planned requests grew,
        or the repair needs more bytes than ``old`` (counted in ``counts["repairs_refused"]``;
        Note [Planning less often: reasons])."""
        grown = step.planned & (step.nbytes > old.step.nbytes)
        if not self.repair or REPAIR_SHARE * int(grown.sum()) > int(step.planned.sum()):
            return None
        made = self._placed(step, obstacles, np.where(grown | ~step.planned, -1, old.offsets), span)
        fits = made.fallback is None and made.nbytes <= old.nbytes
        self._counts["repairs" if fits else "repairs_refused"] += 1
        return made if fits else None

    def no_room(self):
        """No room for the plan asked for: the next entries are served online."""
        self._repeat = None             # (region/repeats.py)
        self.current = None
        self._transition = False
        self._counts["no_room"] += 1

    def clear(self):
        """The installed plan is dropped (``Region.release``); it may be installed again."""
        self._repeat = None             # (region/repeats.py)
        self.current = None

    @property
    def counts(self):
        """The planner's counters, a read-only mapping of name -> int (``planning_ms``,
        ``record_ms``: float milliseconds), which ``Region.stats()`` reports: a view (the
        planner adds to them; a dict assigned, cleared or changed would break its exits)."""
        return MappingProxyType(self._counts)

    @property
    def plans(self):
        """The plans kept, least recently used first. Read from any thread (``Region.stats``)
        while the worker's plan changes them: the values are copied in one C call first."""
        return [p for p, _, _ in tuple(self._plans.values())]
