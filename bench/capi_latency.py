"""C API latency: cached allocate + free through gpupool's C API, beside the Python API.

Builds ``examples/c_extension`` (gpupool's header only, no CUDA toolkit) into a temporary
folder, then times ``api->allocate`` + ``api->free`` pairs in a C loop without the GIL
(``gpupool_scratch.bench``), and ``pool.allocate`` + ``del`` from Python, on the same pool,
legacy default stream. Target (DESIGN.md): C API <= 50 ns per pair.

    python bench/capi_latency.py [--quick] [--simulated] [--json PATH]
"""

import os
import sys
import time

import _cext
import _common

import gpupool

SCRIPT = "capi_latency"
HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, os.pardir, "examples", "c_extension")
SIZES = [256, 4 * _common.KiB, 64 * _common.KiB, _common.MiB, 16 * _common.MiB]


def build_example():
    """Build and import the C extension example; returns the module."""
    return _cext.build("gpupool_scratch", [os.path.join(EXAMPLE, "scratch.c")])


def python_pairs(pool, nbytes):
    def batch(ops):
        allocate = pool.allocate
        for _ in range(ops):
            buf = allocate(nbytes)
            del buf
    return batch


def main(argv=None):
    args = _common.parser(__doc__.splitlines()[0]).parse_args(argv)
    if args.simulated:
        from gpupool.testing import SimulatedDevice
        pool = gpupool.Pool(upstream=SimulatedDevice())
    else:
        pool, reason = _common.gpu_pool()
        if pool is None:
            _common.skip(SCRIPT, reason, args.json)
        pool = gpupool.Pool(device=0)
    gpupool.set_pool(pool)
    scratch = build_example()
    reps, ops = (5, 20_000) if args.quick else (25, 200_000)
    start = time.perf_counter()
    results = {}
    for n in SIZES:
        c_ns = sorted(scratch.bench(n, ops) for _ in range(reps))
        py = _common.measure(python_pairs(pool, n), reps=reps, ops=ops // 10)
        results[str(n)] = {"c_api": {"median": c_ns[reps // 2], "min": c_ns[0],
                                     "max": c_ns[-1]},
                           "python": py.as_dict()}
    rows = [[_common.format_size(n), _common.format_ns(results[str(n)]["c_api"]["median"]),
             f"{_common.format_ns(results[str(n)]['c_api']['min'])}-"
             f"{_common.format_ns(results[str(n)]['c_api']['max'])}",
             _common.format_ns(results[str(n)]["python"]["median"])] for n in SIZES]
    print(_common.format_table(["size", "C API ns", "C API spread", "Python API ns"], rows,
                               "ns per cached allocate + free pair, median of "
                               f"{reps} repetitions of {ops} (C) / {ops // 10} (Python)"))
    worst = max(r["c_api"]["median"] for r in results.values())
    verdict = "not judged (simulated device)" if args.simulated else (
        "met" if worst <= 50 else "MISSED")
    print(f"\ntarget C API <= 50 ns: {verdict} (worst size {worst:.1f} ns)")
    out = {"script": SCRIPT, "unit": "ns per allocate+free pair", "results": results,
           "simulated": args.simulated, "env": _common.environment(),
           "elapsed_s": time.perf_counter() - start}
    if args.json:
        _common.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
