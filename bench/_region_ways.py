"""The six ways of bench/region_memory.py to serve a training step's allocations: CuPy's
``MemoryPool`` (with and without ``gc.collect()`` after every step), ``gpupool.Pool`` (without a
region, with a region around every step, with an invalidating one) and the pin-until-step-end
cache; each way's counters after a step (``Sample``)."""

import gc
from contextlib import nullcontext
from dataclasses import dataclass

from _pin_cache import PinUntilStepEnd

REGION_WAYS = ("gpupool-region", "gpupool-invalidate")
WAYS = {
    "cupy-default": "CuPy MemoryPool, default garbage collection",
    "cupy-gc": "CuPy MemoryPool, gc.collect() after every step",
    "gpupool": "gpupool Pool, no region, default garbage collection",
    "gpupool-region": "gpupool, `with Region(pool=pool):` around every step (on_exit='detach')",
    "gpupool-invalidate": "gpupool, `with Region(pool=pool, on_exit='invalidate'):` per step",
    "pin-until-step-end": "a cache reusing a freed block only after the step ends; "
                          "gc.collect(1) at step end, as a region's exit does",
}
# Per step, per way: the columns of the JSON's "per_step" (None where a way cannot tell).
COLUMNS = ("ms", "in_use", "peak_in_use", "reserved", "peak_reserved", "in_use_at_start",
           "region_peak")


@dataclass
class Sample:
    """A way's counters after a step (bytes; None where the way cannot tell)."""

    in_use: int
    peak_in_use: int | None
    reserved: int
    peak_reserved: int
    in_use_at_start: int | None = None
    region_peak: int | None = None


class CupyWay:
    """A fresh CuPy ``MemoryPool``; with ``collect``, ``gc.collect()`` after every step.

    CuPy's pool has no peak counter: bytes in use are sampled at the end of a step only. Its
    reserved bytes only grow (it frees nothing unless asked), so the end of a step gives
    their peak.
    """

    peak_measured = False

    def __init__(self, cp, collect):
        self.pool = cp.cuda.MemoryPool()
        self.allocator = self.pool.malloc
        self.scope = nullcontext()
        self.collect = collect

    def before_step(self):
        pass

    def after_step(self):
        if self.collect:
            gc.collect()

    def sample(self):
        total = self.pool.total_bytes()
        return Sample(self.pool.used_bytes(), None, total, total)

    def counters(self):
        return {"n_free_blocks": self.pool.n_free_blocks()}

    def close(self):
        self.pool.free_all_blocks()


class GpupoolWay:
    """A fresh ``gpupool.Pool(device=0)``; with ``on_exit``, a Region around every step."""

    peak_measured = True

    def __init__(self, on_exit=None):
        import gpupool
        import gpupool.cupy

        self.pool = gpupool.Pool(device=0)
        self.allocator = gpupool.cupy.allocator(self.pool)
        if on_exit is None:
            self.region = None
        elif on_exit == "detach":
            self.region = gpupool.Region(pool=self.pool)      # the default on_exit
        else:
            self.region = gpupool.Region(pool=self.pool, on_exit=on_exit)
        self.scope = nullcontext() if self.region is None else self.region
        self._in_use_at_start = 0

    def before_step(self):
        self.pool.reset_peak_stats()
        if self.region is not None:
            self.region.reset_peak_stats()
        self._in_use_at_start = self.pool.stats().in_use_bytes

    def after_step(self):
        pass

    def sample(self):
        s = self.pool.stats()
        region_peak = None if self.region is None else self.region.stats().peak_in_use_bytes
        return Sample(s.in_use_bytes, s.peak_in_use_bytes, s.reserved_bytes,
                      s.peak_reserved_bytes, self._in_use_at_start, region_peak)

    def counters(self):
        out = {"pool": self.pool.stats().as_dict()}
        if self.region is not None:
            out["region"] = self.region.stats().as_dict()
        return out

    def close(self):
        if self.region is not None:
            self.region.release()
        self.pool.trim()


class PinWay:
    """The pin-until-step-end cache; a young collection, then ``end_step()``, after a step."""

    peak_measured = True

    def __init__(self, cp):
        self.cache = PinUntilStepEnd(cp, device=cp.cuda.runtime.getDevice())
        self.allocator = self.cache.malloc
        self.scope = nullcontext()

    def before_step(self):
        self.cache.reset_peak()

    def after_step(self):
        gc.collect(1)
        self.cache.end_step()

    def sample(self):
        c = self.cache
        return Sample(c.in_use_bytes, c.peak_in_use_bytes, c.reserved_bytes, c.reserved_bytes)

    def counters(self):
        c = self.cache
        return {"hits": c.hits, "misses": c.misses, "reserved_bytes": c.reserved_bytes}

    def close(self):
        self.cache.close()


def make_way(name, cp):
    if name == "cupy-default":
        return CupyWay(cp, collect=False)
    if name == "cupy-gc":
        return CupyWay(cp, collect=True)
    if name == "gpupool":
        return GpupoolWay()
    if name == "gpupool-region":
        return GpupoolWay(on_exit="detach")
    if name == "gpupool-invalidate":
        return GpupoolWay(on_exit="invalidate")
    if name == "pin-until-step-end":
        return PinWay(cp)
    raise ValueError(f"unknown way {name!r}")
