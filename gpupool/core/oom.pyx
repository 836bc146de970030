# cython: language_level=3
"""The out-of-memory ladder's last step: ``on_oom`` callbacks, and the ``OutOfMemoryError``
of a request that failed after the whole ladder (core/ladder.pxd has the first steps)."""
from libc.stdint cimport uint32_t
from gpupool.records.counters cimport Counters
from gpupool.history.ring cimport hist_flush_log

import logging
import os

from gpupool.errors import OutOfMemoryError
from gpupool.stats import format_bytes

_oom_callbacks = []
_logger = logging.getLogger("gpupool")
_device_totals = {}         # pool id -> its device's total bytes (oom_note_total)
_hooks = {"dump_snapshot": None, "region_names": None}     # _set_forensics
cdef bint _dumped = False   # GPUPOOL_OOM_SNAPSHOT written (or tried) once


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


cdef void oom_note_total(uint32_t pool_id, size_t total) noexcept:
    """Remember the total memory of pool pool_id's device, learnt from a mem_info call made
    when it was safe (core/poolbase.pyx): the error then needs no driver call for it."""
    _device_totals[pool_id] = total


cdef object oom_error(int device, uint32_t pool_id, bint real_device, OomFacts* f,
                      size_t nbytes):
    """The OutOfMemoryError of a failed request of nbytes on device, from the facts f that
    oom_gather read under the pool's lock (core/oom.pxd).

    It asks the upstream nothing: a driver call could fail or block where memory just ran
    out. The device's total is the one remembered from the pool's creation (a driver
    upstream's mem_info, a Python upstream's ``total_bytes``) or any later
    ``Pool.mem_info()``; on a real device
    (real_device) NVML, which needs no CUDA context, gives the free and total bytes and those
    of other processes when ``pynvml`` is installed. At the first out of memory of the process,
    ``GPUPOOL_OOM_SNAPSHOT`` names a file for a memory snapshot (oom_dump_once)."""
    cdef Counters c = f.c
    cdef size_t i
    limit = f.hard_limit or None
    nvml = nvml_memory(device) if real_device else None
    free, total, others = nvml if nvml is not None else (None, None, None)
    if total is None:
        total = _device_totals.get(pool_id)
    unusable = c.cached - f.servable if c.cached > f.servable else 0
    names = _hooks["region_names"]() if _hooks["region_names"] is not None else {}
    by_owner = {}
    for i in range(f.owners.size()):
        region_id, name = names.get(f.owners[i], (None, None))
        kind = "private pool" if f.owner_private[i] else "region"
        label = f"{kind} {region_id if region_id is not None else hex(f.owners[i])}"
        by_owner[label + (f" {name!r}" if name else "")] = f.owner_bytes[i]
    regions = sum(by_owner.values())
    by_owner = {"pool": c.in_use - regions if c.in_use > regions else 0, **by_owner}
    by_stream = {f.streams[i]: f.stream_bytes[i] for i in range(f.streams.size())}
    head = (f"gpupool: out of memory on device {device} allocating "
            f"{format_bytes(nbytes)} ({nbytes} B): ")
    numbers = (f"{format_bytes(c.in_use)} in use, {format_bytes(c.reserved)} reserved, "
               f"{format_bytes(c.cached)} cached by the pool and its regions")
    pages = (nbytes + f.page - 1) // f.page if f.page else 0
    if limit and nbytes > limit:
        text = (f"{head}the request can never fit: {nbytes} B requested, hard limit "
                f"{_exact(limit)}. Raise the limit (Pool(hard_limit=...), "
                f"GPUPOOL_HARD_LIMIT) or split the allocation; {numbers}.")
    elif limit and pages * f.page > limit:
        text = (f"{head}the request can never fit: it needs {_pages(pages, f.page)} (the "
                f"upstream maps whole pages) and the hard limit {_exact(limit)} holds "
                f"{_pages(limit // f.page, f.page)}. Raise the limit to a whole number of "
                f"pages (at least {_exact(pages * f.page)} for this request: "
                f"Pool(hard_limit=...), GPUPOOL_HARD_LIMIT), split the allocation, or use "
                + ("upstream='driver'" if real_device else
                   "a gpupool.testing.SimulatedDevice without virtual_memory=True")
                + f", whose segments can be the exact request; {numbers}.")
    elif total and nbytes > total:
        text = (f"{head}the request can never fit: {nbytes} B requested, the device has "
                f"{_exact(total)}. Split the allocation or use a device "
                f"with more memory; {numbers}.")
    else:
        text = head + numbers
        if c.cached:
            text += (f" (largest free block {format_bytes(f.largest)}; "
                     f"{format_bytes(unusable)} of the cached bytes cannot serve this "
                     f"request: fragmentation)")
        if limit:
            text += f"; hard limit {format_bytes(limit)}"
        text += ". In use by " + _top(by_owner)
        if by_stream:
            text += "; by stream " + _top({hex(k): v for k, v in by_stream.items()})
        if others:
            text += f". Other processes use {format_bytes(others)} of the device"
        text += (". Free buffers you no longer need, release regions (region.release()), "
                 "or register a callback with gpupool.on_oom")
        if unusable:
            # Expandable segments are the way out named for a plain upstream only.
            text += ("; fragmented memory joins once the buffers between its blocks are "
                     "freed" + ("" if f.page else " (" + (
                         "upstream='vmm'" if real_device else
                         "gpupool.testing.SimulatedDevice(virtual_memory=True)") +
                         " grows segments instead)"))
        # pool_status() reports the default pool of a GPU: pool= reaches any pool.
        text += (f"; gpupool.pool_status(pool=...) given this pool shows "
                 f"{'the device' if real_device else 'its upstream'}'s free memory.")
    error = OutOfMemoryError(
        text, requested_bytes=nbytes, in_use_bytes=c.in_use, reserved_bytes=c.reserved,
        cached_bytes=c.cached, limit_bytes=limit, device_free_bytes=free,
        device_total_bytes=total, largest_free_bytes=f.largest,
        unusable_cached_bytes=unusable, by_owner=by_owner, by_stream=by_stream,
        device_used_by_others_bytes=others)
    oom_dump_once(device)
    return error


def _exact(n):
    """n bytes as format_bytes gives them, and exactly when that rounds."""
    text = format_bytes(n)
    return text if text == f"{n} B" else f"{text} ({n} B)"


def _pages(count, page):
    """count pages of page bytes, as "2 pages of 2.000 MiB"."""
    return f"{count} page{'' if count == 1 else 's'} of {format_bytes(page)}"


def _top(owners, int count=3):
    """The count biggest of owners ({label: bytes}) as "label 1.000 MiB, ..."."""
    ranked = sorted(owners.items(), key=lambda item: -item[1])
    text = ", ".join(f"{label} {format_bytes(n)}" for label, n in ranked[:count])
    return text + (f" and {len(ranked) - count} more" if len(ranked) > count else "")


def nvml_memory(int device):
    """``(free, total, used by other processes)`` bytes of CUDA device ``device`` from NVML, or
    None: no ``pynvml`` (nvidia-ml-py), no NVML, a device NVML cannot be matched to (a MIG
    instance; an index under ``CUDA_VISIBLE_DEVICES`` or, with several devices, without
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, whose order NVML does not share), or any failure."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        handle = _nvml_handle(pynvml, device)
        if handle is None:
            return None
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        mine = os.getpid()
        others = sum(p.usedGpuMemory or 0
                     for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                     if p.pid != mine)
        return int(info.free), int(info.total), int(others)
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _nvml_handle(pynvml, int device):
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",")]
        if device >= len(entries):
            return None
        entry = entries[device]
        if entry.startswith("GPU-"):
            return pynvml.nvmlDeviceGetHandleByUUID(entry)
        if not entry.isdigit():
            return None                  # MIG- instances and abbreviated UUIDs: not matched
        device = int(entry)
    if (pynvml.nvmlDeviceGetCount() > 1
            and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID"):
        return None
    return pynvml.nvmlDeviceGetHandleByIndex(device)


cdef void oom_dump_once(int device):
    """At the process's first out of memory, write a memory snapshot (PyTorch's visualizer
    format, gpupool.dump_snapshot) to ``GPUPOOL_OOM_SNAPSHOT`` if set; a failure is logged,
    never raised: the out-of-memory error stays the error."""
    global _dumped
    path = os.environ.get("GPUPOOL_OOM_SNAPSHOT")
    if not path or _dumped or _hooks["dump_snapshot"] is None:
        return
    _dumped = True
    try:
        _hooks["dump_snapshot"](path)
    except Exception as e:
        _logger.warning("gpupool: out of memory on device %d: the memory snapshot for "
                        "GPUPOOL_OOM_SNAPSHOT=%r could not be written: %r", device, path, e)
    else:
        _logger.warning("gpupool: out of memory on device %d: memory snapshot written to %s "
                        "(GPUPOOL_OOM_SNAPSHOT; open it at https://pytorch.org/memory_viz)",
                        device, path)


def _set_forensics(dump_snapshot, region_names):
    """Set by gpupool.snapshot (a layer above core): the snapshot writer (``path`` -> None)
    and ``{RegionCache address: (region id, name)}`` for the error's owners."""
    _hooks["dump_snapshot"] = dump_snapshot
    _hooks["region_names"] = region_names


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
