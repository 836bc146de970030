"""Reserved memory of a loop whose request sizes creep upward: peak reserved / peak in use.

The loop: two live buffers growing from 16 MiB to 32 MiB by 256 KiB a step (64 steps); each
step frees the previous two and allocates two new ones, so the peak in use is 63.5 MiB. On a
plain upstream every eighth step crosses a 2 MiB page and needs new segments, while the old
ones sit free and too small (see Note [Creeping requests on a plain upstream] in
docs/design.md). Columns: gpupool on the plain driver upstream and on the vmm upstream
(expandable segments), and on a GPU PyTorch's caching allocator and CuPy's ``MemoryPool``.
Without a GPU, or with ``--simulated``, the gpupool columns run on the simulated device and
the peers are skipped. Run::

    python bench/creep.py [--simulated] [--json PATH]
"""

import sys
import time

import _common
from _common import KiB, MiB, format_table

SCRIPT = "creep"
START, STEP, STEPS, LIVE = 16 * MiB, 256 * KiB, 64, 2


def sizes():
    """The request size of each step, in bytes."""
    return [START + k * STEP for k in range(STEPS)]


def creep(allocate, reserved):
    """Run the loop with ``allocate(nbytes)`` (returns an object holding the memory until it
    is dropped) and ``reserved()`` (bytes reserved now); the peak of ``reserved()`` seen after
    each allocation, in bytes."""
    live, peak = [], 0
    for n in sizes():
        live.clear()
        for _ in range(LIVE):
            live.append(allocate(n))
            peak = max(peak, reserved())
    live.clear()
    return peak


def gpupool_column(gpupool, upstream):
    """Peak reserved bytes of a fresh gpupool pool on ``upstream`` (a name or an Upstream)."""
    pool = gpupool.Pool(upstream=upstream)
    peak = creep(pool.allocate, lambda: pool.stats().reserved_bytes)
    assert peak == pool.stats().peak_reserved_bytes
    return peak


def torch_column(torch):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    creep(lambda n: torch.empty(n, dtype=torch.uint8, device="cuda"), torch.cuda.memory_reserved)
    peak = torch.cuda.max_memory_reserved()
    torch.cuda.empty_cache()
    return peak


def cupy_column(cupy):
    pool = cupy.cuda.MemoryPool()
    peak = creep(pool.malloc, pool.total_bytes)
    pool.free_all_blocks()
    return peak


def run(simulated):
    import gpupool

    out = {"script": SCRIPT, "simulated": simulated, "peak_in_use": LIVE * sizes()[-1],
           "columns": {}, "skipped": {}}
    cols = out["columns"]
    if not simulated:
        _, reason = _common.gpu_pool()
        simulated = out["simulated"] = reason is not None
    if simulated:
        from gpupool.testing import SimulatedDevice

        for kind in ("driver", "vmm"):
            sim = SimulatedDevice(capacity=1 << 40, virtual_memory=kind == "vmm")
            cols[kind] = gpupool_column(gpupool, sim)
        out["skipped"] = {"torch": "simulated device", "cupy": "simulated device"}
        return out
    for kind in ("driver", "vmm"):
        cols[kind] = gpupool_column(gpupool, kind)
    for name, column in (("torch", torch_column), ("cupy", cupy_column)):
        module, reason = _common.optional_import(name)
        if module is None:
            out["skipped"][name] = reason
        else:
            cols[name] = column(module)
    return out


def report(out):
    live = out["peak_in_use"]
    rows = [[key, f"{peak / MiB:.1f}", f"{peak / live:.2f}x"]
            for key, peak in out["columns"].items()]
    rows += [[key, "-", f"skipped: {why}"] for key, why in out["skipped"].items()]
    return format_table(["allocator", "peak reserved MiB", "/ peak in use"], rows,
                        title=f"creeping loop ({LIVE} buffers, {START // MiB}..{sizes()[-1] / MiB}"
                              f" MiB by {STEP // KiB} KiB): peak in use {live / MiB:.1f} MiB")


def main(argv=None):
    args = _common.parser(__doc__.splitlines()[0]).parse_args(argv)
    start = time.perf_counter()
    return _common.finish(run(args.simulated), start, report, args.json)


if __name__ == "__main__":
    sys.exit(main())
