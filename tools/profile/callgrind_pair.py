"""Instructions per cached allocate + free pair, counted by callgrind on the simulated device.

Two paths: the C API (``bench/_capi_loop.c``'s loop, no GIL) and ``Pool.allocate`` from Python
(``buf = allocate(n); del buf``). Each is run under ``valgrind --tool=callgrind`` twice, with
``--pairs`` and with no pairs (the same start-up and warm-up), and the difference of the two
totals is divided by the number of pairs, so start-up costs cancel. Counts are repeatable for
the same build on any machine (they do not depend on load). ``--history`` runs the pairs with
the memory history recording (``gpupool.record_memory_history``): ``python`` with Python
frames, ``none`` without. ``--region`` runs the warm-up and the pairs inside one entry of a
(plain) ``gpupool.Region``: the shared path, where the pool alone takes the thread's magazine.
``--plan`` runs them in entries of 1,000 pairs of a ``Region(plan=True)``, after 8 such entries
to warm up (the plan served from the third): a planned region's pairs, its entries and exits
included (with its lane: Note [Region lanes]; ``GPUPOOL_LANES=0`` without). ``--keep DIR``
keeps callgrind's output files there (``PATH-0.out``, ``PATH-PAIRS.out``: read them with
``callgrind_annotate --inclusive=yes``; per pair, a function's count in the second less the
first, over the pairs). Run::

    python tools/profile/callgrind_pair.py [--pairs 200000] [--nbytes 1048576] [--history python]
                                           [--region | --plan] [--keep DIR]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench")

CHILD = r"""
import sys
sys.path.insert(0, {bench!r})
import gpupool
from gpupool.testing import SimulatedDevice
pool = gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 34))
gpupool.set_pool(pool, device=0)
nbytes, pairs, path = {nbytes}, int(sys.argv[1]), {path!r}
if {history!r} != "off":
    gpupool.record_memory_history(max_entries=1000, stacks=None if {history!r} == "none"
                                  else "python")
region = gpupool.Region(pool=pool, collect=None) if {region!r} else None
if region is not None:
    region.__enter__()
for _ in range(100):                     # warm up: the block is cached after the first
    del_me = pool.allocate(nbytes)
    del del_me
if {plan!r}:
    planned = gpupool.Region(pool=pool, collect=None, plan=True)
    allocate = pool.allocate
    for entry in range(8 + pairs // 1000):
        with planned:
            for _ in range(1000):
                buf = allocate(nbytes)
                del buf
elif path == "capi":
    import _cext
    loop = _cext.build("gpupool_bench_loop", [{loop_c!r}])
    loop.loop([nbytes], 100)
    loop.loop([nbytes], pairs)
else:
    allocate = pool.allocate
    for _ in range(pairs):
        buf = allocate(nbytes)
        del buf
if region is not None:
    region.__exit__(None, None, None)
"""


def instructions(script, pairs, keep=None):
    """Total instructions (callgrind's Ir) of ``python script pairs``; keep: the path its
    output file is kept at (None: not kept)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = keep or os.path.join(tmp, "callgrind.out")
        # One BLAS thread (NumPy's OpenBLAS workers spin, and their count would vary) and a
        # fixed hash seed, so that two runs differ only by the pairs.
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
                   PYTHONHASHSEED="0")
        proc = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                               sys.executable, script, str(pairs)], capture_output=True,
                              text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        match = re.search(r"Collected\s*:\s*(\d+)", proc.stderr) or \
            re.search(r"summary:\s*(\d+)", open(out, encoding="utf-8").read())
        return int(match.group(1))


def kept(keep, path, pairs):
    """Where --keep puts the output file of the run of path with pairs; None: not kept."""
    return os.path.join(keep, f"{path}-{pairs}.out") if keep else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=200_000)
    p.add_argument("--nbytes", type=int, default=1 << 20)
    p.add_argument("--history", choices=("off", "python", "none"), default="off",
                   help="memory history: off (default), with Python frames, without")
    way = p.add_mutually_exclusive_group()
    way.add_argument("--region", action="store_true",
                     help="the pairs inside one entry of a plain gpupool.Region")
    way.add_argument("--plan", action="store_true",
                     help="the pairs in entries of 1,000 of a gpupool.Region(plan=True), from "
                          "Python (--pairs: a multiple of 1,000)")
    p.add_argument("--keep", metavar="DIR",
                   help="keep callgrind's output files in DIR (made if missing)")
    args = p.parse_args(argv)
    if args.plan and (args.pairs % 1000 or args.pairs <= 0):
        p.error(f"--plan needs --pairs a positive multiple of 1000, got {args.pairs}")
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    for path in ("python",) if args.plan else ("capi", "python"):
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(CHILD.format(bench=BENCH, nbytes=args.nbytes, path=path,
                                 loop_c=os.path.join(BENCH, "_capi_loop.c"),
                                 history=args.history, region=args.region, plan=args.plan))
        try:
            # The extension is built in the first run; build it once outside the counts.
            instructions(f.name, 0)
            base = instructions(f.name, 0, kept(args.keep, path, 0))
            total = instructions(f.name, args.pairs, kept(args.keep, path, args.pairs))
        finally:
            os.unlink(f.name)
        print(f"{path:7} {(total - base) / args.pairs:8.1f} instructions per pair "
              f"({args.nbytes} B, legacy stream, {args.pairs:,} pairs, memory history "
              f"{args.history}{', in a region' if args.region else ''}"
              f"{', in entries of a planned region' if args.plan else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
