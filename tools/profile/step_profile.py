"""Where a training run's host time goes, per allocator column: ``bench/real_models.py``'s run
of one (model, column) in this process under :mod:`cProfile`, its functions printed by own
time and by calls (a Python hook called per allocation shows in the calls). GPU only::

    python tools/profile/step_profile.py MODEL COLUMN [--steps N] [--top K]

COLUMN is one of ``real_models.py``'s column keys; its environment (``GPUPOOL_UPSTREAM``) is
set before anything is imported.
"""

import argparse
import cProfile
import os
import pstats
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def no_gpu():
    """Why no run can be made here (no CUDA driver, or no device), or None. Asks the driver
    (``cuInit``, ``cuDeviceGetCount``) without making a context, so that the column's allocator
    is still installed before anything touches the GPU."""
    try:
        from cuda.bindings import driver

        err, = driver.cuInit(0)
        if err == driver.CUresult.CUDA_SUCCESS:
            err, count = driver.cuDeviceGetCount()
            if err == driver.CUresult.CUDA_SUCCESS:
                return None if count else "no CUDA device"
        return f"the CUDA driver answers {err.name}"
    except Exception as exc:        # no driver library: cuda-bindings raises its own error
        return f"no CUDA driver ({type(exc).__name__}: {exc})"


def column_ready(parser, column, tool):
    """``bench/real_models.py`` as a module, with ``column``'s environment set before anything
    is imported; the parser's error for an unknown column, its exit (2) where no GPU is."""
    import real_models

    if column not in real_models.COLUMNS:
        parser.error(f"unknown column {column!r}: one of {', '.join(real_models.COLUMNS)}")
    why = no_gpu()
    if why:
        parser.exit(2, f"{tool}: needs a GPU: {why}\n")
    os.environ.update(real_models.COLUMNS[column][1])
    return real_models


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="one of real_models.py's models (e.g. llama-ckpt)")
    p.add_argument("column", help="one of real_models.py's column keys (e.g. gp.vmm.plan)")
    p.add_argument("--steps", type=int, default=12,
                   help="training steps of the profiled run (default: %(default)s)")
    p.add_argument("--top", type=int, default=25,
                   help="functions printed per table (default: %(default)s)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.top < 1:
        p.error(f"--steps and --top must be >= 1, not {args.steps} and {args.top}")
    real_models = column_ready(p, args.column, "step_profile.py")
    profile = cProfile.Profile()
    record = profile.runcall(real_models.child, args.model, args.column, args.steps, None, False)
    ms = record["per_step"]["ms"]
    print(f"{args.model} {args.column}: ms/step {[round(x) for x in ms]}, "
          f"exits {[round(x, 1) for x in record['per_step']['exit_ms']]}")
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("ncalls").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
