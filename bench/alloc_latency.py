"""Cached allocate + free latency of gpupool against its peers, one stream (legacy default).

For each size, each allocator allocates and immediately frees a block in a loop; the result
is ns per allocate + free pair (median of the repetitions). Run::

    python bench/alloc_latency.py [--json PATH] [--quick] [--columns gp,cp.empty,...]

Columns whose framework is missing (CuPy, PyTorch, Numba) are skipped and say why.
"""

import contextlib
import sys
import time
from dataclasses import dataclass

import _common
import _peers
from _common import Cell, KiB, MiB, format_ns, format_size, format_table, measure_rounds
from _peers import DriverError, Made, Skip, async_pair

SCRIPT = "alloc_latency"
SIZES = [256, 4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB]

# Timed rounds: each runs one batch of every (column, size), in shuffled order.
REPS, QUICK_REPS, QUICK_OPS = 30, 3, 200
# Batch plans (keyword arguments of _common.Cell). Cached allocators: 4000 ops a batch.
# Uncached ones: batches of about 5 ms from a probe. Numba defers its frees in groups of
# 10, so its batches hold at least 20 allocations and end with a flush of them; Numba on
# gpupool runs with the same plan, in the same rounds, for a like-for-like comparison.
CACHED = {"ops": 4000}
UNCACHED = {"ops": 200, "target_ns": 5_000_000, "min_ops": 5}
NUMBA = {"ops": 100, "target_ns": 5_000_000, "min_ops": 20}

GPUPOOL_TARGET_NS = 250        # DESIGN/issue: gpupool Python API cached allocate + free
CUPY_EMPTY_TARGET_RATIO = 1.1  # cupy.empty on gpupool vs on CuPy's pool
PLAN_TARGET_RATIO = 1.0         # issue 33: a planned allocate + free vs the pool's


@dataclass
class Column(_peers.Column):
    """One allocator (``make(ctx)`` returns a :class:`_peers.Made` whose ``loop(n)`` is
    ``batch(ops)`` for size n), its batch plan, and whether it runs with the uncached group."""

    plan: dict

    @property
    def group(self):
        # Uncached allocators free with cuMemFree, which synchronizes the device and makes
        # the driver's async pool give back its memory; they are timed in a round of their
        # own so as not to disturb the cached ones.
        return "cached" if self.plan is CACHED else "uncached"


# gpupool ---------------------------------------------------------------------------------

def make_gpupool(ctx):
    """``buf = pool.allocate(n); del buf``."""
    pool = ctx.new_pool()
    alloc = pool.allocate

    def for_size(n):
        def batch(ops):
            for _ in range(ops):
                buf = alloc(n)
                del buf
        return batch

    return Made(for_size, pool.trim, pool)


def make_gpupool_region(ctx, plan=False):
    """The same loop inside ``with region:`` (entered once per batch), a region per size: a
    training loop's region sees its step again, while the rounds interleave the sizes."""
    pool = ctx.new_pool()
    regions = []
    alloc = pool.allocate

    def for_size(n):
        region = ctx.gpupool.Region(pool, plan=plan)
        regions.append(region)

        def batch(ops):
            with region:
                for _ in range(ops):
                    buf = alloc(n)
                    del buf
        return batch

    def cleanup():
        for region in regions:
            region.release()
        pool.trim()

    def notes():
        """The planned regions' entries, and the exits that repeated the last (no step
        made)."""
        stats = [r.stats() for r in regions]
        return {"entries": sum(s.entries for s in stats),
                "exits_repeated": sum(s.exits_repeated for s in stats)}

    return Made(for_size, cleanup, pool, notes=notes if plan else None)


def make_gpupool_plan(ctx):
    """The same loop inside ``with Region(plan=True):``, a region per size: a batch is one
    entry, a step of its pairs, served at its planned place once its structure has repeated
    (each batch of a size has the same ops); the time includes the entries and exits (the
    exits' bookkeeping: an exit that repeats the last is cheap, gpupool.region.recorded)."""
    return make_gpupool_region(ctx, plan=True)


# CuPy ------------------------------------------------------------------------------------

def _using(cp, allocator):
    """``cupy.cuda.using_allocator(allocator)``, or no change when ``allocator`` is None."""
    return contextlib.nullcontext() if allocator is None else cp.cuda.using_allocator(allocator)


def _cupy_alloc_loop(cp, allocator):
    """for_size running ``x = cupy.cuda.alloc(n); del x``."""
    alloc = cp.cuda.alloc

    def for_size(n):
        def batch(ops):
            with _using(cp, allocator):
                for _ in range(ops):
                    x = alloc(n)
                    del x
        return batch

    return for_size


def _cupy_empty_loop(cp, allocator):
    """for_size running ``x = cupy.empty(n, dtype=cupy.uint8); del x``."""
    empty, u8 = cp.empty, cp.uint8

    def for_size(n):
        def batch(ops):
            with _using(cp, allocator):
                for _ in range(ops):
                    x = empty(n, dtype=u8)
                    del x
        return batch

    return for_size


def _cupy_maker(loop, on_gpupool):
    """``make(ctx)`` for a CuPy column: ``loop`` on CuPy's default MemoryPool, or
    (``on_gpupool``) under ``using_allocator(gpupool.cupy.allocator(pool))``, a fresh pool."""
    def make(ctx):
        cp = ctx.need("cupy")
        if not on_gpupool:
            return Made(loop(cp, None), cp.get_default_memory_pool().free_all_blocks)
        import gpupool.cupy

        pool = ctx.new_pool()
        return Made(loop(cp, gpupool.cupy.allocator(pool)), pool.trim, pool)

    return make


make_cupy_alloc = _cupy_maker(_cupy_alloc_loop, on_gpupool=False)
make_cupy_alloc_gp = _cupy_maker(_cupy_alloc_loop, on_gpupool=True)
make_cupy_empty = _cupy_maker(_cupy_empty_loop, on_gpupool=False)
make_cupy_empty_gp = _cupy_maker(_cupy_empty_loop, on_gpupool=True)


def make_cupy_async(ctx):
    """``cupy.cuda.alloc(n)`` under ``using_allocator(cupy.cuda.MemoryAsyncPool().malloc)``."""
    cp = ctx.need("cupy")
    try:
        apool = cp.cuda.MemoryAsyncPool()
        with cp.cuda.using_allocator(apool.malloc):
            cp.cuda.alloc(256)
    except Exception as exc:  # unsupported here: skip the column
        raise Skip(f"MemoryAsyncPool unusable: {type(exc).__name__}: {exc}") from exc
    return Made(_cupy_alloc_loop(cp, apool.malloc), apool.free_all_blocks)


# PyTorch ---------------------------------------------------------------------------------

def make_torch_empty(ctx):
    """``t = torch.empty(n, dtype=torch.uint8, device="cuda"); del t``."""
    torch = ctx.need("torch")
    if not torch.cuda.is_available():
        raise Skip("torch.cuda.is_available() is False")
    empty, u8, dev = torch.empty, torch.uint8, torch.device("cuda", 0)
    empty(1, dtype=u8, device=dev)

    def for_size(n):
        def batch(ops):
            for _ in range(ops):
                t = empty(n, dtype=u8, device=dev)
                del t
        return batch

    return Made(for_size, torch.cuda.empty_cache)


def _torch_use_child(conn):
    """Child process of ``torch.gp``: gpupool.torch.use(), then run each batch it is sent."""
    import gc

    import torch

    import gpupool.torch

    try:
        gpupool.torch.use()
        empty, u8, dev = torch.empty, torch.uint8, torch.device("cuda", 0)
        empty(1, dtype=u8, device=dev)
    except Exception as exc:  # reported by the parent as the column's skip reason
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    gc.disable()
    conn.send(None)
    for n, ops in iter(conn.recv, None):
        for _ in range(ops):
            t = empty(n, dtype=u8, device=dev)
            del t
        conn.send(None)


def make_torch_empty_gp(ctx):
    """The ``torch`` loop with gpupool as PyTorch's allocator (``gpupool.torch.use()``).

    ``use()`` must precede PyTorch's CUDA start, so the loop runs in a child process; each
    batch is one round trip over a pipe (tens of microseconds, under 1% of a batch).
    """
    import multiprocessing

    torch = ctx.need("torch")
    if not torch.cuda.is_available():
        raise Skip("torch.cuda.is_available() is False")
    spawn = multiprocessing.get_context("spawn")
    conn, child_conn = spawn.Pipe()
    child = spawn.Process(target=_torch_use_child, args=(child_conn,), daemon=True)
    child.start()
    child_conn.close()          # so that a dead child reads as EOF here
    try:
        error = conn.recv()
    except EOFError:
        error = "it exited"
    if error is not None:
        child.join()
        raise Skip(f"the gpupool.torch.use() child process failed: {error}")

    def for_size(n):
        def batch(ops):
            conn.send((n, ops))
            conn.recv()
        return batch

    def cleanup():
        conn.send(None)
        child.join()

    return Made(for_size, cleanup)


# Driver through cuda.bindings' Python layer ----------------------------------------------

def make_driver_async(ctx):
    """``cuMemAllocAsync`` + ``cuMemFreeAsync`` on the legacy stream, device's default pool."""
    driver = ctx.driver()
    alloc, free = driver.cuMemAllocAsync, driver.cuMemFreeAsync
    stream = driver.CUstream(0)

    def for_size(n):
        def batch(ops):
            for _ in range(ops):
                async_pair(alloc, free, n, stream)
        return batch

    return Made(for_size, driver.cuCtxSynchronize)


def make_driver_alloc(ctx):
    """``cuMemAlloc`` + ``cuMemFree`` (no cache): the baseline every pool avoids."""
    driver = ctx.driver()
    alloc, free = driver.cuMemAlloc, driver.cuMemFree

    def for_size(n):
        def batch(ops):
            for _ in range(ops):
                err, ptr = alloc(n)
                if err:
                    raise DriverError(f"cuMemAlloc({n}): {err}")
                if free(ptr)[0]:
                    raise DriverError("cuMemFree failed")
        return batch

    return Made(for_size)


# Numba -----------------------------------------------------------------------------------

def _numba_context(ctx):
    """``(numba.cuda, Numba's context of device 0)``, or raise Skip."""
    cuda = ctx.need("numba_cuda")
    if not cuda.is_available():
        raise Skip("numba.cuda.is_available() is False")
    return cuda, cuda.current_context()


@contextlib.contextmanager
def _serving(context, manager):
    """Numba's context allocating through ``manager`` while entered (None: its own); yields
    the manager in use. Numba fixes a context's manager when it makes the context, so a
    plugin is swapped in around each batch rather than set with ``set_memory_manager``."""
    previous = context.memory_manager
    context.memory_manager = previous if manager is None else manager
    try:
        yield context.memory_manager
    finally:
        context.memory_manager = previous


def _numba_loop(cuda, context, manager):
    """for_size running ``a = numba.cuda.device_array(n, dtype=np.uint8); del a``.

    Numba's own manager defers frees; each batch ends by flushing them, so their cost is
    counted (gpupool's plugin frees at once: nothing to flush).
    """
    import numpy as np

    device_array, u8 = cuda.device_array, np.uint8

    def for_size(n):
        def batch(ops):
            with _serving(context, manager) as serving:
                for _ in range(ops):
                    a = device_array(n, dtype=u8)
                    del a
                serving.deallocations.clear()
        return batch

    return for_size


def make_numba(ctx):
    """``numba.cuda.device_array(n, dtype=np.uint8)``, Numba's default memory manager."""
    cuda, context = _numba_context(ctx)
    return Made(_numba_loop(cuda, context, None))


def make_numba_gp(ctx):
    """The same through gpupool's EMM plugin (``gpupool.numba``), from a pool of its own."""
    cuda, context = _numba_context(ctx)
    import gpupool.numba

    pool = ctx.new_pool()
    manager = gpupool.numba.GpupoolNumbaManager(context=context, pool=pool)
    return Made(_numba_loop(cuda, context, manager), pool.trim, pool)


def loop_batch(ops):
    """The timed loop with nothing in it but a local store and delete (its overhead)."""
    n = 256
    for _ in range(ops):
        x = n
        del x


COLUMNS = [
    Column("gp", "gpupool Pool.allocate + del", make_gpupool, CACHED),
    Column("gp.region", "gpupool, inside `with Region:`", make_gpupool_region, CACHED),
    Column("gp.plan", "gpupool, inside `with Region(plan=True):`", make_gpupool_plan, CACHED),
    Column("cp.alloc", "cupy.cuda.alloc, CuPy MemoryPool", make_cupy_alloc, CACHED),
    Column("cp.alloc.gp", "cupy.cuda.alloc, gpupool allocator", make_cupy_alloc_gp, CACHED),
    Column("cp.empty", "cupy.empty uint8, CuPy MemoryPool", make_cupy_empty, CACHED),
    Column("cp.empty.gp", "cupy.empty uint8, gpupool allocator", make_cupy_empty_gp, CACHED),
    Column("cp.async", "cupy.cuda.alloc, CuPy MemoryAsyncPool", make_cupy_async, CACHED),
    Column("torch", "torch.empty uint8 + del, caching allocator", make_torch_empty, CACHED),
    Column("torch.gp", "torch.empty uint8 + del, gpupool.torch.use() (child process)",
           make_torch_empty_gp, CACHED),
    Column("drv.async", "cuMemAllocAsync + cuMemFreeAsync (Python layer)", make_driver_async,
           CACHED),
    Column("drv.alloc", "cuMemAlloc + cuMemFree (Python layer, uncached)", make_driver_alloc,
           UNCACHED),
    Column("numba", "numba.cuda.device_array, no pool", make_numba, NUMBA),
    Column("numba.gp", "numba.cuda.device_array, gpupool EMM plugin", make_numba_gp, NUMBA),
]


# Running ---------------------------------------------------------------------------------

def plan_for(column, quick):
    """The column's batch plan; with ``quick``, batches of at most 200 ops."""
    return dict(column.plan, ops=min(column.plan["ops"], QUICK_OPS)) if quick else column.plan


def run_group(columns, ctx, sizes, quick, out):
    """Make, measure (interleaved rounds) and clean up one group of columns, into ``out``."""
    made = _peers.make_columns({c.key: c.make for c in columns}, ctx, out["skipped"])
    cells = {(c.key, n): Cell(made[c.key].loop(n), **plan_for(c, quick))
             for c in columns if c.key in made for n in sizes}
    if not cells:
        return
    if columns[0].group == "cached":
        cells["loop", 0] = Cell(loop_batch, **plan_for(columns[0], quick))
    start = time.perf_counter()
    timings, errors = measure_rounds(cells, reps=QUICK_REPS if quick else REPS)
    print(f"  {columns[0].group} group ({', '.join(made)}): {time.perf_counter() - start:.1f} s",
          file=sys.stderr)
    if ("loop", 0) in timings:
        out["loop_overhead_ns"] = timings.pop(("loop", 0)).median
    for column in columns:
        if column.key not in made:
            continue
        entry = out["columns"][column.key] = {
            "label": column.label, "plan": plan_for(column, quick), "results": {
                str(n): timings[column.key, n].as_dict() for n in sizes
                if (column.key, n) in timings}}
        _peers.close_column(made[column.key], entry)
    _common.record_errors(errors, out["errors"])


def run(columns, ctx, sizes, quick):
    """Run every column, cached group first; progress to stderr. Returns the result dict."""
    out = {"columns": {}, "skipped": {}, "errors": {}, "loop_overhead_ns": None}
    for group in ("cached", "uncached"):
        members = [c for c in columns if c.group == group]
        if members:
            run_group(members, ctx, sizes, quick, out)
    out["columns"] = {c.key: out["columns"][c.key] for c in columns if c.key in out["columns"]}
    return out


# Reporting -------------------------------------------------------------------------------

def _cell(out, key, n, field_="median"):
    result = out["columns"].get(key, {}).get("results", {}).get(str(n))
    return None if result is None else result[field_]


def ratios(out, sizes):
    """Each column's median over gpupool's (``gp``) for the same size."""
    table = {}
    for key in out["columns"]:
        if key == "gp":
            continue
        table[key] = {}
        for n in sizes:
            mine, base = _cell(out, key, n), _cell(out, "gp", n)
            table[key][str(n)] = None if mine is None or not base else mine / base
    return table


def targets(out, sizes):
    """The DESIGN/issue targets, per size: value, limit, ok."""
    checks = []
    for n in sizes:
        gp = _cell(out, "gp", n)
        if gp is not None:
            checks.append({"target": "gpupool cached allocate+free <= 250 ns", "size": n,
                           "value": gp, "limit": GPUPOOL_TARGET_NS,
                           "ok": gp <= GPUPOOL_TARGET_NS})
    compared = [
        ("gp.plan", "gp", "planned allocate+free <= 1.0x the pool's", PLAN_TARGET_RATIO),
        ("cp.empty.gp", "cp.empty", "cupy.empty on gpupool <= 1.1x on CuPy's pool",
         CUPY_EMPTY_TARGET_RATIO)]
    for key, of, target, limit in compared:
        for n in sizes:
            mine, base = _cell(out, key, n), _cell(out, of, n)
            if mine is not None and base:
                checks.append({"target": target, "size": n, "value": mine / base,
                               "limit": limit, "ok": mine / base <= limit})
    return checks


def _spread(out, key, n):
    if _cell(out, key, n) is None:
        return "-"
    return f"{format_ns(_cell(out, key, n, 'min'))}-{format_ns(_cell(out, key, n, 'max'))}"


def _ratio(value):
    return "-" if value is None else f"{value:.2f}x"


def _targets_text(out):
    if out["simulated"]:
        return "targets: not judged on the simulated device"
    lines = ["targets:"]
    for t in out["targets"]:
        value = f"{t['value']:.0f} ns" if "ns" in t["target"] else f"{t['value']:.2f}x"
        lines.append(f"  [{'ok' if t['ok'] else 'MISS'}] {t['target']}: "
                     f"{format_size(t['size'])}: {value}")
    return "\n".join(lines)


def _legend(out):
    lines = [f"Python loop overhead: {format_ns(out['loop_overhead_ns'])} ns per iteration "
             "(included in every cell)", "", "columns:"]
    for k, c in out["columns"].items():
        lines.append(f"  {k:12} {c['label']}")
        if c.get("notes"):
            lines.append(f"  {'':12} (exits that repeated the last, their step not made "
                         f"again: {c['notes']['exits_repeated']:,} of {c['notes']['entries']:,})")
    lines += _common.problem_lines(out, 12, lambda n: f"at {format_size(int(n))}")
    return "\n".join(lines)


def report(out, sizes):
    """The printed tables: medians, spreads, ratios to gpupool, targets, legend."""
    keys, ratio = list(out["columns"]), out["ratios"]
    parts = [
        format_table(["size", *keys],
                     [[format_size(n)] + [format_ns(_cell(out, k, n)) for k in keys]
                      for n in sizes],
                     "ns per allocate + free, median (legacy default stream)"),
        format_table(["size", *keys],
                     [[format_size(n)] + [_spread(out, k, n) for k in keys] for n in sizes],
                     "spread: min-max of the repetitions, ns"),
    ]
    if "gp" in out["columns"] and ratio:
        parts.append(format_table(
            ["size", *ratio],
            [[format_size(n)] + [_ratio(ratio[k][str(n)]) for k in ratio] for n in sizes],
            "column median / gp median (gpupool's pool alone): above 1 = gp faster"))
    parts += [p for p in (_common.cache_lines(out), _targets_text(out), _legend(out)) if p]
    return "\n\n".join(parts)


def main(argv=None):
    p = _common.parser(__doc__.splitlines()[0], columns=[c.key for c in COLUMNS])
    args = p.parse_args(argv)
    columns = _peers.chosen_columns(p, args.columns, COLUMNS)
    ctx = _peers.context_or_skip(SCRIPT, args)
    start = time.perf_counter()
    out = {"script": SCRIPT, "unit": "ns per allocate+free pair", "stream": "legacy default (0)",
           "sizes": SIZES, "simulated": args.simulated, "quick": args.quick,
           "env": _common.environment()}
    out.update(run(columns, ctx, SIZES, args.quick))
    out["ratios"] = ratios(out, SIZES)
    out["targets"] = [] if args.simulated else targets(out, SIZES)
    return _common.finish(out, start, lambda o: report(o, SIZES), args.json)


if __name__ == "__main__":
    sys.exit(main())
