"""A planned region's plan in flight: the plan an exit asks for (``Planner.place`` and the
greedy), made on a worker thread while the exit returns, and installed by the region at its
next call (Note [Plans off the exit] in docs/design.md).

The exit reads from the core all that the plan needs (the events, the layout: the base, the
bytes mapped, the blocks in the way) and hands them to a :class:`PlanJob`; the job calls only
the planner, which nothing else calls until the region has taken the job's result (every call
of the region on its planner waits for it first), so the planner's decisions and the plan
installed are those of the exit. Installing reads nothing from the core: the places are taken
(checked free) request by request, as ever.

One worker thread per process, started at the first job, takes the jobs in order. A fork()
child has no worker: the jobs it inherits unfinished are dropped there (never waited for; the
child's use of the region raises the fork error anyway). Pure Python and NumPy.
"""

import os
import queue
import threading
import weakref

import numpy as np

__all__ = ["DROPPED", "PlanJob", "columns", "installed", "weak_hook"]

DROPPED = object()          # PlanJob.result() of a job a fork() child inherits unfinished

_lock = threading.Lock()    # guards the worker's start and the unfinished jobs
_jobs = queue.SimpleQueue()
_worker = None
_unfinished = set()


def columns(placed):
    """A ``Planner.place`` or ``Planner.record_plan`` result ``(Plan, anchors)`` as the core takes
    it: one contiguous (6, n) int64 array of its places' offsets (bytes from the base), sizes
    (bytes), stream handles, anchors, allocating and freeing events.

    Raises
    ------
    ValueError
        The columns' lengths differ.
    """
    found, anchors = placed
    step = found.step
    return np.ascontiguousarray(np.stack(
        [found.offsets, step.nbytes, step.stream, anchors, step.alloc, step.free]), np.int64)


def installed(placed):
    """What the region installs of a ``(Plan, anchors)`` result: ``(columns, length,
    nbytes)``, its :func:`columns`, its step's events and its range's bytes."""
    found = placed[0]
    return columns(placed), found.step.length, found.nbytes


class PlanJob:
    """``planner.place(base, span, obstacles)`` made on the worker thread.

    Parameters
    ----------
    planner : gpupool.region.planned.Planner
        The region's planner, whose :meth:`~Planner.exited` just returned ``"layout"``; no
        other call may be made on it until :meth:`result` returned.
    base : int
        The address of the plan's range.
    span : int
        Bytes of memory from ``base`` (mapped, on an expandable segment).
    obstacles : numpy.ndarray
        (m, 2) int64 rows of (offset from base, bytes) that stay where they are.

    Notes
    -----
    Where no thread can be started (interpreter shutdown, a limit on threads) the plan is
    made on the calling thread, as before the job existed.
    """

    __slots__ = ("base", "_args", "_done", "_made", "_error")

    def __init__(self, planner, base, span, obstacles):
        self.base = base            # where the region installs the plan
        self._args = (planner, base, span, obstacles)
        self._done = threading.Event()
        self._made = self._error = None
        with _lock:
            _unfinished.add(self)
            started = _start_worker()
        if started:
            _jobs.put(self)
        else:
            self._run()

    def _run(self):
        planner, base, span, obstacles = self._args
        try:
            placed = planner.place(base, span, obstacles)
            if placed is not None:
                # What the install needs, read from the planner as the exit would have.
                placed = (*installed(placed), planner.growing(), *planner.bounds())
            self._made = placed
        except BaseException as exc:        # raised by result(), on the region's thread
            self._error = exc
        finally:
            self._args = None
            self._done.set()
            with _lock:         # after the set: a fork() between them drops a job done
                _unfinished.discard(self)

    def result(self):
        """Wait for the plan; the GIL is released meanwhile.

        Returns
        -------
        tuple or None or DROPPED
            ``(columns, length, nbytes, grows, record_over, first_under, refit_from)``: the
            plan's :func:`columns`, its step's events, its range's bytes, whether its places
            may map pages (``Planner.growing``) and ``Planner.bounds``: the record step
            threshold, the bytes of request 0 under which an entry goes online, and the
            request from which on one larger than its place is refitted;
            None when ``place`` made none (the next entry is served online); DROPPED in a
            fork() child when the job was unfinished at the fork.

        Raises
        ------
        BaseException
            What ``place`` raised, with its traceback from the worker.
        """
        self._done.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._made


def _start_worker():
    """Start the worker unless it runs; whether it runs. Under _lock."""
    global _worker
    if _worker is None:
        worker = threading.Thread(target=_serve, args=(_jobs,), name="gpupool-plan-exit",
                                  daemon=True)
        try:
            worker.start()
        except RuntimeError:
            return False
        _worker = worker
    return True


def _serve(jobs):
    while True:
        jobs.get()._run()


def _after_fork_in_child():
    """The worker does not exist in a child: a fresh queue, and the jobs unfinished at the
    fork dropped (their events, whose locks the worker may have held, replaced)."""
    global _jobs, _worker, _lock
    _lock, _jobs, _worker = threading.Lock(), queue.SimpleQueue(), None
    for job in _unfinished:
        job._made, job._error, job._args = DROPPED, None, None
        job._done = threading.Event()
        job._done.set()
    _unfinished.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def weak_hook(region, method):
    """``method(region, ptr)`` for the core's borrowed hooks (a planned region's record
    hook), the region held weakly: a bound method kept on it is a cycle no_gc_clear leaves
    uncollected (region and pool never freed)."""
    def hook(ptr, ref=weakref.ref(region)):
        found = ref()
        return None if found is None else method(found, ptr)
    return hook
