# cython: language_level=3, boundscheck=False, wraparound=False
"""Region: a ``with`` block whose allocations are cached and handed back, at the same
addresses, the next time the block runs, with a step's peak equal to its working set.

What a region covers: allocations from its pool made by the thread that entered it, while
it is entered (the innermost region of that pool is current). Its blocks go back to its own
free lists whenever their buffers die, during the step or later. At exit, if some of its
buffers are still alive, a young-generation garbage collection runs (temporaries held in
reference cycles die there), and the survivors are detached (they return to the pool when
they die) or invalidated, by the ``on_exit`` policy.
"""
from cpython.ref cimport PyObject
from libc.stdint cimport int64_t, uintptr_t
from gpupool.records.block cimport Block
from gpupool.buffer.device_buffer cimport DeviceBuffer
from gpupool.buffer.dlpack cimport capsule_data
from gpupool.driver.calls cimport forked
from gpupool.core.pool cimport Pool, region_push, region_pop, uncached_marker
from gpupool.core.regioncache cimport RegionCache
from gpupool.core.plantable cimport (
    PlanTable, PL_ENTRY, PL_READ, PL_INSTALL, PL_CLEAR, PL_LAYOUT, PL_RECORD, PL_OVER, pt_fill,
)

cimport cython

import functools
import gc
import itertools
import threading
import time
import weakref

import numpy as np

from gpupool.errors import (
    FORK_MESSAGE, GpupoolError, did_you_mean, not_picklable, unexpected_keyword)
from gpupool.buffer.interface import read_cai
from gpupool.limits import parse_limit
from gpupool.stats import RegionStats, plan_fields
from gpupool.buffer.view import BufferView
from gpupool.region.escapes import Escapes
from gpupool.region.options import option_names, planner_of
from gpupool.region.planned import Planner
from gpupool.region.background import DROPPED, PlanJob, installed, weak_hook

# "young" is gc.collect(1): generations 0 and 1 (3.14: the young one and an increment of the old)
_COLLECT = {"young": 1, "full": 2, None: None}
_POLICIES, _SCOPES = ("detach", "invalidate"), ("thread", "process")
_PLAN_OPTIONS = option_names(Planner)     # Region(plan={...})'s keys
POISON = 0xFF                   # every float of a poisoned block reads as NaN
# Per thread, the regions entered there with `with region:`, innermost last (exits go last first).
_entered = threading.local()
# Every Region alive, by the address of its cache: (its id, a weak reference), for the memory
# snapshot, which finds regions' blocks by their cache (gpupool.snapshot).
cdef dict _by_cache = {}
_region_ids = itertools.count(1)


cdef object _event_rows(PlanTable* io, Py_ssize_t columns):
    """io.events as an (n, columns) int64 array of their first columns of (ptr, nbytes,
    stream): the recorded events (3) for the planner, or PL_LAYOUT's and PL_RECORD's
    obstacles (2: offset from the base, bytes)."""
    cdef size_t i
    out = np.empty((io.events.size(), columns), np.int64)
    cdef int64_t[:, ::1] rows = out
    for i in range(io.events.size()):
        rows[i, 0], rows[i, 1] = <int64_t>io.events[i].ptr, <int64_t>io.events[i].nbytes
        if columns > 2:
            rows[i, 2] = <int64_t>io.events[i].stream
    return out


cdef list _entered_here():
    """The calling thread's entered regions, innermost last."""
    regions = getattr(_entered, "regions", None)
    if regions is None:
        regions = _entered.regions = []
    return regions


# The docstring opens with its signature, for inspect.signature (Note [Class signatures]).
@cython.no_gc_clear      # __dealloc__ needs the pool to unregister from it
cdef class Region:
    """Region(pool=None, on_exit="detach", collect="young", max_cached_bytes=None,
              skip_first=False, debug=False, trace=False, scope="thread", name=None,
              plan=False)
--

    A cached scope of allocations.

    Parameters
    ----------
    pool : Pool, optional
        The pool it draws from; default: ``gpupool.get_pool()`` (the current device's).
    on_exit : {"detach", "invalidate"}
        What happens at exit to the region's buffers still alive after the collection:
        ``"detach"`` (they leave the region and return to the pool when they die) or
        ``"invalidate"`` (their blocks are recycled now and any later use raises
        ``InvalidBufferError``). Buffers passed to ``keep`` are always detached.
    collect : {"young", "full", None}
        Garbage collection run at exit when some of the region's buffers are still alive:
        ``gc.collect(1)`` (default), ``gc.collect()`` or none.
    max_cached_bytes : int or str, optional
        Cap on the bytes the region caches; blocks beyond it go back to the pool. An int, or
        a string as for ``Pool``'s limits (``"512MiB"``, ``"8GB"``, ``"10%"``).
    skip_first : bool
        Leave the first entry's allocations (library workspaces, warm-up) out of the cache:
        they are served by the pool as if no region were entered, on every thread the region
        would cover (its ``enter_in_thread()`` workers; ``scope="process"`` covers the others
        from the second entry on).
    debug : bool
        Fill the blocks of invalidated buffers with 0xFF bytes (NaN as floats) after
        synchronizing the device, so a consumer holding a stale raw pointer reads garbage.
    trace : bool
        Record where each of the region's buffers was allocated (file:line of the first
        frame outside gpupool and the array libraries), for the leak warning.
    scope : {"thread", "process"}
        ``"thread"``: the region covers the entering thread. ``"process"``: while entered, it
        also covers every other thread that has no region of its own for this pool (for
        example PyTorch's autograd thread); one such region per pool at a time.
    name : str, optional
        Name used in warnings; default: the region's repr.
    plan : bool or dict
        Plan the step (a planned region), for a loop whose entries repeat the same requests: from
        the fourth entry on (the fifth with ``skip_first`` or buffers that outlive their entry),
        each request takes a place planned for the whole step, which keeps the step's peak near its
        most bytes in use. ``stats()`` says whether it does (``plan_hits`` against ``plan_misses``,
        ``plans_not_fitting``). The plan lies in the segment holding most of the region's bytes
        (on a plain upstream, ``"driver"`` or ``SimulatedDevice()``, one larger does not fit), in
        the memory mapped there (on expandable memory too, ``upstream="vmm"``: a plan past it
        does not fit); where none fits, the step runs as a plain region's. The region
        records its entries' requests (sizes, order, lifetimes, streams); once a step's structure
        has been seen twice, it places the whole step in one range (``gpupool.region.placement``,
        within a budget of work), and each later request k takes its place if it is no larger, on
        the planned stream, at its planned event, and the place's bytes are free (stream order as
        the pool's). A plan maps no memory for steps no larger than those it was made from (its
        places lie in memory earlier steps mapped) until a record step's plan maps pages for its
        own; after one, later plans may too. A larger request takes bytes no later place needs (a
        plan by size, no later size varied); others, and the rest of an entry off the plan's step,
        go the online way and may grow the pool past a plain region's reserve (bench/RESULTS.md). A
        new structure or larger sizes are planned again, and an entry whose first request asks more
        than any step's did is planned at that request (a record step). Plans are made on a worker
        thread and installed at the region's next call (entry, ``stats()``, ``release()``,
        ``planner``), which raises what making one raised. A plan whose entries twice serve less
        than half their planned requests, or grow the pool, is given up for a while (so is one made
        anew at every entry: kept buffers that move). While another thread's region takes turns on
        the pool, it goes the pool's way (``shared_entries``). A dict
        holds the options (``max_plans``, ``max_plan_requests``, ``budget_work``, ``budget_ms``,
        ``min_hit_rate``, ``record``, ``repair``, ``strategies``) of its ``planner``, a
        ``gpupool.region.planned.Planner`` (None without a plan). Design: Notes [Planned regions],
        [Planning budget in work], [Planned regions on several threads] in docs/design.md.

    Warns
    -----
    ResourceWarning
        When the bytes of buffers still alive at exit grow for three consecutive entries.

    Raises
    ------
    ValueError
        Unknown ``on_exit``, ``collect`` or ``scope`` (naming the closest choice); a planner
        option out of its range.
    TypeError
        An unknown keyword argument (naming the closest), ``plan`` not a bool or dict, an
        unknown key (naming the closest) or a value of the wrong type in ``plan``'s dict, ``pool``
        not a Pool, ``skip_first``, ``debug``, ``trace`` not a bool, ``name`` not a str or None.
    GpupoolError
        On entry, if this Region object is already entered (re-entered inside itself, or
        entered on another thread), in a fork() child of a process that used gpupool, or
        inside the pool's own upstream call; distinct Region objects nest freely. On exit,
        if it was not entered on this thread, or if a region entered inside it is still
        entered (exit the innermost first).

    Notes
    -----
    With ``scope="thread"`` the region is current for the entering thread only; other threads'
    allocations are served by the pool, unless such a thread enters ``region.enter_in_thread()``.

    Examples
    --------
    A planned region over a training step (on a GPU, ``gpupool.Region(plan=True)``)::

        pool = gpupool.Pool(upstream=gpupool.testing.SimulatedDevice(virtual_memory=True))
        region = gpupool.Region(pool=pool, plan=True)
        for batch in loader:
            with region:
                loss = step(model, batch)
        stats = region.stats()
        print(stats.plan_hits, stats.plan_misses, stats.plans_not_fitting)
    """

    cdef RegionCache* rc
    cdef readonly Pool pool
    cdef readonly str on_exit
    cdef readonly str scope
    cdef readonly bint skip_first, debug, trace
    cdef object _name
    cdef object _collect
    cdef object _active_thread
    cdef bint _skipping
    cdef set _kept
    cdef object _on_alloc
    cdef object _on_record
    cdef object _escapes                  # its buffers' sites, the leak warning (region/escapes.py)
    cdef size_t entries, live_at_exit_bytes, collections
    cdef double collect_seconds
    cdef object _planner                  # a planned region's Planner (region/planned.py); None
    cdef object _planning                 # held while the planner plans (an exit, a record
                                          # step) and while a plan in flight is taken
    cdef object _job                      # the exit's plan in flight (region/background.py)
    cdef size_t _misses_at_entry
    cdef bint _read                       # the planner took the last PL_READ's events
    cdef object __weakref__

    def __cinit__(self, pool=None, on_exit="detach", collect="young", max_cached_bytes=None,
                  skip_first=False, debug=False, trace=False, scope="thread", name=None,
                  plan=False, **unknown):
        if unknown:
            name = next(iter(unknown))          # (Python's own message names __cinit__)
            raise unexpected_keyword(Region, name, f"; planner options go in plan: Region("
                                     f"plan={{{name!r}: ...}})" if name in _PLAN_OPTIONS else "")
        for what, value, choices in (("on_exit", on_exit, _POLICIES), ("scope", scope, _SCOPES),
                                     ("collect", collect, tuple(_COLLECT))):
            if value not in choices:
                raise ValueError(f"{what} must be one of {choices}, got {value!r}"
                                 f"{did_you_mean(value, choices)}")
        planner = planner_of(plan, Planner, name, skip_first=skip_first, debug=debug,
                             trace=trace)
        from gpupool.core.defaults import get_pool
        if pool is not None and not isinstance(pool, Pool):
            raise TypeError(f"pool must be a gpupool.Pool, got {type(pool).__name__}")
        if max_cached_bytes is not None:
            # Bytes, or a limit string ("512MiB", "10%" of the device) as for Pool's limits,
            # checked before the default pool is looked up (a device needed only for "10%").
            max_cached_bytes = parse_limit(
                max_cached_bytes, lambda: (pool if pool is not None else get_pool()).mem_info()[1],
                "max_cached_bytes")
        if pool is None:
            pool = get_pool()
        self.pool = pool
        self.on_exit = on_exit
        self.scope = scope
        self.skip_first = skip_first
        self.debug = debug
        self.trace = trace
        self._name = name
        self._collect = _COLLECT[collect]
        self._kept = set()
        self._escapes = Escapes(trace)
        self.pool.check_usable()        # (a fork() child; inside the pool's upstream call)
        self.rc = new RegionCache()
        self.rc.max_cached_bytes = max_cached_bytes or 0
        if planner is not None:
            self._planner = planner
            self._planning = threading.Lock()
            self.rc.plan = new PlanTable()
            self._on_record = weak_hook(self, Region._record_step)
            self.rc.on_record = <PyObject*>self._on_record
        if trace:
            self._on_alloc = self._escapes.record_site
            self.rc.on_alloc = <PyObject*>self._on_alloc
        self.pool.region_register(self.rc, scope == "thread" and planner is not None)
        _by_cache[<uintptr_t>self.rc] = (next(_region_ids), weakref.ref(self))

    def __dealloc__(self):
        registry = _by_cache
        if self.rc != NULL and registry is not None:
            registry.pop(<uintptr_t>self.rc, None)
        # A fork() child touches nothing: the pool's lock may be held by a thread not forked.
        if self.rc != NULL and not forked():
            if self.pool is not None:
                self.pool.region_unregister(self.rc)    # deletes it (now or at the unlock)
            else:
                del self.rc.plan
                del self.rc
        self.rc = NULL

    def __enter__(self):
        self.pool.check_usable()
        if self._active_thread is not None:
            raise GpupoolError(
                "this Region is already entered (nested, or on another thread); use one "
                "Region object per scope and per thread")
        if self._job is not None:
            self._take_plan()
        self._skipping = self.skip_first and self.entries == 0
        region_push(self._stacked())
        if self.scope == "process" and not self._skipping:
            if not self.pool.region_set_process(self.rc, True):
                region_pop(self.rc)
                raise GpupoolError(
                    "another Region with scope='process' is entered on this pool")
        if not self._skipping:
            self.pool.region_enter(self.rc, True)
            if self._planner is not None:
                self._misses_at_entry = self.pool.region_counters(self.rc).misses
                self.pool.region_plan(self.rc, PL_ENTRY, NULL)
        self._active_thread = threading.get_ident()
        _entered_here().append(self)
        self.entries += 1
        self._kept.clear()
        return self

    def __exit__(self, exc_type, exc, tb):
        if not forked():
            self.pool.check_usable()    # (inside the pool's upstream call: before any change)
        self._check_exit()
        _entered_here().pop()
        region_pop(self._stacked())
        if forked():
            # A fork() inside the block: the child leaves it without touching the blocks,
            # which are the parent's (no collection, no exit policy, no driver call).
            self._active_thread = None
            return False
        try:
            if self._skipping:
                return False
            if self.scope == "process":
                self.pool.region_set_process(self.rc, False)
            if self.rc.live_count and self._collect is not None:
                # The traceback of an exception raised in the block holds its frames, and so
                # the step's temporaries: drop our references before collecting.
                exc = tb = None
                start = time.perf_counter()
                if self._collect == 1:
                    gc.collect(1)
                else:
                    gc.collect()
                self.collect_seconds += time.perf_counter() - start
                self.collections += 1
            self._settle()
        finally:
            if not self._skipping:
                self.pool.region_leave(self.rc)
            self._active_thread = None
        if self._planner is not None:
            with self._planning:
                self._replan()
        return False

    cdef RegionCache* _stacked(self) noexcept:
        """What its entry's threads push: its cache, or while skipping the uncached marker."""
        return uncached_marker() if self._skipping else self.rc

    cdef int _replan(self) except -1:
        """Hand the recorded events to the planner; install the plan it returns."""
        cdef PlanTable io
        cdef RegionCache counters
        io.same, self._read = self._read, False     # the planner holds the last read's events
        self.pool.region_plan(self.rc, PL_READ, &io)
        events = None if io.same else _event_rows(&io, 3)
        counters = self.pool.region_counters(self.rc)
        grew = counters.misses > self._misses_at_entry
        action = self._planner.exited(events, io.hits, io.misses, grew, io.stopped,
                                     io.first_nbytes)
        self._read = True
        if counters.shared:     # another thread's region takes turns: no plan (core/turns.pxd)
            self._planner.clear()
            action = "clear"
        if action is None:
            io.record_over, io.first_under, io.refit_from = self._planner.bounds()
            self.pool.region_plan(self.rc, PL_OVER, &io)
        elif action == "clear":
            self.pool.region_plan(self.rc, PL_CLEAR, NULL)
        elif action == "layout":
            base = self.pool.region_plan(self.rc, PL_LAYOUT, &io)
            if base == 0:
                self._planner.no_room()
                self.pool.region_plan(self.rc, PL_CLEAR, NULL)
                return 0
            # The plan is made off the exit's thread and installed at the region's next call
            # (_take_plan): the same plan for the same entries (Note [Plans off the exit]).
            self._job = PlanJob(self._planner, base, io.nbytes, _event_rows(&io, 2))
        return 0

    cdef int _take_plan(self) except -1:
        """Wait for the exit's plan in flight and install it (none: PL_CLEAR, the next
        entry online); raise what making it raised, the table left as it was."""
        with self._planning:
            job, self._job = self._job, None
            if job is None:
                return 0
            made = job.result()
            if made is None:
                self.pool.region_plan(self.rc, PL_CLEAR, NULL)
            elif made is not DROPPED:
                table, length, nbytes, grows = made[:4]
                self._install(table, length, nbytes, job.base, False, grows, made[4:])
        return 0

    cdef bint _install(self, table, int64_t length, size_t nbytes, uintptr_t base,
                       bint lenient, bint grows, tuple bounds) except -1:
        """Install a plan at base, given as its (6, n) ``background.columns`` table, its
        step's events and its range's bytes: lenient, a request larger than its place misses
        alone (a record step's plan: not installed if an event of the entry came since its
        PL_RECORD); grows, places past the mapped end map pages; bounds, ``Planner.bounds``'s
        (record_over, first_under, refit_from): request 0 over record_over bytes makes a
        record step (0: none), under first_under goes online (0: never); from request
        refit_from on (-1: none) one past its place is refitted. Whether it was installed."""
        cdef PlanTable io
        cdef const int64_t[:, ::1] columns = table     # copied into the table's vectors in C
        pt_fill(&io, &columns[0, 0], columns.shape[1])
        io.length = length
        io.nbytes = nbytes
        io.base = base
        io.lenient, io.grows = lenient, grows
        io.record_over, io.first_under, io.refit_from = bounds
        if self.pool.region_plan(self.rc, PL_INSTALL, &io) == 0:
            return False
        self._planner.base = base
        return True

    def _record_step(self, ptr):
        """The slow path of a record step's request 0 (at ptr, served online): the core
        swapped it in for the allocation's (``on_alloc``); the step's plan is made now and
        serves the entry's next requests (Note [Planned regions]). Any thread that allocates
        in the region may run it (the C API's included). It plans nothing when another event
        of the entry came first, or while the planner plans on another thread (the exit's
        plans, or this record step's slow path run there: the step is then served online),
        and the plan is not installed when an event of the entry came while it was made."""
        cdef PlanTable io
        if self.trace:
            self._escapes.record_site(ptr)
        if not self._planning.acquire(False):
            return          # the exit (PL_READ) or the other thread (PL_RECORD) swaps back
        try:
            base = self.pool.region_plan(self.rc, PL_RECORD, &io)     # swaps the paths back
            if base == 0 or io.record_nbytes == 0:
                return
            placed = self._planner.record_plan(io.record_nbytes, base, _event_rows(&io, 2), ptr)
            if placed is None:
                return
            table, length, nbytes = installed(placed)
            bounds = (io.record_nbytes, 0, self._planner.bounds()[2])
            if not self._install(table, length, nbytes, base, True, True, bounds):
                self._planner.record_dropped()
        finally:
            self._planning.release()

    cdef int _check_exit(self) except -1:
        """Raise unless this exit closes the innermost region entered on this thread; the
        region stays entered then."""
        if self._active_thread is None:
            raise GpupoolError(f"{self!r} exited without being entered: each Region.__exit__ "
                               f"must follow its Region.__enter__ (use `with region:`)")
        if self._active_thread != threading.get_ident():
            raise GpupoolError(f"{self!r} exited on another thread than the one that entered "
                               f"it; exit a region on its entering thread")
        regions = _entered_here()
        innermost = regions[len(regions) - 1] if regions else self     # (no wraparound here)
        if innermost is not self:
            raise GpupoolError(f"{self!r} exited while {innermost!r}, entered inside it, is "
                               f"still entered: exit the innermost region first")
        return 0

    cdef int _settle(self) except -1:
        """Apply on_exit to the region's buffers still alive (Pool.region_exit), then look
        for a leak."""
        escaping = []
        self.live_at_exit_bytes = self.pool.region_exit(
            self.rc, self._kept, self.on_exit == "detach", POISON if self.debug else -1,
            escaping)
        self._kept.clear()
        self._escapes.exited(escaping, self.live_at_exit_bytes, self._name, self.__repr__)
        return 0

    def enter_in_thread(self):
        """Context manager: make this region current in the calling (worker) thread too.

        Allocations made there from the region's pool are cached by the region, as those of
        the thread that entered it; entered during a first entry that ``skip_first`` skips,
        the pool serves them, until this block exits. The exit policy and collection stay
        with that thread's ``with region:``; use this only while the region is entered there.

        Raises
        ------
        GpupoolError
            On entry: the region is not entered (``with region:``, any thread, either scope),
            or as for ``with region:``. On exit: on another thread than its entry's (nothing
            changes: exit it on its own thread).
        """
        return _InThread(self)

    def keep(self, obj):
        """Exempt one buffer from the exit policy: it stays valid and leaves the region.

        Parameters
        ----------
        obj : DeviceBuffer, BufferView or object with ``__cuda_array_interface__`` /
                ``__dlpack__``
            A buffer allocated in this region (or a view of one), or an array whose data pointer
            lies inside one of the region's live blocks. An empty buffer, an array of no elements
            (whose pointer is not read), or any buffer while a first entry is skipped
            (``skip_first``: its buffers are the pool's) has no memory to keep: nothing is done.

        Returns
        -------
        obj

        Raises
        ------
        ValueError
            ``obj`` is not memory of one of this region's live buffers.
        """
        cdef Block* b
        cdef uintptr_t ptr
        target = obj.buffer if isinstance(obj, BufferView) else obj
        if isinstance(target, DeviceBuffer):
            ptr = (<DeviceBuffer>target)._live_ptr()
        else:
            ptr = _data_pointer(obj)
        if ptr == 0 or self._skipping:
            return obj
        self.pool.check_usable()
        b = self.pool.region_find_live(self.rc, ptr)
        if b == NULL:
            raise ValueError(f"{obj!r} is not memory of a live buffer of this region")
        self._kept.add(<uintptr_t>b)
        return obj

    def release(self):
        """Give the region's cached blocks back to the pool (buffers alive are untouched).

        They stay where they are, free: other allocations may take them, and a trim gives
        them back to the upstream. A planned region's plan is dropped too (the places it
        claims are the pool's again); the next entries plan again."""
        self.pool.check_usable()
        self.pool.region_drain(self.rc)
        if self._planner is not None:
            try:
                self._take_plan()       # raises what making it raised, after the clear
            finally:
                with self._planning:        # not while an exit or a record step plans
                    self.pool.region_plan(self.rc, PL_CLEAR, NULL)
                    self._planner.clear()

    def stats(self):
        """The region's counters as a :class:`gpupool.RegionStats` (a planned region's once
        the exit's plan in flight is made and installed)."""
        self.pool.check_usable()
        if self._job is not None:
            self._take_plan()
        cdef RegionCache rc = self.pool.region_counters(self.rc)
        return RegionStats(
            entries=self.entries, cache_hits=rc.hits, cache_misses=rc.misses,
            cached_bytes=rc.cached_bytes, live_at_exit_bytes=self.live_at_exit_bytes,
            peak_in_use_bytes=rc.peak_in_use_bytes, collections=self.collections,
            collect_seconds=self.collect_seconds, lane_hits=rc.lane_hits,
            shared_entries=rc.shared_entries,
            **(plan_fields(self._planner.counts, self._planner.plans)
               if self._planner is not None else {}))

    @property
    def planner(self):
        """A planned region's :class:`gpupool.region.planned.Planner` (None without a plan),
        once the exit's plan in flight is made and installed."""
        if self._job is not None:
            self._take_plan()
        return self._planner

    def reset_peak_stats(self):
        """Set the region's peak bytes in use to the bytes its live buffers hold now."""
        self.pool.check_usable()
        self.pool.region_reset_peak(self.rc)

    def __reduce__(self):
        raise not_picklable("a gpupool.Region", "make the Region in the process that runs the "
                            "step (gpupool.Region(pool=...) there)")

    def __repr__(self):
        name = f" {self._name!r}" if self._name else ""
        return (f"<gpupool.Region{name} on_exit={self.on_exit!r} scope={self.scope!r} "
                f"plan={self._planner is not None} entries={self.entries} "
                f"cached={self.rc.cached_bytes}>")


def _regions_by_cache():
    """``{cache address: (region id, name or None)}`` of every Region alive."""
    found = {}
    for key, (region_id, ref) in list(_by_cache.items()):
        region = ref()
        if region is not None:
            found[key] = (region_id, (<Region>region)._name)
    return found


def _data_pointer(obj):
    """Device pointer of the data of an object exporting the CUDA Array Interface or DLPack;
    0 for an array of no elements (its pointer is not read)."""
    cai = read_cai(obj)
    if cai is not None:
        return cai.ptr
    if hasattr(obj, "__dlpack__"):
        return capsule_data(obj.__dlpack__())   # not consumed: its destructor frees it
    raise TypeError(
        f"keep() needs a DeviceBuffer or an object with __cuda_array_interface__ or "
        f"__dlpack__, got {type(obj).__name__}")


include "inthread.pxi"
