"""Time gpupool's CuPy adapter without a GPU: ns per ``x = alloc(n); del x`` on the simulated
device, CuPy replaced by the fake of tests/fake_cupy.py (cheap Python memory classes): the
median and the minimum over interleaved timeit rounds. The adapter's own overhead is what
differs between columns; the absolute numbers are not GPU numbers.

    python tools/profile/time_cupy_adapter.py                  # this tree's adapter
    git show 9e2f086:gpupool/cupy.py > /tmp/old_cupy.py         # the last interpreted adapter
    python tools/profile/time_cupy_adapter.py --old /tmp/old_cupy.py   # and another version's

Columns: ``pool.allocate`` (the pool alone), then each adapter with an explicit pool
(``allocator(pool)``; this tree's made as ``gpupool.cupy.allocator`` makes it, since that
refuses a pool on the simulated device) and with the default pool (``allocator()``, after
``set_pool``).
"""

import argparse
import importlib.util
import random
import statistics
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from fake_cupy import FakeCupy  # noqa: E402

sys.modules["cupy"] = FakeCupy()

import gpupool  # noqa: E402
import gpupool.cupy  # noqa: E402
from gpupool.adapters.cupy_allocator import CupyAllocator  # noqa: E402
from gpupool.testing import SimulatedDevice  # noqa: E402

SIZES = [256, 64 << 10, 1 << 20]


def load_adapter(path):
    """The module at ``path`` (a version of gpupool/cupy.py), imported under another name."""
    spec = importlib.util.spec_from_file_location("gpupool_cupy_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_columns(columns, nbytes, number, runs):
    """ns per ``x = alloc(nbytes); del x`` of each column: ``runs`` rounds, each timing
    ``number`` pairs of every column in a shuffled order (so that drift in the machine's load
    falls on all columns alike); the median and the minimum over the rounds, by column."""
    timers = {}
    for name, alloc in columns.items():
        alloc(nbytes)                   # the block is cached from here on
        timers[name] = timeit.Timer("x = alloc(n); del x", globals={"alloc": alloc, "n": nbytes})
    samples = {name: [] for name in columns}
    order = list(columns)
    for _ in range(runs):
        random.shuffle(order)
        for name in order:
            samples[name].append(timers[name].timeit(number) / number * 1e9)
    return {name: (statistics.median(ns), min(ns)) for name, ns in samples.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, help="another version of gpupool/cupy.py")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--number", type=int, default=50_000)
    args = parser.parse_args()

    pool = gpupool.Pool(upstream=SimulatedDevice())
    gpupool.set_pool(pool)
    columns = {"pool.allocate": pool.allocate,
               "new(pool)": CupyAllocator.for_cupy(sys.modules["cupy"], pool,
                                                   gpupool.get_pool).malloc,
               "new()": gpupool.cupy.allocator()}
    if args.old is not None:
        old = load_adapter(args.old)
        columns["old(pool)"] = old.allocator(pool)
        columns["old()"] = old.allocator()
    print(f"ns per allocate + free: median (minimum) of {args.runs} interleaved runs of "
          f"{args.number}")
    print(f"{'bytes':>8}" + "".join(f"{name:>16}" for name in columns))
    for nbytes in SIZES:
        cells = time_columns(columns, nbytes, args.number, args.runs).values()
        print(f"{nbytes:>8}" + "".join(f"{f'{med:.0f} ({low:.0f})':>16}" for med, low in cells))


if __name__ == "__main__":
    main()
