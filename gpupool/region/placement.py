"""The planner of a planned region: offline placement of a repeating step's requests in one
address range.

A region sees its step repeat. Once an entry's requests are known (their sizes, their order,
their streams and when each is freed), placing them is an offline packing problem (dynamic
storage allocation): give each request an offset in one range so that no two requests live at
the same time share bytes, with the range as small as possible. The range can be no smaller
than the most bytes live at once (the floor, :func:`floor_bytes`). Finding the optimum is
NP-hard; greedy by size (the largest block first, each at the lowest offset free of the blocks
placed so far that overlap it in time) is the heuristic of TFLite's arena planner and the
baseline of OLLA and TelaMalloc, and lands within a fraction of a percent of the floor on the
recorded training steps (see Note [Planned regions] in docs/design.md).

A step repeats: a request allocated near its end and freed early in the next entry (a gradient
kept until ``zero_grad``) lives across the boundary and also conflicts with the next entry's
early requests. A :class:`Step` records such a free as an event index past the step's length.

The region calls :func:`plan` at an entry's exit, once the entry before it has freed its tails,
and :func:`servable` says which requests of an entry a plan serves, as the region decides them
online: a request takes its planned place when it fits there and no block in the range holds
any of the place's bytes, which :meth:`Plan.conflicts` lets it check in O(#conflicts).

Times are event indices of one step (its allocations and frees, in order); sizes are bytes.
NumPy, and the greedy placement compiled (:mod:`gpupool.region.greedy`); no device.
"""

import threading
import time

import numpy as np

from gpupool.region import greedy
from gpupool.region.firstfit import first_fit as _first_fit

__all__ = ["ALIGN", "BUDGET_MS", "BUDGET_WORK", "ESCAPED", "STRATEGIES", "Plan", "Step",
           "envelope", "floor_bytes", "overlaps", "plan", "record_step", "servable", "step_floor"]

ALIGN = 512                 # bytes: the pool's rounding of a request, the offsets' alignment
ESCAPED = -1                # a request's free: not in its step nor before its next allocation
# Greedy strategies: the order blocks are placed in ("start": as the step allocates them, the
# online way's order), and where each goes ("first": the lowest offset that fits; "best": the
# smallest gap that fits, the top of the range if none does).
STRATEGIES = {
    "size": ("size", "first"),
    "size-best": ("size", "best"),
    "lifetime": ("lifetime", "first"),
    "lifetime-best": ("lifetime", "best"),
    "area": ("area", "first"),
    "start": ("start", "first"),
}
DEFAULT_STRATEGIES = ("size",)     # on the recorded steps no other strategy placed smaller
# The greedy strategies' work, in units of one comparison of region/greedy.pyx (a block placed
# so far, or a fixed row, checked against the one being placed: Note [Planning budget in work]).
BUDGET_WORK = 8_000_000     # units: 1.27x the most a recorded real step's plan takes
BUDGET_MS = 5000.0          # wall-clock cap: a safety net the recorded steps never reach


def _round(nbytes):
    return (np.asarray(nbytes, dtype=np.int64) + ALIGN - 1) // ALIGN * ALIGN


class Step:
    """One entry's requests, in the order of their allocation.

    Parameters
    ----------
    nbytes : array-like of int
        Each request's size in bytes (> 0), rounded up here to :data:`ALIGN`.
    alloc : array-like of int
        The event index of each allocation in the step, increasing, in ``[0, length)``.
    free : array-like of int
        The event index of each free: in ``(alloc, length)`` when the step frees it; from
        ``length`` on (a tail) when the next entry frees it at event ``free - length``, before
        its allocation of this request or its first; :data:`ESCAPED` otherwise.
    stream : array-like of int
        Each request's stream (a handle or any integer key).
    length : int
        The step's number of events (its period when it repeats). Events may share an index
        (a recorded step's do not); at one index, frees come before the allocation.

    Raises
    ------
    ValueError
        The arrays differ in length, a size is not positive, the allocations are not
        increasing inside the step, or a free is out of its range.
    """

    __slots__ = ("nbytes", "alloc", "free", "stream", "length")

    def __init__(self, nbytes, alloc, free, stream, length):
        self.nbytes = _round(nbytes)
        self.alloc, self.free, self.stream = (np.asarray(a, dtype=np.int64)
                                              for a in (alloc, free, stream))
        self.length = int(length)
        n = len(self.nbytes)
        if not (len(self.alloc) == len(self.free) == len(self.stream) == n):
            raise ValueError("nbytes, alloc, free and stream must have the same length")
        if not n:
            return
        if self.nbytes.min() <= 0:
            raise ValueError("every request needs nbytes > 0")
        if self.alloc[0] < 0 or self.alloc[-1] >= self.length or (np.diff(self.alloc) <= 0).any():
            raise ValueError("allocations must be increasing event indices in [0, length)")
        bad = (self.free != ESCAPED) & (self.free <= self.alloc)
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"request {k}: free {self.free[k]} not after its allocation "
                             f"{self.alloc[k]} and not ESCAPED")

    def __len__(self):
        return len(self.nbytes)

    @property
    def planned(self):
        """Mask of the requests a plan places (those not :data:`ESCAPED`)."""
        return self.free != ESCAPED

    @property
    def tails(self):
        """Mask of the requests the next entry frees."""
        return self.free >= self.length

    def structure(self):
        """The step's structure as a hashable key: its length and each request's allocation,
        free and stream, without sizes. Steps of one structure differ only in ``nbytes``."""
        return (self.length, self.alloc.tobytes(), self.free.tobytes(), self.stream.tobytes())

    def __repr__(self):
        return (f"Step({len(self)} requests, {self.length} events, "
                f"{int(self.tails.sum())} tails, {int((~self.planned).sum())} escaped)")


def record_step(events, lo, hi, end=None):
    """The :class:`Step` of ``events[lo:hi]``, its frees looked up until ``events[end - 1]``.

    Parameters
    ----------
    events : sequence of (op, id, nbytes, stream)
        A trace's events (op 0 allocates ``id``, op 1 frees it), as ``Trace.events()``.
    lo, hi : int
        The step's first event and the next step's first.
    end : int, optional
        The next step's end (default ``hi``: no request is a tail). A request freed there
        before the next entry's allocation of it, or before its first allocation, is a tail;
        any other is escaped.
    """
    end = hi if end is None else end
    index, nbytes, alloc, stream = {}, [], [], []
    for t in range(lo, hi):
        op, i, n, s = events[t]
        if op == 0:
            index[i] = len(nbytes)
            nbytes.append(n)
            alloc.append(t - lo)
            stream.append(s)
    free = [ESCAPED] * len(nbytes)
    first = next((t for t in range(hi, end) if events[t][0] == 0), end)
    for t in range(lo, end):
        op, i, _, _ = events[t]
        k = index.get(i) if op else None
        if k is not None and (t - lo < hi - lo + alloc[k] or t < first):
            free[k] = t - lo
    return Step(nbytes, alloc, free, stream, hi - lo)


def envelope(steps):
    """A step of the structure the ``steps`` share whose sizes are their elementwise maximum.

    Raises
    ------
    ValueError
        No steps, or two of them differ in structure.
    """
    steps = list(steps)
    if not steps:
        raise ValueError("no steps")
    first = steps[0]
    if any(s.structure() != first.structure() for s in steps[1:]):
        raise ValueError("the steps differ in structure")
    nbytes = np.max([s.nbytes for s in steps], axis=0) if len(first) else first.nbytes
    return Step(nbytes, first.alloc, first.free, first.stream, first.length)


def floor_bytes(nbytes, starts, ends, period=None):
    """The most bytes live at once: blocks of ``nbytes`` live over ``[starts, ends)``.

    Parameters
    ----------
    nbytes, starts, ends : array-like of int, one entry per block
        Sizes in bytes; the event of the allocation and of the free (``end > start``).
    period : int, optional
        The step's length in events, when the step repeats: a block ending after it is also
        live, in the next entry, over ``[0, end - period)``.

    Returns
    -------
    int
        Bytes; the lower bound of any placement's range.
    """
    nbytes, starts, ends = (np.asarray(a, dtype=np.int64) for a in (nbytes, starts, ends))
    times, deltas = [starts, ends], [nbytes, -nbytes]
    if period is not None:
        wraps = ends > period
        times += [np.zeros(int(wraps.sum()), np.int64), ends[wraps] - period]
        deltas += [nbytes[wraps], -nbytes[wraps]]
    times, deltas = np.concatenate(times), np.concatenate(deltas)
    order = np.lexsort((deltas, times))            # at one time, frees before allocations
    return int(np.cumsum(deltas[order]).max(initial=0))


def overlaps(a_start, a_end, b_start, b_end, period=None):
    """Whether lifetimes ``[a_start, a_end)`` and ``[b_start, b_end)`` share an event; with a
    ``period``, also across the step's boundary (one entry's tail with the next one's head).
    NumPy broadcasting applies."""
    hit = (a_start < b_end) & (b_start < a_end)
    if period is not None:
        hit = hit | ((a_start < b_end - period) & (b_start - period < a_end))
        hit = hit | ((a_start - period < b_end) & (b_start < a_end - period))
    return hit


class Plan:
    """Where a step's requests go in one range.

    Attributes
    ----------
    step : Step
        The step planned (an envelope's, for a plan serving steps of one structure).
    offsets : numpy.ndarray of int64
        Each request's offset in bytes from the range's start; -1 for an escaped request.
    nbytes : int
        The range's size in bytes (the plan's peak).
    floor : int
        The step's most bytes live at once, the tails of the entry before counted.
    planning_ms : float
        Milliseconds :func:`plan` took.
    work : int
        The greedy strategies' work in all, in units of one candidate place examined (see
        :func:`plan`); the same on any machine for the same step and arguments.
    method : str
        The strategy whose plan was kept (a key of :data:`STRATEGIES`, or ``"first-fit"``).
    fallback : str or None
        Why the cheap first-fit plan was returned: ``"requests"``, more planned requests than
        ``max_requests``; ``"work"``, the first strategy passed ``budget_work``; ``"time"``,
        it passed ``budget_ms`` first. None when a greedy plan was kept.
    tried : dict
        Each strategy run to its end, with its range's size in bytes.
    events : numpy.ndarray of int64, shape (k, 2)
        Pairs of requests of different streams that share bytes (only when planned with
        ``share_streams``): the later user must wait for an event on the earlier's stream.
    """

    __slots__ = ("step", "offsets", "nbytes", "_floor", "planning_ms", "work", "method",
                 "fallback", "tried", "events", "_ptr", "_idx")

    def __init__(self, step, offsets, *, method, fallback=None, tried=None, planning_ms=0.0,
                 work=0, share_streams=False):
        self.step, self.offsets = step, np.asarray(offsets, dtype=np.int64)
        ends = self.offsets + step.nbytes
        self.nbytes = int(ends[step.planned].max(initial=0))
        self._floor = None          # made at its first use (the region never asks)
        self.method, self.fallback, self.tried = method, fallback, dict(tried or {})
        self.planning_ms, self.work = planning_ms, int(work)
        if share_streams:
            first, second = _address_pairs(self.offsets, ends, step.planned)
            other = step.stream[first] != step.stream[second]
            self.events = np.stack([np.minimum(first, second)[other],
                                    np.maximum(first, second)[other]], axis=1)
        else:
            self.events = np.zeros((0, 2), np.int64)
        # The conflicts table, made at its first use from the places as they are now.
        self._ptr, self._idx = None, (self.offsets.copy(), ends, step.planned, step.tails)

    def conflicts(self, i):
        """The requests whose planned bytes meet request ``i``'s and that may hold them when
        ``i`` is allocated: those allocated before ``i`` in the entry, and the tails (the
        entry before may still hold those). Increasing indices; ``i`` itself is not listed (a
        tail's place is also held by its own previous block until the entry frees it).
        The table of every request's is made at the first call (the region's core never
        asks: Note [Planner bookkeeping] in docs/design.md)."""
        if self._ptr is None:
            self._ptr, self._idx = _conflicts_table(*self._idx)
        return self._idx[self._ptr[i]:self._ptr[i + 1]]

    @property
    def floor(self):
        """The step's most bytes live at once, the tails of the entry before counted."""
        if self._floor is None:
            self._floor = step_floor(self.step)
        return self._floor

    @property
    def sizes(self):
        """Each request's planned size in bytes (the most it may request to be served)."""
        return self.step.nbytes

    def __repr__(self):
        how = self.method + (f", fallback: {self.fallback}" if self.fallback else "")
        return (f"Plan({len(self.offsets)} requests, nbytes={self.nbytes}, floor={self.floor}, "
                f"{how}, {self.work} work, {self.planning_ms:.1f} ms)")


def _address_pairs(offsets, ends, planned):
    """The pairs (i, j), i placed at a lower or equal offset, of planned requests whose bytes
    meet: sorted by offset, request p meets the run after it that starts below its end."""
    idx = np.flatnonzero(planned)
    order = idx[np.argsort(offsets[idx], kind="stable")]
    lo, hi = offsets[order], ends[order]
    reach = np.searchsorted(lo, hi, side="left")     # the first position starting at or past hi
    counts = reach - np.arange(len(order)) - 1
    first = np.repeat(np.arange(len(order)), counts)
    second = first + 1 + (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))
    return order[first], order[second]


def _conflicts_table(offsets, ends, planned, tails):
    """:meth:`Plan.conflicts` of every request, as (ptr, idx): request i's are
    ``idx[ptr[i]:ptr[i + 1]]``. Request i's conflicts are the requests allocated before it
    in the entry, and the tails (the entry before may still hold them), whose bytes meet i's."""
    first, second = _address_pairs(offsets, ends, planned)
    both_ways = (np.concatenate([first, second]), np.concatenate([second, first]))
    keep = (both_ways[1] < both_ways[0]) | tails[both_ways[1]]
    rows, cols = both_ways[0][keep], both_ways[1][keep]
    order = np.lexsort((cols, rows))
    return np.searchsorted(rows[order], np.arange(len(offsets) + 1)), cols[order]


def step_floor(step, nbytes=None):
    """The most bytes of ``step``'s planned requests live at once, of ``nbytes`` if given."""
    sizes, keep = step.nbytes if nbytes is None else nbytes, step.planned
    return floor_bytes(sizes[keep], step.alloc[keep], step.free[keep], step.length)


def _order(sizes, starts, ends, order_key):
    """The order a greedy strategy places requests in: by ``order_key`` ("size", "lifetime"
    or "area", the largest first; "start", the earliest allocated), then the largest, then
    the earliest allocated."""
    if order_key in ("size", "start"):
        return np.lexsort((starts, -sizes) if order_key == "size" else (-sizes, starts))
    life = ends - starts
    key = -life if order_key == "lifetime" else -(life * sizes)
    return np.lexsort((starts, -sizes, key))


def _greedy(sizes, starts, ends, busy_with, order_key, fit, deadline, fixed, pinned,
            work_limit=0):
    """Offsets by one greedy strategy (placed by the compiled core, gpupool.region.greedy).
    ``busy_with``: (streams, period, share_streams), what makes two requests busy with each
    other (:func:`overlaps` with the period; unless ``share_streams``, different streams);
    ``deadline``: a perf_counter time or None; ``fixed``: (offsets, ends, first event, last
    event + 1) of bytes taken for a while; ``pinned``: each request's given offset, -1 where
    the strategy places it; ``work_limit``: comparisons allowed (<= 0: no limit).
    Returns (offsets, work, None), or (None, work, "time" or "work") past a limit."""
    order = _order(sizes, starts, ends, order_key)
    streams, period, share_streams = busy_with
    left_s = None if deadline is None else deadline - time.perf_counter()
    # Past 2^62 ns (146 years) or 2^62 units a limit is none (the core's are int64).
    budget_ns = -1 if left_s is None or left_s > 2**62 / 1e9 else max(0, int(left_s * 1e9))
    work_limit = int(min(work_limit, 2**62))
    offsets, work, status = greedy.place(sizes, starts, ends, streams, period, share_streams,
                                         order, fit, fixed, pinned, work_limit, budget_ns)
    if status == greedy.DONE:
        return offsets, work, None
    return None, work, "work" if status == greedy.PAST_WORK else "time"


def _side_by_side(calls):
    """``_greedy(*args)`` of each argument tuple in ``calls``, the first on this thread and
    each other on a thread of its own, side by side (the compiled core runs without the GIL):
    a plan of several strategies takes about the time of its slowest, not their sum. Fresh
    threads, joined here: nothing outlives the call (a pool of threads would not survive a
    fork); one refused a thread (interpreter shutdown, a limit on threads) runs on this thread
    after the first. Returns their results in order; an exception in any is raised here."""
    results = [None] * len(calls)

    def run(k):
        try:
            results[k] = (True, _greedy(*calls[k]))
        except BaseException as exc:            # re-raised on the calling thread
            results[k] = (False, exc)

    others = []
    for k in range(1, len(calls)):
        thread = threading.Thread(target=run, args=(k,), name="gpupool-plan", daemon=True)
        try:
            thread.start()
        except RuntimeError:
            thread = None
        others.append((k, thread))
    run(0)
    for k, thread in others:
        if thread is None:
            run(k)
        else:
            thread.join()
    for ok, value in results:
        if not ok:
            raise value
    return [value for _, value in results]


def plan(step, *, budget_work=BUDGET_WORK, budget_ms=BUDGET_MS, max_requests=4096,
         strategies=DEFAULT_STRATEGIES, share_streams=False, fixed=None, pinned=None, enough=0):
    """Place ``step``'s requests in one range; keep the smallest of the strategies' plans, or
    the earliest strategy's of at most ``enough`` bytes.

    Parameters
    ----------
    step : Step
    budget_work : int
        Work the greedy strategies may do in all, in units of one comparison of the
        compiled core (a block placed so far, or a fixed row, checked against the block being
        placed). A strategy whose work passes it stops, its plan unused (even when the block
        that passed it was its last): during the first, the first-fit plan is returned
        (``plan.fallback == "work"``); during a later one, the best plan so far is kept. The
        count depends on the step and the arguments alone, so the plan is the same on any
        machine under any load (about 25 ms at the default: Note [Planning budget in work]).
    budget_ms : float
        Milliseconds of wall-clock time the greedy strategies may take in all, a safety net
        (checked every 64 blocks): past it, as past ``budget_work`` (``"time"``). The default
        is far above what ``budget_work``'s default takes.
    max_requests : int
        Steps of more planned requests get the first-fit plan at once
        (``plan.fallback == "requests"``): the greedy's work grows as the square of their number.
    strategies : sequence of str
        Keys of :data:`STRATEGIES`, run in order; ties go to the earlier.
    share_streams : bool
        False (the default): requests of different streams never share bytes, so no plan needs
        an event. True: they may, and ``plan.events`` lists the pairs that do.
    fixed : array-like of (offset, nbytes) or (offset, nbytes, first, end), optional
        Bytes of the range taken (blocks that are there): throughout the step, or from event
        ``first`` to event ``end`` (exclusive) of it. The greedy strategies place no request
        on them while they are taken; the first-fit plan ignores them.
    pinned : array-like of int, optional
        Per request, an offset it must take (-1: none, the strategy places it); the greedy
        strategies place the others around the pinned ones. The first-fit plan ignores it.
    enough : int
        Bytes within which any plan serves as well (the memory mapped already): the earliest
        of ``strategies`` whose plan fits them is kept, not a smaller one (0: the smallest).

    Returns
    -------
    Plan
    """
    start = time.perf_counter()
    left = [budget_work, start + budget_ms / 1e3]      # work units, perf_counter deadline
    fixed = np.asarray(fixed if fixed is not None and len(fixed) else np.zeros((0, 2)),
                       dtype=np.int64)
    if fixed.shape[1] == 2:
        fixed = np.column_stack([fixed, np.zeros(len(fixed), np.int64),
                                 np.full(len(fixed), np.iinfo(np.int64).max)])
    fixed = (fixed[:, 0], fixed[:, 0] + fixed[:, 1], fixed[:, 2], fixed[:, 3])
    pinned = np.full(len(step), -1, np.int64) if pinned is None else \
        np.asarray(pinned, dtype=np.int64)
    keep = step.planned
    idx = np.flatnonzero(keep)
    best, method, fallback, tried, work = None, "first-fit", None, {}, 0
    if not len(idx):
        best, method = idx, strategies[0]
    elif len(idx) > max_requests:
        fallback = "requests"
    else:
        sizes, starts, ends = step.nbytes[idx], step.alloc[idx], step.free[idx]
        busy_with = (step.stream[idx], step.length, share_streams)
        # No budget runs none (the loop falls back at once), as one after the other would.
        runs = _side_by_side([(sizes, starts, ends, busy_with, *STRATEGIES[name], left[1],
                               fixed, pinned[idx], left[0]) for name in strategies]) \
            if left[0] > 0 else [(None, 0, "work")] * len(strategies)
        for name, (found, spent, stopped) in zip(strategies, runs):
            if left[0] <= 0:                    # (the compiled core reads 0 as no limit)
                fallback = None if best is not None else "work"
                break
            # Each strategy ran with the whole budget; as in one run after the other, it
            # stops past what the strategies before it left (its work counted to its end,
            # more than one after the other counts: offsets, method and fallback the same).
            if found is not None and spent > left[0]:
                found, stopped = None, "work"
            work += spent
            left[0] -= spent
            if found is None:
                fallback = None if best is not None else stopped
                break
            tried[name] = int((found + sizes).max())
            if best is None or max(tried[name], enough) < max(tried[method], enough):
                best, method = found, name
    if best is None:
        offsets = _first_fit(step, keep)
        method = "first-fit"
    else:
        offsets = np.full(len(step), -1, np.int64)
        offsets[idx] = best
    ms = (time.perf_counter() - start) * 1e3
    return Plan(step, offsets, method=method, fallback=fallback, tried=tried, planning_ms=ms,
                work=work, share_streams=share_streams)


def servable(plan, step, carried=()):
    """Which of ``step``'s requests ``plan`` serves, decided online as a planned region does.

    Request k (the k-th allocation) takes its planned place when the plan places it, it is no
    larger than planned and on the planned stream, and no block in the range holds the place's
    bytes: neither a block at the place itself, nor one of :meth:`Plan.conflicts`, nor a
    carried block the plan does not know. A step of the plan's structure whose sizes are each
    at most the planned ones is served whole; a step of another structure is served where its
    requests happen to fit. A request not served goes to the pool; the range stays valid.

    Parameters
    ----------
    plan : Plan
    step : Step
        The entry's requests (its sizes and the frees it makes; tails and escaped requests
        hold their place to the step's end).
    carried : iterable of (offset, nbytes, free, slot)
        Blocks in the range when the entry starts: their bytes, the event of ``step`` that
        frees them (:data:`ESCAPED`: none does), and the request of ``plan`` whose place they
        hold (a tail of the entry before under this plan), or -1 for any other block.

    Returns
    -------
    numpy.ndarray of bool
        One entry per request of ``step``.
    """
    n_plan = len(plan.offsets)
    held = np.zeros(n_plan, np.int64)            # blocks holding each planned place
    foreign = {}                                 # carried blocks checked by address
    frees = {}                                   # event -> what it frees
    tails = plan.step.tails
    for c, (offset, nbytes, free, slot) in enumerate(carried):
        if 0 <= slot < n_plan and tails[slot] and plan.offsets[slot] == offset:
            held[slot] += 1
            what = ("slot", slot)
        else:
            foreign[c] = (offset, offset + nbytes)
            what = ("foreign", c)
        if free != ESCAPED:
            frees.setdefault(int(free), []).append(what)
    served = np.zeros(len(step), bool)
    inside = (step.free != ESCAPED) & (step.free < step.length)
    for k in np.flatnonzero(inside):
        frees.setdefault(int(step.free[k]), []).append(("request", int(k)))
    allocs = {int(t): k for k, t in enumerate(step.alloc)}
    for t in sorted(frees.keys() | allocs.keys()):
        for kind, x in frees.get(t, ()):
            if kind == "foreign":
                del foreign[x]
            elif kind == "slot" or served[x]:
                held[x] -= 1
        if t not in allocs:
            continue
        k = allocs[t]
        if k >= n_plan or plan.offsets[k] < 0 or step.nbytes[k] > plan.sizes[k] or \
                step.stream[k] != plan.step.stream[k] or held[k] or held[plan.conflicts(k)].any():
            continue
        lo, hi = plan.offsets[k], plan.offsets[k] + plan.sizes[k]
        if any(a < hi and lo < b for a, b in foreign.values()):
            continue
        served[k] = True
        held[k] += 1
    return served
