"""Statistics records and the human-readable report (``gpupool.pool_status()``)."""

from dataclasses import asdict, dataclass

__all__ = ["PoolStats", "RegionStats", "format_bytes", "format_status", "torch_memory_stats"]


@dataclass(frozen=True)
class PoolStats:
    """A pool's counters at one moment. Bytes count whole blocks (requests rounded up to 512 B).

    ``in_use_bytes + cached_bytes == reserved_bytes``, where cached bytes are free memory held
    by the pool (free, parked and held blocks) or by any of its regions
    (``pool.trim()`` returns the pool's; ``Region.release()`` hands a region's to the pool).
    ``asleep_bytes``: live blocks of sleeping tags (``Pool.sleep``), in no other count (their
    pages are unmapped); ``offloaded_bytes``: those of them whose contents are kept in host
    memory (a buffer closed while asleep leaves both);
    ``pinned_bytes``: the page-locked host memory the pool holds for offload (sleeping tags'
    and the chunk kept for the next sleep, ``Pool.release_pinned``).
    ``num_allocs == cache_hits + cache_misses`` for non-empty requests: a hit is served from a
    free list (the pool's or a region's); a miss needs new memory: the pool grows from its
    upstream (``upstream_allocs`` counts the upstream calls).
    """

    in_use_bytes: int
    peak_in_use_bytes: int
    reserved_bytes: int
    peak_reserved_bytes: int
    cached_bytes: int
    num_allocs: int
    num_frees: int
    cache_hits: int
    cache_misses: int
    upstream_allocs: int
    upstream_frees: int
    oom_retries: int
    asleep_bytes: int = 0
    offloaded_bytes: int = 0
    pinned_bytes: int = 0

    def as_dict(self):
        """The counters as a plain ``dict``."""
        return asdict(self)

    @classmethod
    def from_counters(cls, c):
        """The view of a pool's counters record (``records/counters.pxd``, as a dict)."""
        return cls(
            in_use_bytes=c["in_use"], peak_in_use_bytes=c["peak_in_use"],
            reserved_bytes=c["reserved"], peak_reserved_bytes=c["peak_reserved"],
            cached_bytes=c["cached"], num_allocs=c["num_allocs"], num_frees=c["num_frees"],
            cache_hits=c["cache_hits"], cache_misses=c["cache_misses"],
            upstream_allocs=c["upstream_allocs"], upstream_frees=c["upstream_frees"],
            oom_retries=c["oom_retries"], asleep_bytes=c.get("asleep", 0),
            offloaded_bytes=c.get("offloaded", 0), pinned_bytes=c.get("pinned", 0))


def torch_memory_stats(c):
    """A pool's counters record (a dict) under the keys of ``torch.cuda.memory_stats()``."""
    return {
        "allocated_bytes.all.current": c["in_use"],
        "allocated_bytes.all.peak": c["peak_in_use"],
        "allocated_bytes.all.allocated": c["allocated_bytes"],
        "allocated_bytes.all.freed": c["freed_bytes"],
        "active_bytes.all.current": c["in_use"],
        "active_bytes.all.peak": c["peak_in_use"],
        "reserved_bytes.all.current": c["reserved"],
        "reserved_bytes.all.peak": c["peak_reserved"],
        "allocation.all.current": c["num_allocs"] - c["num_frees"],
        "allocation.all.allocated": c["num_allocs"],
        "allocation.all.freed": c["num_frees"],
        "segment.all.current": c["upstream_allocs"] - c["upstream_frees"],
        "segment.all.allocated": c["upstream_allocs"],
        "segment.all.freed": c["upstream_frees"],
        "num_alloc_retries": c["oom_retries"],
        "num_ooms": c["num_ooms"],
        "num_device_alloc": c["upstream_allocs"],
        "num_device_free": c["upstream_frees"],
    }


@dataclass(frozen=True)
class RegionStats:
    """A region's counters (``Region.stats()``). Hits and misses are counted as ``PoolStats``
    counts the pool's: a hit is served from free memory, its own cache's or the pool's (a
    region that caches nothing, ``cached_bytes`` 0, still counts hits); a miss needs new
    memory (the pool grows). The fields from ``lane_hits`` on are a planned region's
    (``Region(plan=True)``; 0 and False for a plain region).

    Attributes
    ----------
    entries : int
        Times the region was entered.
    cache_hits : int
        Its allocations (those made while it is current) served from free memory.
    cache_misses : int
        Its allocations that needed new memory.
    cached_bytes : int
        Bytes its cache holds.
    live_at_exit_bytes : int
        Bytes of its buffers alive at the last exit, after the collection (buffers given to
        ``keep`` excluded; buffers that escaped earlier entries and still live included).
    peak_in_use_bytes : int
        Peak bytes in use by the buffers of a step.
    collections : int
        Collections run at exit.
    collect_seconds : float
        Seconds those took, summed.
    lane_hits : int
        Of ``cache_hits``, those its lane served (``scope="thread"``), without the pool's lock.
    shared_entries : int
        Planned entries served the pool's way (no plan, no cache): another thread's region
        took turns with it.
    planned : bool
        Whether it plans (``Region(plan=True)``): the fields below are its plans'.
    plans : int
        Placements computed: steady plans and first-entry transitions.
    planning_ms : float
        Milliseconds spent planning, in all.
    plan_hits : int
        Requests served at their planned place.
    plan_misses : int
        Planned requests that went the online way.
    plans_given_up : int
        Plans given up for serving badly, growing the pool, or needing a transition plan made
        anew at every entry (``region/transitions.py``'s TRANSITIONS_MAX in a row).
    plans_not_fitting : int
        Plans larger than the memory they would take: not used.
    plan_bytes : int
        Bytes of the largest kept plan's range.
    record_plans : int
        Plans made at a record step's request 0 (counted in ``plans``).
    record_ms : float
        Milliseconds those took (counted in ``planning_ms``).
    planning_work : int
        The plans' work in all (``placement.Plan.work``: units of one candidate place).
    plans_past_work : int
        Plans that fell back to first fit past ``budget_work``.
    plans_past_time : int
        Plans that fell back to first fit past ``budget_ms`` (the wall-clock cap).
    plans_past_requests : int
        Plans that fell back to first fit: more planned requests than the greedy takes.
    plans_reused : int
        Plans not made again: one was made before from the same inputs.
    plans_repaired : int
        Kept plans repaired for a step that grew (counted in ``plans``).
    plans_transitions_repaired : int
        Transitions among those (counted in ``plans_repaired``).
    plans_repairs_refused : int
        Repairs made and not used: the step was placed whole instead.
    record_plans_dropped : int
        Record plans not installed (counted in ``record_plans``).
    exits_repeated : int
        Exits whose events were the last exit's: no step made again.
    envelopes_refused : int
        Plans not made because the step's envelope, with room for the sizes that jitter (by
        at most a tenth), reserves more than 1% over the largest step measured: its sizes
        vary each on its own, and its entries go the usual way, as a plain region's (tried
        again every few exits; Notes [Envelopes that no step needs], [Room for jitter]).
    """

    entries: int
    cache_hits: int
    cache_misses: int
    cached_bytes: int
    live_at_exit_bytes: int
    peak_in_use_bytes: int
    collections: int
    collect_seconds: float
    lane_hits: int = 0
    shared_entries: int = 0
    planned: bool = False
    plans: int = 0
    planning_ms: float = 0.0
    plan_hits: int = 0
    plan_misses: int = 0
    plans_given_up: int = 0
    plans_not_fitting: int = 0
    plan_bytes: int = 0
    record_plans: int = 0
    record_ms: float = 0.0
    planning_work: int = 0
    plans_past_work: int = 0
    plans_past_time: int = 0
    plans_past_requests: int = 0
    plans_reused: int = 0
    plans_repaired: int = 0
    plans_transitions_repaired: int = 0
    plans_repairs_refused: int = 0
    record_plans_dropped: int = 0
    exits_repeated: int = 0
    envelopes_refused: int = 0

    def as_dict(self):
        """The counters as a plain ``dict``."""
        return asdict(self)


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(nbytes):
    """``nbytes`` in binary units with three decimals, as in ``1.586 MiB``."""
    value = float(nbytes)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.3f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_status(device_free, device_total, in_use, reserved, simulated=False):
    """The two-line report of ``gpupool.pool_status()``; ``simulated``: the device is the
    simulated one (host memory), which the first line names instead of a GPU."""
    used = device_total - device_free
    share = 100.0 * used / device_total if device_total else 0.0
    device = "Simulated device memory usage" if simulated else "Effective GPU memory usage"
    return (
        f"{device}: {share:.2f}% "
        f"({format_bytes(used)}/{format_bytes(device_total)})\n"
        f"Memory pool usage: {format_bytes(in_use)} ({format_bytes(reserved)} reserved)"
    )


def plan_fields(counts, plans):
    """RegionStats' fields of a planned region, from its Planner's ``counts`` (a dict) and
    ``plans`` (the plans it keeps; ``plan_bytes`` is the largest one's)."""
    return {"planned": True, "plans": counts["plans"], "planning_ms": counts["planning_ms"],
            "plan_hits": counts["hits"], "plan_misses": counts["misses"],
            "plans_given_up": counts["given_up"], "plans_not_fitting": counts["no_room"],
            "plan_bytes": max((p.nbytes for p in plans), default=0),
            "record_plans": counts["records"], "record_ms": counts["record_ms"],
            "planning_work": counts["work"], "plans_past_work": counts["past_work"],
            "plans_past_time": counts["past_time"], "plans_reused": counts["reused"],
            "plans_past_requests": counts["past_requests"], "plans_repaired": counts["repairs"],
            "plans_transitions_repaired": counts["transition_repairs"],
            "plans_repairs_refused": counts["repairs_refused"],
            "record_plans_dropped": counts["records_dropped"],
            "exits_repeated": counts["exits_repeated"],
            "envelopes_refused": counts["envelopes_refused"]}
