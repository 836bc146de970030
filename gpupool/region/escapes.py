"""A region's watch on buffers escaping its steps: where each of its buffers was allocated
(``Region(trace=True)``), and the warning when the bytes of buffers alive at exit grow for
LEAK_ENTRIES consecutive entries. Pure Python; the region (region/region.pyx) calls it."""

import os
import sys
import warnings

from gpupool.stats import format_bytes

__all__ = ["Escapes", "LEAK_ENTRIES"]

LEAK_ENTRIES = 3                # consecutive growths of bytes alive at exit before a warning
# Frames of these packages are skipped when tracing where an escaping buffer was allocated:
# the folders they are installed in (not any folder of that name: a user's checkout of
# gpupool, or a project folder called torch, is the user's code).
_LIBRARIES = ("gpupool", "cupy", "cupy_backends", "numba", "torch")


def _library_dirs():
    """The install folders of the libraries of _LIBRARIES imported so far."""
    dirs = []
    for name in _LIBRARIES:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


class Escapes:
    """The allocation sites of a region's buffers (by pointer) and its last exits' bytes of
    buffers alive at exit.

    Parameters
    ----------
    trace : bool
        Whether :meth:`record_site` is called for each allocation (the warning then names
        the sites).
    """

    def __init__(self, trace):
        self.trace = trace
        self._sites = {}
        self._alive = []

    def record_site(self, ptr):
        """Remember where the buffer at ``ptr`` (an int) is being allocated: file:line of the
        innermost frame outside gpupool and the array libraries; nothing when there is none
        (an allocation of C code on a thread of its own)."""
        try:
            frame = sys._getframe(0)
        except ValueError:
            return
        libraries = _library_dirs()
        while frame is not None and frame.f_code.co_filename.startswith(libraries):
            frame = frame.f_back
        if frame is not None:
            self._sites[ptr] = f"{frame.f_code.co_filename}:{frame.f_lineno}"

    def exited(self, escaping, alive, name, describe):
        """An exit left the buffers at the pointers ``escaping`` alive, ``alive`` bytes in all;
        ``name`` names the region in the warning, or when it is empty ``describe()`` does
        (called only then: a region's repr cost its every exit more than the rest here).

        Warns
        -----
        ResourceWarning
            When ``alive`` grew at each of the last LEAK_ENTRIES exits; it points at the
            caller of the region's ``__exit__`` (the ``with`` line: a compiled caller adds no
            frame).
        """
        if self._sites:
            self._sites = {p: self._sites[p] for p in escaping if p in self._sites}
        self._alive.append(alive)
        del self._alive[:-LEAK_ENTRIES - 1]
        # (Nothing alive did not grow: the usual exit skips the look at the last ones.)
        if not alive or len(self._alive) <= LEAK_ENTRIES or any(
                later <= earlier for earlier, later in zip(self._alive, self._alive[1:])):
            return
        self._alive.clear()
        sites = list(self._sites.values())
        if sites:
            where = f" Allocated at: {', '.join(sorted(set(sites)))}."
        elif self.trace:
            where = (" No allocation site outside gpupool and the array libraries was found "
                     "for them.")
        else:
            where = " Use Region(trace=True) to see where they were allocated."
        warnings.warn(
            f"gpupool region {name or describe()}: bytes of buffers alive at exit grew for "
            f"{LEAK_ENTRIES} consecutive entries (now {format_bytes(alive)}): buffers are "
            f"escaping the step.{where}", ResourceWarning, stacklevel=2)
