"""Device memory of a deep MLP training step whose temporaries sit in reference cycles.

The step: a CuPy MLP (8 dense layers of 1024, batch 256, float32, ReLU, softmax cross entropy)
trained with SGD and weight decay, through ``examples/autograd.py``, the tiny autograd that
``examples/train_digits.py`` uses: every node keeps its parents and a backward closure that
refers back to the node, so a step's tape (its activations) is a reference cycle that only the
cyclic garbage collector frees. Backward frees each gradient once it has been passed on, and
the optimizer works unfused, so the step makes many short-lived temporaries besides. PyTorch is
imported first, as in real jobs (its objects are what make a full collection slow).
``--steps`` steps (500; ``--quick``: 60) run in each of six ways, each from a fresh state:

* ``cupy-default``: CuPy's ``MemoryPool``, default garbage collection;
* ``cupy-gc``: the same with ``gc.collect()`` after every step (for at most ``--gc-steps``);
* ``gpupool``: ``gpupool.Pool``, no region, default garbage collection;
* ``gpupool-region``: the same with ``with gpupool.Region(pool=pool):`` around every step;
* ``gpupool-invalidate``: the same with ``Region(pool=pool, on_exit="invalidate")``;
* ``pin-until-step-end``: a reference cache, written here, that reuses a freed block only
  after the step ends (the failure mode: reserved memory becomes the sum of the step's
  allocations instead of its working set).

Reported per way: median ms per step, peak bytes in use and reserved, reserved after step 2
and after the last step, whether reserved stayed flat after step 2 (with ``--batches``: after the
step by which every batch size was seen), and peak reserved over the
working set of the step; the targets for the two region ways; a plot of reserved memory over
the steps. With ``--batches 64,128,256`` each step's batch is drawn from the set instead (one
fixed seed, the same sizes for every way; varying shapes, as a CuPy user's data can have): the
flatness counts from the step after every size has been seen, and the region ways' peak
reserved must not exceed CuPy's pool's. Run::

    python bench/region_memory.py [--json PATH] [--plot PATH] [--quick] [--steps N]
        [--batches 64,128,256]
"""

import gc
import os
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import _common
import numpy as np
from _common import MiB, format_table

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import autograd  # noqa: E402  (examples/autograd.py, shared with examples/train_digits.py)

SCRIPT = "region_memory"
DEPTH, WIDTH, BATCH = 8, 1024, 256
LR, WEIGHT_DECAY, SEED = 0.01, 1e-4, 0
STEPS, QUICK_STEPS = 500, 60
# A full collection with PyTorch loaded takes ~100 ms (docs/design.md): 500 of them would be most
# of the run, and 150 steps already show whether reserved memory stays flat.
GC_STEPS = 150
STEADY_FROM = 3          # steps 1-2 fill the caches: medians and the working set from step 3
WARMUP_STEPS = 2         # on a throwaway pool, so that compiling CuPy's kernels is not timed
RESERVED_TARGET = 1.1    # a region way's peak reserved / working set
TIME_TARGET = 1.0        # a region way's ms/step / cupy-default's
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


# Model -------------------------------------------------------------------------------------

def make_problem(xp, seed=SEED, depth=DEPTH, width=WIDTH, batch=BATCH):
    """A fresh model, one batch of inputs and labels (the same for every way)."""
    rng = np.random.RandomState(seed)
    model = autograd.MLP([width] * (depth + 1), rng, xp)
    x = xp.asarray(rng.standard_normal((batch, width)).astype(np.float32))
    labels = xp.asarray(rng.randint(0, width, size=batch).astype(np.int64))
    return model, x, labels


def train_step(model, x, labels, want_loss=False):
    """Forward, backward and update; the loss as a float if asked (that synchronizes).

    On return nothing of the step is referenced from outside: its tape is cyclic garbage.
    """
    loss = autograd.mean(autograd.softmax_cross_entropy(model(autograd.Tensor(x)), labels))
    loss.backward()                  # drops each gradient once it has been passed on
    autograd.sgd_update(model.parameters(), LR, WEIGHT_DECAY)   # unfused: many temporaries
    return float(loss.data) if want_loss else None


# The pin-until-step-end cache ----------------------------------------------------------------

class _PinnedBlock:
    """Owner of one block lent to CuPy; when CuPy drops it, the block goes to pending."""

    __slots__ = ("cache", "size", "mem")

    def __init__(self, cache, size, mem):
        self.cache, self.size, self.mem = cache, size, mem

    def __del__(self):
        self.cache._returned(self.size, self.mem)


class PinUntilStepEnd:
    """A caching allocator for CuPy that reuses a freed block only after the step ends.

    Blocks come from ``cupy.cuda.memory.Memory`` (``cudaMalloc``) and are never given back
    while the cache is open. A block CuPy frees during a step is pending; ``end_step()`` makes
    the pending blocks reusable. So within a step no block is used twice, and the memory
    reserved is the sum of the step's allocations, not its working set.

    Parameters
    ----------
    cupy : module
        CuPy (or a stand-in with ``cuda.MemoryPointer``, ``cuda.UnownedMemory`` and
        ``cuda.memory.Memory``).
    device : int
        The device the memory is on (given to ``UnownedMemory``).
    granularity : int
        Requests are rounded up to a multiple of it (bytes), as CuPy's pool does (512).

    Notes
    -----
    ``malloc`` is the allocator (for ``cupy.cuda.using_allocator``). Counters, bytes:
    ``reserved_bytes`` (raw allocations held), ``in_use_bytes`` (lent and not yet freed by
    CuPy), ``pending_bytes``, ``peak_in_use_bytes`` (since ``reset_peak()``). One stream only:
    a block is reused on the stream it was used on, after the step synchronized.
    """

    def __init__(self, cupy, device=0, granularity=512):
        self._pointer = cupy.cuda.MemoryPointer
        self._unowned = cupy.cuda.UnownedMemory
        self._raw = cupy.cuda.memory.Memory
        self.device = device
        self.granularity = granularity
        self._free = {}              # size -> [Memory]
        self._pending = []           # [(size, Memory)] freed during the current step
        self._closed = False
        self.reserved_bytes = 0
        self.lent_bytes = 0          # cumulative; written by malloc only
        self.returned_bytes = 0      # cumulative; written by _returned only (a __del__)
        self.peak_in_use_bytes = 0
        self.hits = self.misses = 0

    @property
    def in_use_bytes(self):
        return self.lent_bytes - self.returned_bytes

    @property
    def pending_bytes(self):
        return sum(size for size, _ in self._pending)

    def malloc(self, nbytes):
        """A ``cupy.cuda.MemoryPointer`` to ``nbytes`` of device memory."""
        if nbytes == 0:
            return self._pointer(self._raw(0), 0)
        size = -(-nbytes // self.granularity) * self.granularity
        blocks = self._free.get(size)
        if blocks:
            mem = blocks.pop()
            self.hits += 1
        else:
            mem = self._raw(size)
            self.reserved_bytes += size
            self.misses += 1
        self.lent_bytes += size
        if self.in_use_bytes > self.peak_in_use_bytes:
            self.peak_in_use_bytes = self.in_use_bytes
        owner = _PinnedBlock(self, size, mem)
        return self._pointer(self._unowned(mem.ptr, nbytes, owner, self.device), 0)

    def _returned(self, size, mem):
        self.returned_bytes += size
        if self._closed:
            self.reserved_bytes -= size        # mem is dropped: cudaFree
        else:
            self._pending.append((size, mem))

    def end_step(self):
        """The step is over (its stream synchronized): pending blocks become reusable."""
        pending, self._pending = self._pending, []
        for size, mem in pending:
            self._free.setdefault(size, []).append(mem)

    def reset_peak(self):
        self.peak_in_use_bytes = self.in_use_bytes

    def close(self):
        """Give every block not lent back to the driver; lent ones go when CuPy frees them."""
        self._closed = True
        self.end_step()
        for blocks in self._free.values():
            self.reserved_bytes -= sum(mem.size for mem in blocks)
        self._free.clear()


# The six ways ------------------------------------------------------------------------------

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


# Running -----------------------------------------------------------------------------------

def batch_sizes(steps, batches=None, seed=SEED):
    """The batch of each step: ``BATCH`` for every step, or drawn from ``batches`` (fixed
    seed, the same for every way)."""
    if not batches:
        return [BATCH] * steps
    return [int(b) for b in np.random.default_rng(seed).choice(batches, size=steps)]


def all_seen_step(sizes):
    """The 1-based step after which every batch size has been seen once."""
    seen = set()
    for step, size in enumerate(sizes, 1):
        seen.add(size)
        if len(seen) == len(set(sizes)):
            return step
    return len(sizes)


def train(cp, way, steps, batches=None):
    """``steps`` training steps of a fresh model, every allocation served by ``way``; with
    ``batches``, step ``k`` trains on the first ``batch_sizes(steps, batches)[k]`` rows.

    Returns ``(per_step, losses)``: lists per column of :data:`COLUMNS`, and the loss at the
    first and the last step. A step's time runs from before its forward to after
    ``after_step`` (the way's collection, if any) and a synchronization of the stream.
    """
    per_step = {column: [] for column in COLUMNS}
    losses = {}
    sizes = batch_sizes(steps, batches)
    stream = cp.cuda.get_current_stream()
    with cp.cuda.using_allocator(way.allocator):
        model, x, labels = make_problem(cp, batch=max(sizes))
        stream.synchronize()
        for step in range(1, steps + 1):
            way.before_step()
            start = time.perf_counter()
            b = sizes[step - 1]
            with way.scope:
                loss = train_step(model, x[:b], labels[:b], want_loss=step in (1, steps))
            way.after_step()
            stream.synchronize()
            per_step["ms"].append(1e3 * (time.perf_counter() - start))
            sample = way.sample()
            for column in COLUMNS[1:]:
                per_step[column].append(getattr(sample, column))
            if loss is not None:
                losses[str(step)] = loss
    return per_step, losses


def run_way(name, cp, steps, batches=None):
    """One way from a fresh state: its record for the JSON (or an error)."""
    gc.collect()
    start = time.perf_counter()
    record = {"label": WAYS[name]}
    try:
        way = make_way(name, cp)
    except Exception as exc:  # a way that cannot start is reported, the others go on
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["seconds"] = time.perf_counter() - start
        return record
    record["peak_measured"] = way.peak_measured
    try:
        record["per_step"], record["losses"] = train(cp, way, steps, batches)
    except Exception as exc:  # a failed way is reported, the others go on
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["counters"] = way.counters()
    gc.collect()                 # what the default collector left, so close() frees it all
    way.close()
    record["seconds"] = time.perf_counter() - start
    return record


def warm_up(cp):
    """A few steps on a throwaway CuPy pool: compiles CuPy's kernels outside every way."""
    start = time.perf_counter()
    way = make_way("cupy-default", cp)
    train(cp, way, WARMUP_STEPS)
    gc.collect()
    way.close()
    return time.perf_counter() - start


# Summaries and targets ---------------------------------------------------------------------

def _steady(values):
    return values[STEADY_FROM - 1:] or values


def working_set(ways, varying=False):
    """The working set of the step, from the first region way that ran (None if none did).

    The pool's peak bytes in use within a steady step: what was alive at the step's start
    (parameters, data) plus the step's own peak (``region.stats().peak_in_use_bytes``).
    Medians over the steps from :data:`STEADY_FROM`; with varying batches (``varying``), the
    largest step's.
    """
    pick = max if varying else statistics.median_low
    for name in REGION_WAYS:
        per_step = ways.get(name, {}).get("per_step")
        if per_step:
            return {"bytes": pick(_steady(per_step["peak_in_use"])),
                    "at_start_bytes": pick(_steady(per_step["in_use_at_start"])),
                    "step_peak_bytes": pick(_steady(per_step["region_peak"])),
                    "from": name}
    return None


def summarize(record, ws_bytes, flat_from=2):
    """Per-way figures of the table from its per-step record; flatness counts from step
    ``flat_from`` (the step after which every batch size was seen)."""
    p = record["per_step"]
    reserved = p["reserved"]
    peaks = p["peak_in_use"] if record["peak_measured"] else p["in_use"]
    peak_reserved = max(p["peak_reserved"])
    summary = {
        "steps": len(p["ms"]),
        "ms_median": statistics.median(_steady(p["ms"])),
        "ms_min": min(_steady(p["ms"])),
        "ms_max": max(_steady(p["ms"])),
        "peak_in_use": max(peaks),
        "peak_in_use_sampled": not record["peak_measured"],
        "peak_reserved": peak_reserved,
        "reserved_step2": reserved[1] if len(reserved) >= 2 else None,
        "reserved_last": reserved[-1],
        "flat_from": flat_from,         # reserved is flat after this step (1-based)
        "flat": None,
        "growth": None,
        "peak_reserved_over_working_set": peak_reserved / ws_bytes if ws_bytes else None,
    }
    if len(reserved) >= flat_from:
        k = flat_from - 1
        summary["flat"] = all(r == reserved[k] for r in reserved[k:])
        summary["growth"] = max(reserved[k:]) - reserved[k]
    return summary


def targets(summaries, ws_bytes):
    """The issue's targets for the region ways: value, limit, ok."""
    checks = []
    base = summaries.get("cupy-default")
    for name in REGION_WAYS:
        s = summaries.get(name)
        if s is None:
            continue
        checks.append({"way": name, "target": f"reserved flat after step {s['flat_from']}",
                       "value": s["growth"], "limit": 0,
                       "ok": bool(s["flat"])})
        if ws_bytes:
            ratio = s["peak_reserved"] / ws_bytes
            checks.append({"way": name,
                           "target": f"peak reserved <= {RESERVED_TARGET}x working set",
                           "value": ratio, "limit": RESERVED_TARGET, "over": ws_bytes,
                           "ok": ratio <= RESERVED_TARGET})
        if base is not None:
            ratio = s["ms_median"] / base["ms_median"]
            checks.append({"way": name, "target": "ms/step <= cupy-default's",
                           "value": ratio, "limit": TIME_TARGET, "ok": ratio <= TIME_TARGET})
            ratio = s["peak_reserved"] / base["peak_reserved"]
            checks.append({"way": name, "target": "peak reserved <= cupy-default's",
                           "value": ratio, "limit": 1.0, "over": base["peak_reserved"],
                           "ok": ratio <= 1.0})
    return checks


# Report ------------------------------------------------------------------------------------

def _mib(nbytes):
    return "-" if nbytes is None else f"{nbytes / MiB:,.1f}"


def _flat(s):
    if s["flat"] is None:
        return "-"
    return "yes" if s["flat"] else f"no (+{_mib(s['growth'])})"


def _batch_text(out):
    """'batch 256', or 'batch drawn from 64,128,256' with varying batches."""
    if out.get("batches"):
        return "batch drawn from " + ",".join(str(b) for b in out["batches"])
    return f"batch {out['model']['batch']}"


def table(out):
    """The per-way table."""
    headers = ["way", "steps", "ms/step", "peak in use", "peak reserved", "reserved @2",
               "reserved @last", "flat after 2?", "peak res / WS"]
    rows = []
    for name, s in out["summaries"].items():
        ratio = s["peak_reserved_over_working_set"]
        rows.append([name, str(s["steps"]), f"{s['ms_median']:.3f}",
                     _mib(s["peak_in_use"]) + ("*" if s["peak_in_use_sampled"] else ""),
                     _mib(s["peak_reserved"]), _mib(s["reserved_step2"]),
                     _mib(s["reserved_last"]), _flat(s),
                     "-" if ratio is None else f"{ratio:.2f}x"])
    m = out["model"]
    title = (f"{m['depth']} x {m['width']} MLP, {_batch_text(out)}, float32; bytes in MiB; "
             f"ms/step: median of steps {STEADY_FROM} to the last; WS = working set")
    return format_table(headers, rows, title)


def targets_text(out):
    lines = ["targets:"]
    for t in out["targets"]:
        if t["target"].startswith("reserved flat"):
            value = "flat" if t["ok"] else f"+{_mib(t['value'])} MiB"
        elif t["target"].startswith("ms/step"):
            value = (f"{t['value']:.2f}x ({out['summaries'][t['way']]['ms_median']:.3f} vs "
                     f"{out['summaries']['cupy-default']['ms_median']:.3f} ms)")
        else:
            value = f"{t['value']:.2f}x ({_mib(out['summaries'][t['way']]['peak_reserved'])} "
            value += f"/ {_mib(t['over'])} MiB)"
        lines.append(f"  [{'ok' if t['ok'] else 'MISS'}] {t['way']}: {t['target']}: {value}")
    if len(lines) == 1:
        lines.append("  none judged (no region way ran)")
    return "\n".join(lines)


def notes_text(out):
    lines = ["notes:"]
    ws = out["working_set"]
    if ws is not None:
        lines.append(
            f"  working set: {_mib(ws['bytes'])} MiB, the pool's peak in use within a step of "
            f"{ws['from']} (median from step {STEADY_FROM}) = {_mib(ws['at_start_bytes'])} MiB "
            f"alive at the step's start (parameters, data) + {_mib(ws['step_peak_bytes'])} MiB "
            "the step's own peak (region.stats().peak_in_use_bytes)")
    if any(s["peak_in_use_sampled"] for s in out["summaries"].values()):
        lines.append("  * CuPy's pool: used_bytes() sampled at the end of each step, not a true "
                     "peak (its reserved bytes only grow, so their peak is exact)")
    short = {n: s["steps"] for n, s in out["summaries"].items() if s["steps"] < out["steps"]}
    for name, n in short.items():
        lines.append(f"  {name} ran {n} steps, not {out['steps']} (--gc-steps: a full "
                     f"collection per step is slow); its 'reserved @last' is step {n}")
    torch = out["torch"]
    lines.append(f"  PyTorch {torch['version']} imported first" if torch["imported"] else
                 f"  PyTorch not imported ({torch['reason']}): fewer objects for the collector "
                 "to walk, so full collections are cheaper than in a real job")
    lines.append(f"  objects tracked by the garbage collector at the start: "
                 f"{out['gc_tracked_objects']:,}")
    firsts = {name: r["losses"].get("1") for name, r in out["ways"].items() if "losses" in r}
    if firsts and max(firsts.values()) - min(firsts.values()) > 1e-3 * abs(min(firsts.values())):
        lines.append(f"  the loss at step 1 differs between ways: {firsts}")
    for name, record in out["ways"].items():
        if "error" in record:
            lines.append(f"  {name}: error: {record['error']}")
    if out["plot"]:
        lines.append(f"  plot of reserved memory over the steps: {out['plot']}")
    else:
        lines.append(f"  plot skipped: {out['plot_skipped']}")
    return "\n".join(lines)


def legend_text():
    return "\n".join(["ways:", *(f"  {name:19} {label}" for name, label in WAYS.items())])


def report(out):
    parts = [table(out), targets_text(out), notes_text(out), legend_text()]
    return "\n\n".join(parts)


def plot(out, path):
    """Reserved MiB over the steps, every way, into a PNG; ``(path, None)`` or
    ``(None, reason)``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import LogFormatter
    except Exception as exc:  # any failure means no plot
        return None, f"matplotlib not importable ({type(exc).__name__}: {exc})"
    styles = ["-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1))]
    fig, ax = plt.subplots(figsize=(10, 5.5))
    for i, (name, record) in enumerate(out["ways"].items()):
        if "per_step" not in record:
            continue
        reserved = [r / MiB for r in record["per_step"]["reserved"]]
        ax.plot(range(1, len(reserved) + 1), reserved, label=name,
                linestyle=styles[i % len(styles)], linewidth=1.6)
    if out["working_set"] is not None:
        ax.axhline(out["working_set"]["bytes"] / MiB, color="grey", linewidth=0.8,
                   linestyle=":", label="working set")
    ax.set_yscale("log")
    for set_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        set_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.set_xlabel("step")
    ax.set_ylabel("reserved after the step (MiB, log scale)")
    m = out["model"]
    ax.set_title(f"region_memory: {m['depth']} x {m['width']} MLP, {_batch_text(out)}, "
                 "tape in reference cycles")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path, None


# Main --------------------------------------------------------------------------------------

def import_torch():
    """Import PyTorch, as a real job would before anything else: a record for the JSON."""
    try:
        import torch
    except Exception as exc:  # missing or broken: the run goes on, and says so
        return {"imported": False, "version": None,
                "reason": " ".join(f"{type(exc).__name__}: {exc}".split())}
    return {"imported": True, "version": torch.__version__, "reason": None}


def _skip_without(reason, json_path):
    """One line, a JSON record with the environment, exit status 0."""
    print(f"{SCRIPT}: skipped: {reason}")
    if json_path:
        _common.write_json(json_path, {"script": SCRIPT, "skipped": reason,
                                       "env": _common.environment()})
    return 0


def default_plot_path(json_path):
    folder = os.path.dirname(os.path.abspath(json_path)) if json_path else os.getcwd()
    return os.path.join(folder, f"{SCRIPT}.png")


def main(argv=None):
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int,
                   help=f"training steps per way (default {STEPS}; --quick: {QUICK_STEPS})")
    p.add_argument("--gc-steps", type=int, default=GC_STEPS,
                   help=f"at most this many steps for cupy-gc (default {GC_STEPS})")
    p.add_argument("--batches", metavar="N,N,...",
                   help="draw each step's batch from these sizes (varying shapes)")
    p.add_argument("--plot", metavar="PATH",
                   help=f"PNG of reserved memory over the steps (default: {SCRIPT}.png beside "
                        "--json, else in the current folder)")
    args = p.parse_args(argv)
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    try:
        batches = [int(b) for b in args.batches.split(",")] if args.batches else None
    except ValueError:
        p.error(f"--batches must be comma-separated ints, got {args.batches!r}")
    if batches and min(batches) < 1:
        p.error("--batches must be positive")
    if steps < STEADY_FROM or args.gc_steps < STEADY_FROM:
        p.error(f"--steps and --gc-steps must be at least {STEADY_FROM}")
    if args.simulated:
        return _skip_without("it trains a CuPy model on the GPU; --simulated has none",
                             args.json)
    _, reason = _common.gpu_pool()
    if reason is not None:
        _common.skip(SCRIPT, reason, args.json)
    torch = import_torch()
    cp, reason = _common.optional_import("cupy")
    if cp is None:
        return _skip_without(f"needs CuPy ({' '.join(reason.split())})", args.json)
    cp.cuda.Device(0).use()
    start = time.perf_counter()
    out = {"script": SCRIPT, "unit": {"bytes": "bytes", "ms": "ms per step"},
           "model": {"depth": DEPTH, "width": WIDTH, "batch": BATCH, "dtype": "float32",
                     "lr": LR, "weight_decay": WEIGHT_DECAY, "seed": SEED},
           "steps": steps, "gc_steps": min(steps, args.gc_steps), "steady_from": STEADY_FROM,
           "batches": batches,
           "quick": args.quick, "torch": torch, "gc_tracked_objects": len(gc.get_objects()),
           "gc_thresholds": gc.get_threshold(), "env": _common.environment()}
    print(f"  warm-up ({WARMUP_STEPS} steps, throwaway CuPy pool): {warm_up(cp):.1f} s",
          file=sys.stderr)
    out["ways"] = {}
    for name in WAYS:
        n = out["gc_steps"] if name == "cupy-gc" else steps
        record = out["ways"][name] = run_way(name, cp, n, batches)
        last = record["per_step"]["reserved"][-1] if "per_step" in record else None
        print(f"  {name}: {n} steps, {record['seconds']:.1f} s, reserved at the end "
              f"{_mib(last)} MiB" + (f"; error: {record['error']}" if "error" in record else ""),
              file=sys.stderr, flush=True)
    out["working_set"] = working_set(out["ways"], varying=bool(batches))
    ws_bytes = None if out["working_set"] is None else out["working_set"]["bytes"]
    flat_from = max(2, all_seen_step(batch_sizes(steps, batches)) + 1) if batches else 2
    out["summaries"] = {name: summarize(r, ws_bytes, flat_from)
                        for name, r in out["ways"].items()
                        if "per_step" in r}
    out["targets"] = targets(out["summaries"], ws_bytes)
    out["plot"], out["plot_skipped"] = plot(out, args.plot or default_plot_path(args.json))
    return _common.finish(out, start, report, args.json)


if __name__ == "__main__":
    sys.exit(main())
