"""Allocate + free throughput of gpupool and its peers from 1, 2, 4 and 8 Python threads.

Each thread allocates and at once frees blocks of a mix of sizes (256 B to 16 MiB, in turn) on
its own non-blocking stream; the result is allocate + free pairs per second of all threads
together (median of the repetitions), and how it scales with the threads. Run::

    python bench/threads.py [--json PATH] [--quick] [--simulated] [--columns gp,gp.capi,...]

gpupool's Python API holds the GIL except while it waits for the pool's mutex, so its Python
threads take turns; the ``gp.capi`` column runs the same pairs through the C API in a C loop
without the GIL (a helper compiled at run time; skipped if that fails), and ``gp.capi.pts``
on each thread's per-thread default stream instead of a created one; ``cpu`` is a C loop that
shares nothing, the ceiling of what the machine's cores give any column. Columns whose
framework is missing (CuPy, PyTorch) are skipped and say why.
"""

import functools
import os
import statistics
import sys
import threading
import time
from itertools import cycle, islice

import _cext
import _common
import _peers
from _common import Cell, KiB, MiB, format_size, format_table, measure_rounds
from _peers import Column, Made, Skip, async_pair

SCRIPT = "threads"
HERE = os.path.dirname(os.path.abspath(__file__))
THREADS = [1, 2, 4, 8]
SIZES = [256, 4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB]   # each thread cycles through these
# Per thread: batches of about 40 ms from a probe of 500 pairs (at most 200,000 pairs).
PLAN = {"ops": 200_000, "target_ns": 40_000_000, "min_ops": 500}
QUICK_PLAN = {"ops": 200}
REPS, QUICK_REPS = 12, 3
BARRIER_TIMEOUT_S = 120


class Team:
    """``count`` worker threads that each run one batch per :meth:`batch` call, together.

    Parameters
    ----------
    count : int
        Threads.
    work_for : callable
        ``work_for(i)`` runs once on worker ``i``'s own thread, first (for per-thread set-up:
        a current stream or context), and returns ``work(ops)``, that thread's batch.
    """

    def __init__(self, count, work_for):
        self.count = count
        self._start = threading.Barrier(count + 1)
        self._end = threading.Barrier(count + 1)
        self._ops, self._errors = 0, []
        self._results = [None] * count
        self.loop_rates = []            # per batch: pairs per second inside the C loops
        self.own_rates = []             # per batch: the sum of each thread's own loop's rate
        self._threads = [threading.Thread(target=self._main, args=(i, work_for), daemon=True,
                                          name=f"bench-{count}-{i}") for i in range(count)]
        for thread in self._threads:
            thread.start()

    def _main(self, i, work_for):
        try:
            work, failure = work_for(i), None
        except Exception as exc:  # reported by every batch
            work, failure = None, exc
        try:
            while True:
                self._start.wait()
                if self._ops is None:
                    return
                try:
                    if failure is not None:
                        raise failure
                    self._results[i] = work(self._ops)
                except Exception as exc:  # reported by batch() on the main thread
                    self._errors.append(exc)
                self._end.wait()
        except threading.BrokenBarrierError:    # batch() timed out: the team is finished
            return

    def batch(self, ops):
        """Run ``ops`` pairs on every thread; return when all are done.

        Raises the first exception a thread raised, or ``threading.BrokenBarrierError`` when
        the threads took more than BARRIER_TIMEOUT_S.
        """
        self._ops = ops
        self._start.wait(BARRIER_TIMEOUT_S)
        self._end.wait(BARRIER_TIMEOUT_S)
        if self._errors:
            raise self._errors[0]
        spans = self._results           # loop_span's (start, end) of each thread, if timed so
        if all(isinstance(v, tuple) for v in spans):
            elapsed = max(end for _, end in spans) - min(start for start, _ in spans)
            if elapsed > 0 and all(end > start for start, end in spans):
                self.loop_rates.append(self.count * ops * 1e9 / elapsed)
                self.own_rates.append(sum(ops * 1e9 / (end - start) for start, end in spans))

    def close(self):
        """Stop and join the threads (after a timed-out batch, leave them: they are daemons)."""
        self._ops = None
        try:
            self._start.wait(BARRIER_TIMEOUT_S)
        except threading.BrokenBarrierError:
            return
        for thread in self._threads:
            thread.join()


# Columns: ``make(ctx)`` returns a Made whose ``loop`` is a Team's ``work_for``: ``loop(i)`` ->
# ``work(ops)``, called on thread i.


def _python_loop(alloc):
    """``work(ops)``: ``buf = alloc(n); del buf`` for ``ops`` sizes taken in turn from SIZES."""
    def work(ops):
        for n in islice(cycle(SIZES), ops):
            buf = alloc(n)
            del buf
    return work


def make_gpupool(ctx):
    """``buf = pool.allocate(n, stream); del buf``, the thread's own stream."""
    pool, streams = ctx.new_pool(), ctx.streams(max(THREADS))

    def work_for(i):
        alloc, stream = pool.allocate, streams[i]

        def work(ops):
            for n in islice(cycle(SIZES), ops):
                buf = alloc(n, stream)
                del buf
        return work

    return Made(work_for, pool.trim, pool)


PER_THREAD_STREAM = 2          # CU_STREAM_PER_THREAD: each thread's own default stream


@functools.cache
def _loop_helper():
    """bench/_capi_loop.c, built once for every column that uses it; Skip if it cannot be."""
    try:
        return _cext.build("gpupool_bench_loop", [os.path.join(HERE, "_capi_loop.c")])
    except Exception as exc:  # no compiler, say: the column is skipped
        raise Skip(f"C helper not built: {str(exc).splitlines()[0]}") from exc


def make_gpupool_capi(ctx, per_thread=False):
    """``api->allocate`` + ``api->free`` in a C loop without the GIL, the thread's stream: a
    stream created for it, or (per_thread) its per-thread default stream, whose key needs no
    driver call (a created stream's is looked up with ``cuStreamGetId`` at every call)."""
    pool = ctx.new_pool()
    streams = [PER_THREAD_STREAM] * max(THREADS) if per_thread else ctx.streams(max(THREADS))
    helper = _loop_helper()
    sizes = tuple(SIZES)

    def work_for(i):
        loop, stream = helper.loop_span, streams[i]
        return lambda ops: loop(sizes, ops, 0, stream)

    # The C API allocates from the device's default pool: this column's, set before each of
    # its batches (another C API column sets its own).
    return Made(work_for, pool.trim, pool, before=lambda: ctx.gpupool.set_pool(pool))


def make_gpupool_capi_per_thread(ctx):
    return make_gpupool_capi(ctx, per_thread=True)


def make_driver_key(ctx):
    """``cuStreamIsCapturing`` + ``cuStreamGetId`` on the thread's created stream in a C loop
    without the GIL: the driver's part of a ``gp.capi`` pair (one lookup, at the allocate),
    to see whether it scales with threads."""
    if ctx.simulated:
        raise Skip("needs the driver")
    streams = ctx.streams(max(THREADS))
    helper = _loop_helper()
    helper.key_loop(1, streams[0])                      # finds libcuda, or raises

    def work_for(i):
        ctx.driver()                    # the context is current per thread
        loop, stream = helper.key_loop, streams[i]
        return lambda ops: loop(ops, stream)

    return Made(work_for, lambda: None)


def make_spin(ctx):
    """A C loop without the GIL that shares nothing between threads (``spin_loop``: a
    xorshift chain per pair): what the machine gives each thread, the ceiling of any
    column's scaling."""
    helper = _loop_helper()

    def work_for(i):
        loop = helper.spin_loop
        return lambda ops: loop(ops)

    return Made(work_for, lambda: None)


def make_cupy(ctx):
    """``x = cupy.cuda.alloc(n); del x`` on CuPy's default MemoryPool, the thread's stream
    current (``cupy.cuda.ExternalStream``)."""
    cp, streams = ctx.need("cupy"), ctx.streams(max(THREADS))

    def work_for(i):
        cp.cuda.Device(0).use()
        stream = cp.cuda.ExternalStream(streams[i])
        stream.use()
        return _python_loop(cp.cuda.alloc)

    return Made(work_for, cp.get_default_memory_pool().free_all_blocks)


def make_torch(ctx):
    """``t = torch.empty(n, dtype=torch.uint8, device="cuda"); del t`` (caching allocator),
    the thread's stream current (``torch.cuda.ExternalStream``, ``torch.cuda.set_stream``)."""
    torch, streams = ctx.need("torch"), ctx.streams(max(THREADS))
    if not torch.cuda.is_available():
        raise Skip("torch.cuda.is_available() is False")

    def work_for(i):
        torch.cuda.set_stream(torch.cuda.ExternalStream(streams[i]))
        empty, u8, dev = torch.empty, torch.uint8, torch.device("cuda", 0)
        return _python_loop(lambda n: empty(n, dtype=u8, device=dev))

    return Made(work_for, torch.cuda.empty_cache)


def make_driver_async(ctx):
    """``cuMemAllocAsync`` + ``cuMemFreeAsync`` (cuda.bindings' Python layer), the device's
    default memory pool, the thread's stream."""
    driver, streams = ctx.driver(), ctx.streams(max(THREADS))

    def work_for(i):
        ctx.driver()                    # the context is current per thread
        alloc, free, stream = driver.cuMemAllocAsync, driver.cuMemFreeAsync, streams[i]
        stream = driver.CUstream(stream)

        def work(ops):
            for n in islice(cycle(SIZES), ops):
                async_pair(alloc, free, n, stream)
        return work

    return Made(work_for, driver.cuCtxSynchronize)


COLUMNS = [
    Column("gp", "gpupool pool.allocate(n, stream) + del (Python API)", make_gpupool),
    Column("gp.capi", "gpupool C API allocate + free, C loop without the GIL",
           make_gpupool_capi),
    Column("gp.capi.pts", "the same on each thread's per-thread default stream",
           make_gpupool_capi_per_thread),
    Column("drv.key", "cuStreamIsCapturing + cuStreamGetId: gp.capi's driver calls per pair",
           make_driver_key),
    Column("cpu", "a C loop sharing nothing (xorshift chain): the machine's ceiling",
           make_spin),
    Column("cp.alloc", "cupy.cuda.alloc, CuPy MemoryPool", make_cupy),
    Column("torch", "torch.empty uint8 + del, caching allocator", make_torch),
    Column("drv.async", "cuMemAllocAsync + cuMemFreeAsync (Python layer)", make_driver_async),
]


# Running ---------------------------------------------------------------------------------

def run(columns, ctx, quick):
    """Make every column, time every (column, threads) cell in interleaved rounds, clean up.

    Returns the result dict: ``columns[key]["results"][str(threads)]`` with ``ops_per_s``
    (pairs per second, all threads together: median, min, max) and ``ns_per_pair`` (per
    thread, median), plus ``skipped`` and ``errors``.
    """
    out = {"columns": {}, "skipped": {}, "errors": {}}
    made = _peers.make_columns({c.key: c.make for c in columns}, ctx, out["skipped"])
    cells, team_of = {}, {}
    plan = QUICK_PLAN if quick else PLAN
    for key in made:
        for count in THREADS:
            team = team_of[key, count] = Team(count, made[key].loop)
            cells[key, count] = Cell(team.batch, before=made[key].before, **plan)
    start = time.perf_counter()
    magazines = {}
    try:
        timings, errors = measure_rounds(cells, reps=QUICK_REPS if quick else REPS)
        # Read while every team's threads are alive (an exited thread's magazine is reaped).
        magazines = {key: magazine_summary(m.pool) for key, m in made.items()
                     if hasattr(m.pool, "_magazines_info")}
    finally:
        for team in team_of.values():
            team.close()
    print(f"  {len(cells)} cells: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    for column in columns:
        if column.key not in made:
            continue
        results = {}
        for count in THREADS:
            t = timings.get((column.key, count))
            if t is not None:
                results[str(count)] = {
                    "ops_per_s": {"median": count * 1e9 / t.median, "min": count * 1e9 / t.max,
                                  "max": count * 1e9 / t.min},
                    "ns_per_pair": t.median, "ops_per_thread": t.ops, "reps": t.reps}
                team = team_of[column.key, count]
                if team.loop_rates:
                    results[str(count)]["loop_ops_per_s"] = statistics.median(
                        team.loop_rates[-t.reps:])
                    results[str(count)]["own_ops_per_s"] = statistics.median(
                        team.own_rates[-t.reps:])
        entry = out["columns"][column.key] = {"label": column.label, "results": results}
        if column.key in magazines:
            entry["magazines"] = magazines[column.key]
        _peers.close_column(made[column.key], entry)
    _common.record_errors(errors, out["errors"])
    return out


def magazine_summary(pool):
    """The threads' magazines of ``pool`` (``Pool._magazines_info()``): ``threads``; the
    counts of requests that took the shared path while the thread held blocks, by reason
    (``wanted``, ``no_block``, ``no_credit``, ``no_hand``) or with an ``empty`` magazine;
    of requests and frees that found the magazine's lock held by a sweep of the pool and
    waited for it (``waits``, ``free_waits``: the shared path only if the wait ran out); of
    ``misses`` (no held block and no free block of the size either); and ``sweeps``, the
    pool's sweeps over every magazine by kind (``Pool._sweep_counts()``). These count from
    the magazine's start; its ``allocs`` do not (they are folded into the pool's counters
    whenever those are read), so they are left out."""
    info = pool._magazines_info()
    return {"threads": len(info), **{k: sum(m[k] for m in info) for k in MAGAZINE_COUNTS},
            "sweeps": pool._sweep_counts()}


MAGAZINE_COUNTS = {"no_credit": "short of credit", "no_block": "no held block of the size",
                   "no_hand": "too many C API blocks out", "wanted": "wanted",
                   "empty": "empty magazine", "waits": "waited for a sweep",
                   "free_waits": "frees waited for a sweep", "misses": "missed"}


def magazine_lines(out):
    """Two lines per column with a magazine summary: shares of the pool's allocations by
    reason, and the sweeps."""
    lines = []
    for key, column in out["columns"].items():
        m, c = column.get("magazines"), column.get("pool_counters")
        if not m or not c or not c["num_allocs"]:
            continue
        n = c["num_allocs"]
        lines.append(f"  {key:12} " + ", ".join(f"{m[k] / n:.3%} {label}"
                                                for k, label in MAGAZINE_COUNTS.items()) +
                     f" ({m['threads']} threads' magazines)")
        lines.append(f"  {'':12} sweeps over every magazine: " +
                     ", ".join(f"{k} {v}" for k, v in m["sweeps"].items()))
    return "\n".join(["gpupool's requests that took the shared path, by reason, and those that "
                      "waited, of all its allocations (every thread of every team):",
                      *lines]) if lines else None


# Reporting -------------------------------------------------------------------------------

def _ops(out, key, count, field="median"):
    result = out["columns"].get(key, {}).get("results", {}).get(str(count))
    return None if result is None else result["ops_per_s"][field]


def _mops(value):
    return "-" if value is None else f"{value / 1e6:.2f}"


def _ratio(num, den):
    return "-" if num is None or not den else f"{num / den:.2f}x"


def report(out):
    """The printed tables: pairs per second, spread, scaling, gpupool over each peer."""
    keys = list(out["columns"])
    parts = [
        format_table(["threads", *keys],
                     [[str(c)] + [_mops(_ops(out, k, c)) for k in keys] for c in THREADS],
                     "million allocate + free pairs per second, all threads together, median"),
        format_table(["threads", *keys],
                     [[str(c)] + [f"{_mops(_ops(out, k, c, 'min'))}-{_mops(_ops(out, k, c, 'max'))}"
                                  if _ops(out, k, c) is not None else "-" for k in keys]
                      for c in THREADS],
                     "spread: min-max of the repetitions, million pairs per second"),
        format_table(["threads", *keys],
                     [[str(c)] + [_ratio(_ops(out, k, c), _ops(out, k, 1)) for k in keys]
                      for c in THREADS],
                     "scaling: pairs per second over the same column's with 1 thread"),
    ]
    looped = [k for k in keys if any("loop_ops_per_s" in r for r in
                                     out["columns"][k]["results"].values())]
    if looped:
        def loop_rate(k, c, field):
            r = out["columns"][k]["results"].get(str(c), {}).get(field)
            one = out["columns"][k]["results"].get("1", {}).get(field)
            return "-" if r is None else f"{r / 1e6:.2f} ({_ratio(r, one)})"
        parts.append(format_table(
            ["threads", *looped],
            [[str(c)] + [loop_rate(k, c, "loop_ops_per_s") for k in looped] for c in THREADS],
            "inside the C loops: million pairs per second from the first thread's first pair to "
            "the last one's last, median (scaling over 1 thread); the tables above also count "
            "the threads' start and end at the barriers"))
        parts.append(format_table(
            ["threads", *looped],
            [[str(c)] + [loop_rate(k, c, "own_ops_per_s") for k in looped] for c in THREADS],
            "each thread's own loop: the sum of each thread's pairs per second over its own "
            "loop's time, median (scaling over 1 thread). Below the thread count: each "
            "thread's pairs were slower (contention, or cores shared); above the table before: "
            "the threads' loops did not all run at once (staggered starts, too few cores)"))
    peers = [k for k in keys if k != "gp"]
    if "gp" in keys and peers:
        parts.append(format_table(
            ["threads", *peers],
            [[str(c)] + [_ratio(_ops(out, "gp", c), _ops(out, k, c)) for k in peers]
             for c in THREADS],
            "gpupool (gp) pairs per second / peer's: above 1 = gpupool faster"))
    legend = [f"each thread: allocate + free of {', '.join(format_size(n) for n in SIZES)} in "
              "turn, on its own non-blocking stream (gp.capi.pts: its per-thread default "
              "stream); the GIL is released only by gp.capi's C "
              "loop, by gpupool while it waits for its mutex, and by whatever a peer releases",
              "", "columns:"]
    legend += [f"  {k:12} {c['label']}" for k, c in out["columns"].items()]
    legend += _common.problem_lines(out, 10, lambda n: f"with {n} threads")
    parts += [p for p in (_common.cache_lines(out), magazine_lines(out), "\n".join(legend)) if p]
    return "\n\n".join(parts)


def main(argv=None):
    p = _common.parser(__doc__.splitlines()[0], columns=[c.key for c in COLUMNS])
    args = p.parse_args(argv)
    columns = _peers.chosen_columns(p, args.columns, COLUMNS)
    ctx = _peers.context_or_skip(SCRIPT, args, frameworks=("cupy", "torch"))
    start = time.perf_counter()
    out = {"script": SCRIPT, "unit": "allocate+free pairs per second, all threads",
           "threads": THREADS, "sizes": SIZES, "simulated": args.simulated,
           "quick": args.quick, "env": _common.environment()}
    out.update(run(columns, ctx, args.quick))
    return _common.finish(out, start, report, args.json)


if __name__ == "__main__":
    sys.exit(main())
