# A region entered on a worker thread (Region.enter_in_thread): current there until that thread
# exits it. Included into region/region.pyx, which owns the region's cache.

# Per thread, the regions entered there with enter_in_thread(): held, so that none dies (its
# cache deleted) while the thread's stack of regions names it.
_in_thread = threading.local()


cdef class _InThread:
    """The context manager of ``Region.enter_in_thread()`` (also a decorator): the region
    current on the thread that enters it, until that thread exits it. Its entry raises
    unless the region is entered (``with region:``, on any thread); an exit on another
    thread raises and changes nothing (the entering thread's stack of regions is its own).
    Entered during a skipped entry (``skip_first``), it pushes the uncached marker instead,
    until its exit: the pool serves the thread, as it does the entering one."""
    cdef Region region
    cdef object thread
    cdef RegionCache* pushed        # its entry's: the region's cache or the uncached marker

    def __cinit__(self, Region region):
        self.region = region

    def __enter__(self):
        if self.thread is not None:
            raise GpupoolError("this enter_in_thread() block is already entered")
        self.region.pool.check_usable()
        if self.region._active_thread is None:
            # Not entered: nothing would ever apply its exit policy to the worker's
            # allocations, and the region would cache them outside any entry.
            raise GpupoolError(
                f"{self.region!r} is not entered: enter_in_thread() makes a region entered "
                f"with `with region:` (on any thread) current on this thread too; enter the "
                f"region first")
        self.thread = threading.get_ident()     # before the lock's wait lets others run
        self.pushed = self.region._stacked()
        region_push(self.pushed)
        if self.pushed == self.region.rc:
            self.region.pool.region_enter(self.region.rc, False)
        held = getattr(_in_thread, "regions", None)
        if held is None:
            held = _in_thread.regions = []
        held.append(self.region)
        return self.region

    def __exit__(self, exc_type, exc, tb):
        if self.thread != threading.get_ident():
            raise GpupoolError(
                "an enter_in_thread() block exited on another thread than the one that "
                "entered it (or without being entered); exit it on its entering thread")
        if not forked():            # a fork() child leaves it without the pool's lock
            self.region.pool.check_usable()
            if self.pushed == self.region.rc:
                self.region.pool.region_leave(self.region.rc)
        region_pop(self.pushed)
        _in_thread.regions.remove(self.region)
        self.thread = None
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def entered(*args, **kwargs):
            with _InThread(self.region):
                return fn(*args, **kwargs)
        return entered
