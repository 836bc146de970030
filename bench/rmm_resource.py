"""``rmm.DeviceBuffer(size=n)`` + del on gpupool's RMM resource against RMM's own resources.

Each column allocates and frees an ``rmm.DeviceBuffer`` of n bytes (legacy default stream)
through one RMM resource passed as ``mr=``: gpupool's (``gpupool.rmm.resource``, a fresh
pool), RMM's pool (``PoolMemoryResource`` over ``CudaMemoryResource``) and RMM's stream-ordered
resource (``CudaAsyncMemoryResource``, the driver's pool). Result: ns per allocate + free pair,
median of interleaved rounds. The target: gpupool's resource no slower than RMM's pool. Run::

    python bench/rmm_resource.py [--json PATH] [--quick] [--columns gp,rmm.pool,rmm.async]

Skips (exit status 0, one line) without RMM or a GPU, and on the simulated device.
"""

import sys
import time

import _common
import _peers
from _common import Cell, MiB, format_ns, format_size, format_table, measure_rounds
from _peers import Made, Skip

SCRIPT = "rmm_resource"
SIZES = [256, 1 * MiB, 64 * MiB]
REPS, QUICK_REPS = 30, 3
PLAN, QUICK_PLAN = {"ops": 2000}, {"ops": 200}
RMM_POOL_INITIAL = 256 * MiB        # RMM's pool starts here and grows (its default: half the GPU)


def _loop(rmm, mr):
    """for_size running ``buf = rmm.DeviceBuffer(size=n, mr=mr); del buf``."""
    device_buffer = rmm.DeviceBuffer

    def for_size(n):
        def batch(ops):
            for _ in range(ops):
                buf = device_buffer(size=n, mr=mr)
                del buf
        return batch

    return for_size


def make_gpupool(ctx, rmm):
    """gpupool's resource over a fresh pool (``gpupool.rmm.resource(pool)``)."""
    import gpupool.rmm

    pool = ctx.new_pool()
    return Made(_loop(rmm, gpupool.rmm.resource(pool)), pool.trim, pool)


def make_rmm_pool(ctx, rmm):
    """RMM's ``PoolMemoryResource(CudaMemoryResource(), initial_pool_size=256 MiB)``."""
    mr = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(),
                                   initial_pool_size=RMM_POOL_INITIAL)
    return Made(_loop(rmm, mr))


def make_rmm_async(ctx, rmm):
    """RMM's ``CudaAsyncMemoryResource()`` (cudaMallocAsync's pool)."""
    try:
        mr = rmm.mr.CudaAsyncMemoryResource()
    except Exception as exc:  # unsupported here: skip the column
        raise Skip(f"CudaAsyncMemoryResource unusable: {type(exc).__name__}: {exc}") from exc
    return Made(_loop(rmm, mr))


COLUMNS = [
    _peers.Column("gp", "rmm.DeviceBuffer + del, gpupool.rmm.resource(pool)", make_gpupool),
    _peers.Column("rmm.pool",
                  "rmm.DeviceBuffer + del, RMM PoolMemoryResource(CudaMemoryResource)",
                  make_rmm_pool),
    _peers.Column("rmm.async", "rmm.DeviceBuffer + del, RMM CudaAsyncMemoryResource",
                  make_rmm_async),
]


def run(columns, ctx, rmm, quick):
    """Make the columns, time them in interleaved rounds, clean up; the result dict."""
    out = {"columns": {}, "skipped": {}, "errors": {}}
    made = _peers.make_columns({c.key: (lambda ctx, c=c: c.make(ctx, rmm)) for c in columns},
                               ctx, out["skipped"])
    plan = QUICK_PLAN if quick else PLAN
    cells = {(key, n): Cell(m.loop(n), **plan) for key, m in made.items() for n in SIZES}
    timings, errors = measure_rounds(cells, reps=QUICK_REPS if quick else REPS)
    for column in columns:
        if column.key not in made:
            continue
        entry = out["columns"][column.key] = {
            "label": column.label, "plan": plan, "results": {
                str(n): timings[column.key, n].as_dict() for n in SIZES
                if (column.key, n) in timings}}
        _peers.close_column(made[column.key], entry)
    _common.record_errors(errors, out["errors"])
    return out


def _median(out, key, n):
    result = out["columns"].get(key, {}).get("results", {}).get(str(n))
    return None if result is None else result["median"]


def targets(out):
    """gpupool's resource / RMM's pool, per size: value, limit 1.0, ok."""
    checks = []
    for n in SIZES:
        mine, base = _median(out, "gp", n), _median(out, "rmm.pool", n)
        if mine is not None and base:
            checks.append({"target": "gpupool resource <= RMM pool resource", "size": n,
                           "value": mine / base, "limit": 1.0, "ok": mine / base <= 1.0})
    return checks


def report(out):
    """The printed tables: medians, ratios to RMM's pool, targets, legend."""
    keys = list(out["columns"])
    parts = [format_table(["size", *keys],
                          [[format_size(n)] + [format_ns(_median(out, k, n)) for k in keys]
                           for n in SIZES],
                          "ns per rmm.DeviceBuffer(size=n) + del, median (legacy default "
                          "stream)")]
    if "rmm.pool" in out["columns"]:
        rows = []
        for n in SIZES:
            base = _median(out, "rmm.pool", n)
            rows.append([format_size(n)] + [
                "-" if _median(out, k, n) is None or not base else
                f"{_median(out, k, n) / base:.2f}x" for k in keys])
        parts.append(format_table(["size", *keys], rows,
                                  "median / RMM pool's median: below 1 = faster than RMM's pool"))
    lines = ["targets:"] + [
        f"  [{'ok' if t['ok'] else 'MISS'}] {t['target']}: {format_size(t['size'])}: "
        f"{t['value']:.2f}x" for t in out["targets"]]
    parts.append("\n".join(lines) if out["targets"] else "targets: not judged (no RMM pool "
                                                          "or gpupool column)")
    parts += [p for p in (_common.cache_lines(out),) if p]
    legend = ["columns:"] + [f"  {k:10} {c['label']}" for k, c in out["columns"].items()]
    legend += _common.problem_lines(out, 10, lambda n: f"at {format_size(int(n))}")
    parts.append("\n".join(legend))
    return "\n\n".join(parts)


def main(argv=None):
    p = _common.parser(__doc__.splitlines()[0], columns=[c.key for c in COLUMNS],
                       no_simulated="RMM allocates device memory")
    args = p.parse_args(argv)
    columns = _peers.chosen_columns(p, args.columns, COLUMNS)
    if args.simulated:
        _common.skip(SCRIPT, "RMM allocates device memory: no simulated run", args.json)
    rmm, reason = _common.optional_import("rmm")
    if rmm is None:
        _common.skip(SCRIPT, f"{reason} (pip install 'gpupool[rmm]')", args.json)
    ctx = _peers.context_or_skip(SCRIPT, args, frameworks=(), simulated=False)
    start = time.perf_counter()
    out = {"script": SCRIPT, "unit": "ns per allocate+free pair", "stream": "legacy default (0)",
           "sizes": SIZES, "simulated": False, "quick": args.quick,
           "env": dict(_common.environment(), rmm=getattr(rmm, "__version__", None))}
    out.update(run(columns, ctx, rmm, args.quick))
    out["targets"] = targets(out)
    return _common.finish(out, start, report, args.json)


if __name__ == "__main__":
    sys.exit(main())
