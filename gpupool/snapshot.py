"""Memory snapshots in PyTorch's format: what PyTorch users look at in its memory visualizer.

``record_memory_history()`` starts recording every allocation, free and segment event of
every pool (with the Python frames that made them); ``memory_snapshot()`` returns the pools'
segments and blocks and the recorded events as the dict that ``torch.cuda.memory._snapshot()``
returns; ``dump_snapshot(path)`` writes it as a pickle for https://pytorch.org/memory_viz and
``torch.cuda._memory_viz`` (``segment_plot``, ``trace_plot``, ``segsum``, ``trace``,
``segments``, ``memory``, ``compare``).

The format (as PyTorch 2.x writes it, ``torch/csrc/cuda/memory_snapshot.cpp``)::

    {"segments": [{"device", "address", "total_size", "allocated_size", "active_size",
                   "requested_size", "stream", "segment_type", "segment_pool_id",
                   "is_expandable", "frames",
                   "blocks": [{"address", "size", "requested_size", "state", "frames"}]}],
     "device_traces": [[{"action", "addr", "size", "stream", "time_us", "frames"}], ...],
     "allocator_settings": {...}, "external_annotations": []}

How gpupool's pools map onto it:

* A segment is one upstream allocation of a plain pool (``driver``, ``async``, the simulated
  device), or one mapped run of an expandable segment (``vmm``; ``is_expandable`` True):
  unmapped holes are no memory, as in PyTorch's expandable segments. Its blocks tile it; the
  sizes of all segments sum to the pool's reserved bytes, those of ``"active_allocated"``
  blocks to its bytes in use.
* Block states: ``"active_allocated"`` (live), ``"active_pending_free"`` (free, waiting for
  the events of streams added with ``record_stream``), ``"inactive"`` (free; parked blocks
  too).
* ``segment_pool_id``: ``(0, 0)`` for the device's default pool (``gpupool.get_pool``), as
  PyTorch's default pool; ``(0, n)`` for any other ``Pool``, ``n`` its id.
* Regions: a region's blocks are in its pool's segments (a region caches free blocks of the
  pool), so they are told apart per block. Every block has a ``"region"`` key: the region's
  id, or None for the pool's own. A live block allocated in a region (and returning to it)
  has the region's id; a block the region caches is ``"inactive"`` and has one frame,
  ``{"filename": "gpupool", "line": 0, "name": "cached by region <id> <name>"}``, which the
  visualizer's segment and flame-graph views show for it. The top-level ``"regions"`` list
  gives each region's id, name, device and bytes. A private pool's blocks (a CUDA graph's,
  region/privatepool.pxd) have ``"region"`` None, its cached ones the frame ``"cached by a
  private pool"``, and the list an entry of id None and that name.
* Traces: one list per device, oldest first; ``alloc`` (``size``: the bytes requested),
  ``free_requested`` and ``free_completed`` (together: a freed block is reused in stream
  order at once), ``segment_alloc`` / ``segment_free`` (plain segments),
  ``segment_map`` / ``segment_unmap`` (pages of expandable segments), ``oom`` (its
  ``device_free``: what the hard limit still allows, 0 without one: gpupool makes no driver
  call where memory has just run out). ``stream`` is the stream's handle (0: the legacy
  default stream, 2: the per-thread one); ``time_us`` microseconds since the epoch.
* Frames (innermost first) are the Python frames of the call, gathered when the calling
  thread holds the GIL: ``Pool.allocate``, buffer frees, the CuPy and Numba adapters, C API
  calls made with the GIL, and PyTorch's global allocator (``gpupool.torch.use()``, whose
  entry point takes the GIL to gather them while recording). C API calls made without the
  GIL, and ``gpupool.torch.mempool()`` allocations (PyTorch's own history records those),
  have none.
"""

import os
import pickle

from gpupool.core import defaults

from gpupool.history import ring

from gpupool.region import region
from gpupool.core.pool import Pool, _snapshot_of
from gpupool.core import oom

__all__ = ["dump_snapshot", "memory_snapshot", "record_memory_history"]

# Trace actions by their history/ring.pxd code.
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "oom")
# The last pickle protocol that PyTorch's visualizer (its own unpickler) reads.
PICKLE_PROTOCOL = 4
LARGE_SEGMENT = 1 << 20         # PyTorch's "large" segments: above 1 MiB


def record_memory_history(enabled="all", max_entries=100_000, stacks="python"):
    """Start or stop recording the memory history of every pool, as PyTorch's
    ``torch.cuda.memory._record_memory_history``.

    Parameters
    ----------
    enabled : {"all", "state", True, None, False}
        ``"all"`` (or True): record every allocation, free and segment event in a ring of
        ``max_entries`` per device, and the allocation frames of live blocks; ``"state"``:
        only the latter (no trace); None or False: stop and forget everything recorded.
        Calling it again while recording changes the settings and keeps the entries (the
        newest ``max_entries`` of them).
    max_entries : int
        Entries kept per device, >= 1; older ones are overwritten. An entry takes about
        100 B plus 8 B per frame.
    stacks : {"python", None}
        ``"python"``: each entry and live block keeps the Python frames of the call that
        made it, innermost first, at most 64 (a few microseconds per entry); None: no frames
        (cheapest). C++ frames are not gathered.

    Raises
    ------
    ValueError, TypeError
        An unknown ``enabled`` or ``stacks``, or ``max_entries`` not an int >= 1.

    Notes
    -----
    Recording costs the pools nothing while off (one test of a flag per allocation and
    free). It covers every pool, made before or after the call.
    """
    if enabled is None or enabled is False:
        ring._configure(False)
        return
    if enabled is True:
        enabled = "all"
    if enabled not in ("all", "state"):
        raise ValueError(f"enabled must be 'all', 'state', True, None or False, got {enabled!r}")
    if stacks not in ("python", None):
        raise ValueError(f"stacks must be 'python' or None (gpupool gathers no C++ frames), "
                         f"got {stacks!r}")
    if type(max_entries) is not int:
        raise TypeError(f"max_entries must be an int, got {type(max_entries).__name__}")
    if max_entries < 1:
        raise ValueError(f"max_entries must be >= 1, got {max_entries}")
    ring._configure(True, trace=enabled == "all", stacks=stacks == "python",
                        max_entries=min(max_entries, 1 << 62))


def memory_snapshot(pool=None):
    """The state of the pools and their recorded history, as ``torch.cuda.memory._snapshot()``
    returns PyTorch's (the module docstring says how pools map onto the format).

    Parameters
    ----------
    pool : Pool, optional
        Only this pool's segments and trace entries; default: every pool of every device
        (the trace entries of pools gone since are kept).

    Returns
    -------
    dict
        ``"segments"``, ``"device_traces"`` (a list per device, empty ones included up to the
        last device with a pool or an entry), ``"allocator_settings"``,
        ``"external_annotations"`` (empty) and ``"regions"``: ``[{"id", "name", "device",
        "segment_pool_id", "cached_bytes", "live_bytes"}]``. Each pool is read under its
        lock, and its trace ends exactly at the state read, so replaying the trace backwards
        from the segments (as the visualizer does) is consistent.

    Raises
    ------
    TypeError
        ``pool`` is not a ``gpupool.Pool``.
    GpupoolError
        In a ``fork()`` child of a process that used gpupool (its pools cannot be read).
    """
    if pool is not None and not isinstance(pool, Pool):
        raise TypeError(f"pool must be a gpupool.Pool, got {type(pool).__name__}")
    ring.flush_log()
    start = ring._last_seq()        # entries of pools not read below: up to here
    pools = ring._live_pools()
    if pool is not None:
        pools = {pool_id: p for pool_id, p in pools.items() if p is pool}
    regions_known = region._regions_by_cache()
    cache = {}
    segments, regions, cutoff = [], [], {}
    for pool_id, p in sorted(pools.items()):
        seq, pool_segments, pool_regions, _ = _snapshot_of(p, cache)
        cutoff[pool_id] = seq
        pool_key = _pool_key(pool_id, p)
        names = {}
        for cache_address, cached, live, private in pool_regions:
            region_id, name = (None, "a private pool") if private else \
                regions_known.get(cache_address, (0, None))
            names[cache_address] = region_id, name
            regions.append({"id": region_id, "name": name, "device": p.device,
                            "segment_pool_id": pool_key, "cached_bytes": cached,
                            "live_bytes": live})
        segments.extend(_segment(p.device, pool_key, names, segment)
                        for segment in pool_segments)
    entries = ring._entries(cache)
    traces = []
    for device_entries in entries:
        traces.append([_entry(e) for e in device_entries
                       if (e[0] <= cutoff[e[2]] if e[2] in cutoff
                           else pool is None and e[0] <= start)])
    devices = max([len(traces) - 1] + [p.device for p in pools.values()])
    traces.extend([] for _ in range(devices + 1 - len(traces)))
    return {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": _settings(pools.values()),
        "external_annotations": [],
        "regions": regions,
    }


def dump_snapshot(path, pool=None):
    """Write :func:`memory_snapshot` as a pickle, as ``torch.cuda.memory._dump_snapshot``.

    Parameters
    ----------
    path : str or os.PathLike
        The file to write (replaced if it exists). Open it at https://pytorch.org/memory_viz
        or with ``python -m torch.cuda._memory_viz``.
    pool : Pool, optional
        As for :func:`memory_snapshot`.

    Notes
    -----
    The pickle uses protocol 4, the last one that PyTorch's visualizer reads.
    """
    snapshot = memory_snapshot(pool)
    with open(os.fspath(path), "wb") as f:
        pickle.dump(snapshot, f, protocol=PICKLE_PROTOCOL)


def _pool_key(pool_id, pool):
    """The pool's segment_pool_id: (0, 0) for the device's default pool, else (0, id)."""
    return (0, 0) if defaults._pools.get(pool.device) is pool else (0, pool_id)


def _segment(device, pool_key, names, segment):
    address, stream, expandable, frames, rows = segment
    blocks = []
    total = allocated = active = requested = 0
    for ptr, size, wanted, state, cache_address, block_frames in rows:
        region_id = names[cache_address][0] if cache_address else None
        if cache_address and state != "active_allocated":
            block_frames = [_region_frame(*names[cache_address])]
        blocks.append({"address": ptr, "size": size, "requested_size": wanted,
                       "state": state, "frames": block_frames, "region": region_id})
        total += size
        if state == "active_allocated":
            allocated += size
        if state != "inactive":
            active += size
            requested += wanted
    return {
        "device": device, "address": address, "total_size": total,
        "allocated_size": allocated, "active_size": active, "requested_size": requested,
        "stream": stream, "segment_type": "large" if total > LARGE_SEGMENT else "small",
        "segment_pool_id": pool_key, "is_expandable": bool(expandable), "frames": frames,
        "blocks": blocks,
    }


def _region_frame(region_id, name):
    label = f"cached by {name}" if region_id is None else \
        f"cached by region {region_id}" + (f" {name}" if name else "")
    return {"filename": "gpupool", "line": 0, "name": label}


def _entry(e):
    seq, action, pool_id, addr, size, stream, time_us, frames = e
    name = ACTIONS[action]
    entry = {"action": name, "device_free" if name == "oom" else "addr": addr, "size": size,
             "stream": stream, "time_us": time_us, "frames": frames}
    return entry


def _settings(pools):
    """allocator_settings: PyTorch's keys where gpupool has the same setting, and gpupool's."""
    return {
        "expandable_segments": any(p.upstream.expandable for p in pools),
        "max_split_size": -1,               # PyTorch's "no limit": gpupool cuts any block
        "garbage_collection_threshold": 0.0,
        "roundup_power2_divisions": {},
        "allocator": "gpupool",
        "GPUPOOL_UPSTREAM": os.environ.get("GPUPOOL_UPSTREAM", ""),
        "GPUPOOL_HARD_LIMIT": os.environ.get("GPUPOOL_HARD_LIMIT", ""),
        "GPUPOOL_SOFT_LIMIT": os.environ.get("GPUPOOL_SOFT_LIMIT", ""),
    }


# The out-of-memory error names the regions holding memory and writes GPUPOOL_OOM_SNAPSHOT
# through these (core/oom.pyx: the core layer imports nothing above it).
oom._set_forensics(dump_snapshot, region._regions_by_cache)
