# A region entered on a worker thread (Region.enter_in_thread): current there until that thread
# exits it. Included into region/region.pyx, which owns the region's cache.

cdef class _InThread:
    """The context manager of ``Region.enter_in_thread()``: the region current on the thread
    that enters it, until that thread exits it. An exit on another thread raises and changes
    nothing (the entering thread's stack of regions is its own; left there, a dropped
    region's cache would be read by its next allocation)."""
    cdef Region region
    cdef object thread

    def __cinit__(self, Region region):
        self.region = region

    def __enter__(self):
        if self.thread is not None:
            raise GpupoolError("this enter_in_thread() block is already entered")
        self.region.pool.check_usable()
        region_push(self.region.rc)
        self.region.pool.region_enter(self.region.rc, False)
        self.thread = threading.get_ident()
        return self.region

    def __exit__(self, exc_type, exc, tb):
        if self.thread != threading.get_ident():
            raise GpupoolError(
                "an enter_in_thread() block exited on another thread than the one that "
                "entered it (or without being entered); exit it on its entering thread")
        if not forked():            # a fork() child leaves it without the pool's lock
            self.region.pool.region_leave(self.region.rc)
        region_pop(self.region.rc)
        self.thread = None
        return False
