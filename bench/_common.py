"""Helpers shared by the benchmark scripts: timing, tables, GPU detection, JSON.

Timing method (see README.md): a warm-up batch, then ``reps`` repetitions of a batch of
``ops`` operations, each repetition timed with ``time.perf_counter_ns`` and divided by ``ops``;
the result is the median of the repetitions' ns/op and their spread (min, max). The garbage
collector is disabled while a batch runs, as ``timeit`` does.
"""

import argparse
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Timing:
    """Result of :func:`measure`: ns per operation."""

    median: float
    min: float
    max: float
    ops: int
    reps: int

    def as_dict(self):
        """Plain dict for JSON."""
        return asdict(self)


def _run_timed(batch, ops, before, after):
    """Run ``batch(ops)`` once between the optional hooks; return elapsed ns of the batch."""
    if before is not None:
        before()
    start = time.perf_counter_ns()
    batch(ops)
    elapsed = time.perf_counter_ns() - start
    if after is not None:
        after()
    return elapsed


def measure(batch, *, reps=20, ops=2000, target_ns=None, min_ops=1, warmup=1,
            before=None, after=None):
    """Time ``batch(ops)``, which performs ``ops`` operations, and return a :class:`Timing`.

    Parameters
    ----------
    batch : callable
        ``batch(ops)`` runs ``ops`` operations (the loop lives inside it, so that the
        timer's own cost is paid once per batch).
    reps : int
        Timed repetitions.
    ops : int
        Operations per batch; with ``target_ns``, the most operations per batch.
    target_ns : int, optional
        Choose the batch size so that one batch takes about this long (for slow operations),
        from a probe batch of ``min_ops`` operations run after the warm-up.
    min_ops : int
        Fewest operations per batch when ``target_ns`` is given.
    warmup : int
        Untimed batches run first (they fill the caches being measured).
    before, after : callable, optional
        Run before and after every batch, outside the timed interval.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        warm_ops = min_ops if target_ns is not None else ops
        for _ in range(warmup):
            _run_timed(batch, warm_ops, before, after)
        if target_ns is not None:
            probe = _run_timed(batch, min_ops, before, after) / min_ops
            ops = max(min_ops, min(ops, int(target_ns / max(probe, 1.0))))
        samples = [_run_timed(batch, ops, before, after) / ops for _ in range(reps)]
    finally:
        if was_enabled:
            gc.enable()
    return Timing(statistics.median(samples), min(samples), max(samples), ops, reps)


# Formatting -----------------------------------------------------------------------------

def format_size(nbytes):
    """``256 B``, ``4 KiB``, ``16 MiB``."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def format_ns(value):
    """ns with thousands separators; ``-`` for a missing value."""
    if value is None:
        return "-"
    return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def format_table(headers, rows, title=None):
    """Plain-text table: first column left-aligned, the others right-aligned.

    Parameters
    ----------
    headers : list of str
    rows : list of list of str
    title : str, optional
        A line printed above the table.
    """
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells):
        first = str(cells[0]).ljust(widths[0])
        rest = (str(c).rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    out = [] if title is None else [title]
    out += [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)


# GPU and environment --------------------------------------------------------------------

def gpu_pool(device=0):
    """``(gpupool.get_pool(device), None)``, or ``(None, reason)`` when there is no GPU.

    An import failure of gpupool itself is not "no GPU": it propagates.
    """
    import gpupool

    try:
        return gpupool.get_pool(device), None
    except gpupool.NoDeviceError as exc:
        return None, str(exc)


def optional_import(name):
    """``(module, None)``, or ``(None, reason)`` when it cannot be imported."""
    try:
        return importlib.import_module(name), None
    except Exception as exc:  # any failure means "column skipped"
        return None, f"{name} not importable: {type(exc).__name__}: {exc}"


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _device_info(device):
    """GPU name and driver version through cuda.bindings' driver layer; {} on failure."""
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err:
            return {}
        err, dev = driver.cuDeviceGet(device)
        err2, name = driver.cuDeviceGetName(256, dev)
        err3, version = driver.cuDriverGetVersion()
        if err or err2 or err3:
            return {}
        return {"gpu": name.split(b"\0", 1)[0].decode(),
                "driver_version": f"{version // 1000}.{version % 1000 // 10}"}
    except Exception:  # environment info is best effort
        return {}


def environment(device=0):
    """Versions and machine facts recorded with every result file."""
    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpu_count": os.cpu_count(),
    }
    for dist in ("gpupool", "cuda-bindings", "numpy", "cupy-cuda13x", "cupy-cuda12x", "cupy",
                 "torch", "numba-cuda", "numba"):
        version = _version(dist)
        if version is not None:
            info[dist] = version
    info.update(_device_info(device))
    return info


# Command line and output ----------------------------------------------------------------

def parser(description):
    """Argument parser with the options every script takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--quick", action="store_true",
                   help="few repetitions: checks the script runs, numbers are rough")
    p.add_argument("--simulated", action="store_true",
                   help="run gpupool on gpupool.testing.SimulatedDevice (no GPU needed; checks "
                        "the harness only, the numbers are not GPU numbers)")
    return p


def write_json(path, obj):
    """Write ``obj`` as indented JSON to ``path``, creating its folder."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def skip(script, reason, json_path=None):
    """Print the one-line skip message, write a skip record if asked, and exit 0."""
    print(f"{script}: skipped: no GPU ({reason})")
    if json_path:
        write_json(json_path, {"script": script, "skipped": reason, "env": environment()})
    sys.exit(0)
