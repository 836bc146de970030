# cython: language_level=3
"""The out-of-memory ladder's last step: ``on_oom`` callbacks, and the ``OutOfMemoryError``
of a request that failed after the whole ladder (core/ladder.pxd has the first steps)."""
from gpupool.records.counters cimport Counters
from gpupool.history.ring cimport hist_flush_log

import logging

from gpupool.errors import OutOfMemoryError
from gpupool.stats import format_bytes

_oom_callbacks = []
_logger = logging.getLogger("gpupool")


cdef bint oom_run_callbacks(Counters* c, int device, size_t nbytes) except -1:
    """Run the on_oom callbacks (with the GIL) for a request of nbytes on device, counted in
    c's oom_retries; whether there were any to run. A callback that raises is logged and the
    others still run."""
    if not _oom_callbacks:
        return False
    c.oom_retries += 1
    hist_flush_log()
    _logger.debug("gpupool: out of memory on device %d for %d B: step 3, running %d on_oom "
                  "callbacks, then retrying", device, nbytes, len(_oom_callbacks))
    for callback in list(_oom_callbacks):
        try:
            callback(nbytes)
        except Exception:
            _logger.exception(
                "gpupool: the on_oom callback %r raised while memory for %d B was wanted on "
                "device %d; the other callbacks run and the allocation is retried",
                callback, nbytes, device)
    return True


cdef object oom_error(int device, Counters c, size_t hard_limit, size_t nbytes):
    """The OutOfMemoryError of a failed request of nbytes on device, from the pool's counters c
    (core/magpool.pxd, mp_counters_view) and hard limit (0: none). It asks the upstream
    nothing: a driver call could fail or block where memory just ran out, so the device's
    free and total bytes stay None."""
    limit = hard_limit or None
    where = f"; hard limit {format_bytes(limit)}" if limit else ""
    return OutOfMemoryError(
        f"gpupool: out of memory on device {device} allocating "
        f"{format_bytes(nbytes)} ({nbytes} B): {format_bytes(c.in_use)} in use, "
        f"{format_bytes(c.reserved)} reserved, {format_bytes(c.cached)} cached "
        f"by the pool and its regions{where}. Free buffers you no longer need, "
        f"release regions (region.release()), or register a callback with gpupool.on_oom; "
        f"gpupool.pool_status() shows the device's free memory.",
        requested_bytes=nbytes, in_use_bytes=c.in_use, reserved_bytes=c.reserved,
        cached_bytes=c.cached, limit_bytes=limit)


def on_oom(callback):
    """Register ``callback(nbytes)`` to run when an allocation fails for lack of memory.

    Callbacks run (in registration order, outside the pool's lock) after the pool has
    released its own and its regions' caches; the allocation is then retried once.
    ``gpupool.on_oom(lambda n: gc.collect())`` is the usual one. Returns ``callback`` so it
    can be used as a decorator.

    A callback that raises (an ``Exception``) does not replace the out-of-memory error: its
    exception is logged with its traceback to the ``"gpupool"`` logger
    (``logging.getLogger("gpupool")``), the other callbacks run and the allocation is retried;
    if the retry fails too, the ``OutOfMemoryError`` is raised as without the callback.

    Raises
    ------
    TypeError
        ``callback`` is not callable.
    """
    if not callable(callback):
        raise TypeError("on_oom needs a callable taking the requested nbytes")
    _oom_callbacks.append(callback)
    return callback


def remove_oom_callback(callback):
    """Unregister a callback added with :func:`on_oom` (its first registration, if it was
    registered more than once).

    Raises
    ------
    ValueError
        ``callback`` is not registered.
    """
    try:
        _oom_callbacks.remove(callback)
    except ValueError:
        raise ValueError(f"{callback!r} is not an on_oom callback: gpupool.remove_oom_callback "
                         f"takes a callable registered with gpupool.on_oom "
                         f"({len(_oom_callbacks)} registered now)") from None
