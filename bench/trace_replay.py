"""Replay allocation traces through gpupool and its peers: peak reserved memory against the
trace's peak live bytes, and the time a replay takes.

The traces are ``bench/data/traces/*.npz`` (recorded from PyTorch training steps on the GPU by
``bench/record_trace.py``; see ``alloc_trace.py`` for the format); when there are none the
script says so and replays a synthetic training-like trace instead. Run::

    python bench/trace_replay.py [--json PATH] [--quick] [--simulated] [--trace FILE ...]
                                 [--trace-dir DIR] [--synthetic] [--columns gp,torch,...]

Every replay starts from a fresh allocator (a new pool, or the framework's cache emptied and
its peak counters reset) and ends by dropping what is still live and giving the memory back,
outside the timing. Columns whose framework is missing are skipped and say why.
"""

import sys
import time

import _common
import alloc_trace
from _common import Cell, MiB, format_ns, format_table, measure_rounds
from _peers import DriverError, Skip, check, context_or_skip, make_columns

SCRIPT = "trace_replay"
REPS, QUICK_REPS = 7, 2


def replay(events, alloc, free=None):
    """Run a trace's events through an allocator; return what is still live.

    Parameters
    ----------
    events : list of (op, id, nbytes, stream)
        From :meth:`alloc_trace.Trace.events`, streams already in the allocator's form.
    alloc : callable
        ``alloc(nbytes, stream)`` -> a handle (a buffer, a pointer).
    free : callable, optional
        ``free(handle, stream)``; None when dropping the last reference frees (gpupool,
        CuPy, PyTorch).

    Returns
    -------
    dict of id -> handle
        The allocations the trace never freed.
    """
    live = {}
    if free is None:
        for op, i, n, s in events:
            if op:
                del live[i]
            else:
                live[i] = alloc(n, s)
    else:
        for op, i, n, s in events:
            if op:
                free(live.pop(i), s)
            else:
                live[i] = alloc(n, s)
    return live


# Allocators ------------------------------------------------------------------------------
#
# Each has: ``streams(count)`` (what the trace's stream indices become), ``reset()`` (a fresh
# state, before a replay), ``alloc`` and ``free`` (for :func:`replay`), ``peaks()`` (peak
# reserved bytes and peak in-use bytes or None, after a replay) and ``release(live)`` (drop
# the leftovers and give every byte back).

class _Switching:
    """``alloc(n, stream)`` for frameworks that allocate on their current stream: makes
    ``stream`` current (``use(stream)``) when it is not already, then ``malloc(n)``."""

    def __init__(self, use):
        self._use, self._current, self.malloc = use, None, None

    def alloc(self, n, stream):
        if stream is not self._current:
            self._use(stream)
            self._current = stream
        return self.malloc(n)

    def forget_stream(self):
        self._current = None


def _handles(ctx, count):
    """Stream handles for indices ``0..count-1``: 0 (legacy default), then new streams."""
    return [0, *ctx.streams(count - 1)] if count > 1 else [0]


class GpupoolReplay:
    """``pool.allocate(n, stream)``, dropped to free; a new ``gpupool.Pool`` per replay."""

    free = None

    def __init__(self, ctx):
        self.ctx, self.pool, self.alloc = ctx, None, None

    def streams(self, count):
        return _handles(self.ctx, count)

    def reset(self):
        self.pool = self.ctx.new_pool()
        self.alloc = self.pool.allocate

    def peaks(self):
        stats = self.pool.stats()
        return stats.peak_reserved_bytes, stats.peak_in_use_bytes

    def release(self, live):
        live.clear()
        self.pool.trim()
        self.pool = self.alloc = None


class CupyPoolReplay(_Switching):
    """``MemoryPool.malloc(n)`` with the stream current; a new ``cupy.cuda.MemoryPool`` per
    replay. It gives no memory back before ``free_all_blocks`` (or an out-of-memory retry),
    so its ``total_bytes()`` after the replay is its peak reserved."""

    free = None

    def __init__(self, ctx):
        self.cp = ctx.need("cupy")
        super().__init__(lambda s: s.use())
        self.ctx, self.mempool = ctx, None

    def streams(self, count):
        cuda = self.cp.cuda
        return [cuda.Stream.null if h == 0 else cuda.ExternalStream(h)
                for h in _handles(self.ctx, count)]

    def reset(self):
        self.forget_stream()
        self.mempool = self.cp.cuda.MemoryPool()
        self.malloc = self.mempool.malloc

    def peaks(self):
        return self.mempool.total_bytes(), None

    def release(self, live):
        live.clear()
        self.cp.cuda.Stream.null.use()
        self.mempool.free_all_blocks()
        self.mempool = self.malloc = None


class _DevicePool:
    """The device's current driver memory pool (``cuDeviceGetMemPool``): trim and reset its
    high-water marks before a replay, read them after (``cuMemPoolGetAttribute``)."""

    def __init__(self, ctx):
        self.driver = driver = ctx.driver()
        dev = check(driver.cuDeviceGet(0), "cuDeviceGet")
        self.handle = check(driver.cuDeviceGetMemPool(dev), "cuDeviceGetMemPool")
        attr = driver.CUmemPool_attribute
        self.reserved_high = attr.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH
        self.used_high = attr.CU_MEMPOOL_ATTR_USED_MEM_HIGH

    def reset(self):
        d = self.driver
        check(d.cuCtxSynchronize(), "cuCtxSynchronize")
        check(d.cuMemPoolTrimTo(self.handle, 0), "cuMemPoolTrimTo")
        for attr in (self.reserved_high, self.used_high):
            check(d.cuMemPoolSetAttribute(self.handle, attr, d.cuuint64_t(0)),
                  "cuMemPoolSetAttribute")

    def peaks(self):
        d = self.driver
        return tuple(int(check(d.cuMemPoolGetAttribute(self.handle, attr),
                               "cuMemPoolGetAttribute"))
                     for attr in (self.reserved_high, self.used_high))

    def trim(self):
        check(self.driver.cuCtxSynchronize(), "cuCtxSynchronize")
        check(self.driver.cuMemPoolTrimTo(self.handle, 0), "cuMemPoolTrimTo")


class CupyAsyncReplay(CupyPoolReplay):
    """``MemoryAsyncPool.malloc(n)`` (``cudaMallocAsync`` on the device's current pool) with
    the stream current; peaks from the driver pool's high-water marks."""

    def __init__(self, ctx):
        super().__init__(ctx)
        try:
            self.apool = self.cp.cuda.MemoryAsyncPool()
            self.apool.malloc(256)
            self.device_pool = _DevicePool(ctx)
        except Skip:
            raise
        except Exception as exc:  # unsupported here: skip the column
            raise Skip(f"MemoryAsyncPool unusable: {type(exc).__name__}: {exc}") from exc

    def reset(self):
        self.forget_stream()
        self.device_pool.reset()
        self.malloc = self.apool.malloc

    def peaks(self):
        return self.device_pool.peaks()

    def release(self, live):
        live.clear()
        self.cp.cuda.Stream.null.use()
        self.apool.free_all_blocks()
        self.device_pool.trim()


class TorchReplay(_Switching):
    """``torch.empty(n, dtype=torch.uint8, device="cuda")`` with the stream current
    (``torch.cuda.set_stream``); ``torch.cuda.empty_cache()`` and
    ``reset_peak_memory_stats()`` before each replay; peaks from ``memory_stats()``
    (``reserved_bytes.all.peak``, ``allocated_bytes.all.peak``)."""

    free = None

    def __init__(self, ctx):
        self.torch = torch = ctx.need("torch")
        if not torch.cuda.is_available():
            raise Skip("torch.cuda.is_available() is False")
        empty, u8, dev = torch.empty, torch.uint8, torch.device("cuda", 0)
        super().__init__(torch.cuda.set_stream)
        self.malloc = lambda n: empty(n, dtype=u8, device=dev)
        self.ctx = ctx

    def streams(self, count):
        cuda = self.torch.cuda
        return [cuda.default_stream(0) if h == 0 else cuda.ExternalStream(h)
                for h in _handles(self.ctx, count)]

    def reset(self):
        cuda = self.torch.cuda
        self.forget_stream()
        cuda.synchronize()
        cuda.empty_cache()
        cuda.reset_peak_memory_stats()

    def peaks(self):
        stats = self.torch.cuda.memory_stats()
        return stats["reserved_bytes.all.peak"], stats["allocated_bytes.all.peak"]

    def release(self, live):
        live.clear()
        cuda = self.torch.cuda
        cuda.set_stream(cuda.default_stream(0))
        cuda.synchronize()
        cuda.empty_cache()


class DriverAsyncReplay:
    """``cuMemAllocAsync(n, stream)`` / ``cuMemFreeAsync(ptr, stream)`` through cuda.bindings'
    Python layer, on the device's current memory pool; peaks from its high-water marks."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.device_pool = _DevicePool(ctx)
        d = self.device_pool.driver
        self._alloc, self._free = d.cuMemAllocAsync, d.cuMemFreeAsync

    def streams(self, count):
        return [self.device_pool.driver.CUstream(h) for h in _handles(self.ctx, count)]

    def alloc(self, n, stream):
        err, ptr = self._alloc(n, stream)
        if err:
            raise DriverError(f"cuMemAllocAsync({n}): {err}")
        return ptr

    def free(self, ptr, stream):
        if self._free(ptr, stream)[0]:
            raise DriverError("cuMemFreeAsync failed")

    def reset(self):
        self.device_pool.reset()

    def peaks(self):
        return self.device_pool.peaks()

    def release(self, live):
        d = self.device_pool.driver
        check(d.cuCtxSynchronize(), "cuCtxSynchronize")   # then any stream may free them
        for ptr in live.values():
            self.free(ptr, d.CUstream(0))
        live.clear()
        self.device_pool.trim()


class LoopReplay:
    """The replay loop with the builtin ``max`` as its allocator: its Python overhead."""

    alloc, free = max, None

    def __init__(self, ctx):
        pass

    def streams(self, count):
        return list(range(count))

    def reset(self):
        pass

    def peaks(self):
        return None, None

    def release(self, live):
        live.clear()


COLUMNS = {
    "gp": ("gpupool pool.allocate(n, stream), dropped to free", GpupoolReplay),
    "cp.pool": ("cupy.cuda.MemoryPool().malloc(n), stream current", CupyPoolReplay),
    "cp.async": ("cupy.cuda.MemoryAsyncPool().malloc(n), stream current", CupyAsyncReplay),
    "torch": ("torch.empty(n, uint8), caching allocator, stream current", TorchReplay),
    "drv.async": ("cuMemAllocAsync + cuMemFreeAsync, device's memory pool", DriverAsyncReplay),
}


# Running ---------------------------------------------------------------------------------

class _Cell:
    """One (trace, allocator): the timed replay and the hooks around it."""

    def __init__(self, allocator, trace):
        self.allocator = allocator
        self.events = trace.events(allocator.streams(max(trace.num_streams, 1)))
        self.live, self.peaks = None, []

    def batch(self, _ops):
        a = self.allocator
        self.live = replay(self.events, a.alloc, a.free)

    def after(self):
        self.peaks.append(self.allocator.peaks())
        self.allocator.release(self.live)
        self.live = None


def load_traces(paths, folder, add_synthetic):
    """``(traces, note)``: the traces of ``paths`` (default: every file in ``folder``), the
    synthetic one when asked or when there are none; ``note`` says so (or is None)."""
    paths = paths or alloc_trace.find(folder)
    traces = [alloc_trace.load(p) for p in paths]
    note = None
    if not traces:
        note = (f"no recorded traces in {folder} (record them on a GPU with "
                "bench/record_trace.py --out DIR): replaying the synthetic trace only")
    if add_synthetic or not traces:
        traces.append(alloc_trace.synthetic())
    seen = set()
    for k, trace in enumerate(traces):          # names key the results: make them unique
        if trace.name in seen:
            trace.name = f"{trace.name}.{k}"
        seen.add(trace.name)
    return traces, note


def run(traces, keys, ctx, quick):
    """Replay every trace through every allocator, interleaved rounds; progress to stderr."""
    out = {"traces": {}, "skipped": {}, "errors": {}, "loop_ns": {},
           "reps": QUICK_REPS if quick else REPS}
    allocators = make_columns({key: LoopReplay if key == "loop" else COLUMNS[key][1]
                               for key in ["loop", *keys]}, ctx, out["skipped"])
    cells, timed = {}, {}
    for trace in traces:
        for key, allocator in allocators.items():
            cell = cells[trace.name, key] = _Cell(allocator, trace)
            timed[trace.name, key] = Cell(cell.batch, ops=1, before=allocator.reset,
                                          after=cell.after)
    start = time.perf_counter()
    timings, errors = measure_rounds(timed, reps=out["reps"])
    print(f"  {len(timed)} cells: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    for trace in traces:
        entry = out["traces"][trace.name] = {"summary": trace.summary(), "meta": trace.meta,
                                             "columns": {}}
        peak_live = entry["summary"]["peak_live_bytes"]
        for key in allocators:
            timing = timings.get((trace.name, key))
            if timing is None:
                continue
            if key == "loop":
                out["loop_ns"][trace.name] = timing.median
                continue
            reserved = [r for r, _ in cells[trace.name, key].peaks]
            in_use = [u for _, u in cells[trace.name, key].peaks if u is not None]
            entry["columns"][key] = {
                "time_ns": timing.as_dict(),
                "peak_reserved_bytes": max(reserved),
                "peak_reserved_min_bytes": min(reserved),
                "peak_in_use_bytes": max(in_use) if in_use else None,
                "reserved_over_live": max(reserved) / peak_live if peak_live else None}
    _common.record_errors({(key, name): exc for (name, key), exc in errors.items()},
                          out["errors"])
    return out


# Reporting -------------------------------------------------------------------------------

def _col(out, name, key, field):
    return out["traces"][name]["columns"].get(key, {}).get(field)


def _mib(nbytes):
    return "-" if nbytes is None else f"{nbytes / MiB:,.1f}"


def _ms(timing):
    return "-" if timing is None else f"{timing['median'] / 1e6:,.2f}"


def _x(value):
    return "-" if value is None else f"{value:.2f}x"


def _time_ratio(out, name, key):
    mine, base = _col(out, name, key, "time_ns"), _col(out, name, "gp", "time_ns")
    return None if mine is None or base is None else mine["median"] / base["median"]


def report(out, keys):
    """The printed tables: the traces, peak reserved, reserved / live, times, ratios."""
    names = list(out["traces"])
    keys = [k for k in keys if any(k in out["traces"][n]["columns"] for n in names)]

    def table(title, cell, columns=keys, headers=None):
        return format_table(["trace", *(headers or columns)],
                            [[n] + [cell(n, k) for k in columns] for n in names], title)

    summary = format_table(
        ["trace", "source", "events", "allocs", "streams", "peak live MiB", "allocated MiB",
         "recorded reserved peak MiB"],
        [[n, t["meta"].get("model", t["meta"].get("source", "-")), f"{t['summary']['events']:,}",
          f"{t['summary']['allocations']:,}", str(t["summary"]["streams"]),
          _mib(t["summary"]["peak_live_bytes"]), _mib(t["summary"]["allocated_bytes"]),
          _mib(t["meta"].get("torch_max_memory_reserved"))]
         for n, t in out["traces"].items()], "traces")
    parts = [
        summary,
        table("peak reserved MiB (bytes the allocator held from the driver at its peak)",
              lambda n, k: _mib(_col(out, n, k, "peak_reserved_bytes"))),
        table("peak reserved / peak live bytes of the trace (1.00x: nothing wasted)",
              lambda n, k: _x(_col(out, n, k, "reserved_over_live"))),
        table("peak in use MiB as the allocator counts it (its rounding included)",
              lambda n, k: _mib(_col(out, n, k, "peak_in_use_bytes"))),
        table(f"replay time ms, median of {out['reps']} (host time, a fresh allocator each "
              "replay)",
              lambda n, k: _ms(_col(out, n, k, "time_ns"))),
        table("spread: min-max ms",
              lambda n, k: "-" if _col(out, n, k, "time_ns") is None else
              f"{_col(out, n, k, 'time_ns')['min'] / 1e6:,.2f}-"
              f"{_col(out, n, k, 'time_ns')['max'] / 1e6:,.2f}"),
    ]
    peers = [k for k in keys if k != "gp"]
    if "gp" in keys and peers:
        parts.append(table("peer replay time / gpupool (gp) replay time: above 1 = gpupool "
                           "faster", lambda n, k: _x(_time_ratio(out, n, k)), peers))
    notes = []
    for name in names:
        for key in keys:
            lo = _col(out, name, key, "peak_reserved_min_bytes")
            hi = _col(out, name, key, "peak_reserved_bytes")
            if lo is not None and lo != hi:
                notes.append(f"  {name} {key}: peak reserved varied between replays: "
                             f"{_mib(lo)}-{_mib(hi)} MiB (the larger is shown)")
    notes += [f"  {name}: Python replay loop alone (alloc = builtin max): "
              f"{format_ns(ns / 1e3)} us" for name, ns in out["loop_ns"].items()]
    if out.get("note"):
        notes.insert(0, f"  {out['note']}")
    notes += ["", "columns:"] + [f"  {k:10} {COLUMNS[k][0]}" for k in keys]
    notes += _common.problem_lines(out, 10, lambda name: f"on {name}")
    parts.append("notes:\n" + "\n".join(notes))
    return "\n\n".join(parts)


def main(argv=None):
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--trace", action="append", metavar="FILE",
                   help="a trace file to replay (repeatable; default: every file in "
                        "--trace-dir)")
    p.add_argument("--trace-dir", default=alloc_trace.TRACE_DIR, metavar="DIR",
                   help="folder of recorded traces (default: bench/data/traces)")
    p.add_argument("--synthetic", action="store_true",
                   help="replay the synthetic trace as well")
    p.add_argument("--columns", help=f"comma-separated allocators (default: all: "
                                     f"{','.join(COLUMNS)})")
    args = p.parse_args(argv)
    keys = _common.column_keys(p, args.columns, list(COLUMNS))
    ctx = context_or_skip(SCRIPT, args, frameworks=("cupy", "torch"))
    traces, note = load_traces(args.trace, args.trace_dir, args.synthetic)
    if note:
        print(f"{SCRIPT}: {note}", file=sys.stderr)
    start = time.perf_counter()
    out = {"script": SCRIPT, "simulated": args.simulated, "quick": args.quick, "note": note,
           "env": _common.environment()}
    out.update(run(traces, keys, ctx, args.quick))
    return _common.finish(out, start, lambda o: report(o, keys), args.json)


if __name__ == "__main__":
    sys.exit(main())
