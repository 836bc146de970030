"""Helpers shared by the benchmark scripts: timing, tables, GPU detection, JSON.

Timing method (see README.md): a warm-up batch, then ``reps`` repetitions of a batch of
``ops`` operations, each repetition timed with ``time.perf_counter_ns`` and divided by ``ops``;
the result is the median of the repetitions' ns/op and their spread (min, max). Several
things measured together are interleaved: each round runs one batch of each, in shuffled
order. The garbage collector is disabled while batches run, as ``timeit`` does.
"""

import argparse
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Timing:
    """Result of a measurement: ns per operation."""

    median: float
    min: float
    max: float
    ops: int
    reps: int

    def as_dict(self):
        """Plain dict for JSON."""
        return asdict(self)


@dataclass
class Cell:
    """One thing to time: ``batch(ops)`` performs ``ops`` operations.

    ``ops`` is the batch size; with ``target_ns`` it is the largest, and the batch is sized
    to take about ``target_ns`` from a probe batch of ``min_ops`` run after the warm-up (for
    slow operations). ``before`` and ``after`` run around every batch, outside the timing.
    """

    batch: Callable
    ops: int = 2000
    target_ns: int | None = None
    min_ops: int = 1
    before: Callable | None = None
    after: Callable | None = None


def _run_timed(cell, ops):
    """Run ``cell.batch(ops)`` once between its hooks; return the batch's elapsed ns."""
    if cell.before is not None:
        cell.before()
    start = time.perf_counter_ns()
    cell.batch(ops)
    elapsed = time.perf_counter_ns() - start
    if cell.after is not None:
        cell.after()
    return elapsed


def _warm_up(cell, warmup):
    """Run the untimed warm-up batches; return the batch size to time."""
    for _ in range(warmup):
        _run_timed(cell, cell.min_ops if cell.target_ns is not None else cell.ops)
    if cell.target_ns is None:
        return cell.ops
    probe = _run_timed(cell, cell.min_ops) / cell.min_ops
    return max(cell.min_ops, min(cell.ops, int(cell.target_ns / max(probe, 1.0))))


def measure_rounds(cells, *, reps=20, warmup=1, seed=0):
    """Time many cells, interleaved: ``reps`` rounds, each running one batch of every cell.

    Interleaving spreads slow drifts and bursts of noise (clock changes, other tenants of
    the machine) over every cell alike instead of penalising whichever runs at that moment.
    Every cell is warmed up first; the order of the cells is shuffled in each round.

    Parameters
    ----------
    cells : dict of key -> Cell
    reps : int
        Rounds, so timed batches per cell.
    warmup : int
        Untimed batches per cell before the rounds (they fill the caches being measured).
    seed : int
        Seed of the shuffles.

    Returns
    -------
    (dict of key -> Timing, dict of key -> Exception)
        A cell whose batch raised is dropped and its exception returned instead.
    """
    ops, samples, errors = {}, {key: [] for key in cells}, {}
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for key, cell in cells.items():
            try:
                ops[key] = _warm_up(cell, warmup)
            except Exception as exc:  # a failed cell is reported, the others go on
                errors[key] = exc
        order, rng = list(ops), random.Random(seed)
        for _ in range(reps):
            rng.shuffle(order)
            for key in list(order):
                try:
                    samples[key].append(_run_timed(cells[key], ops[key]) / ops[key])
                except Exception as exc:  # a failed cell is reported, the others go on
                    errors[key] = exc
                    order.remove(key)
    finally:
        if was_enabled:
            gc.enable()
    timings = {key: Timing(statistics.median(samples[key]), min(samples[key]),
                           max(samples[key]), ops[key], reps)
               for key in ops if key not in errors}
    return timings, errors


def measure(batch, *, reps=20, warmup=1, **cell):
    """Time one ``batch(ops)`` (see :class:`Cell` for the other keywords); a :class:`Timing`.

    Exceptions of the batch propagate.
    """
    timings, errors = measure_rounds({0: Cell(batch, **cell)}, reps=reps, warmup=warmup)
    if errors:
        raise errors[0]
    return timings[0]


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


def pool_counters(pool):
    """A gpupool pool's allocations and misses, for :func:`cache_lines` (a miss went to
    neither the pool's nor a region's cache, so ``1 - misses / allocs`` is the fraction
    served from a cache)."""
    stats = pool.stats()
    return {"num_allocs": stats.num_allocs, "cache_misses": stats.cache_misses,
            "upstream_allocs": stats.upstream_allocs}


def cache_lines(out):
    """One line per column of ``out["columns"]`` with ``pool_counters``: allocations served
    from a cache; None when no column has them."""
    lines = []
    for key, column in out["columns"].items():
        c = column.get("pool_counters")
        if c and c["num_allocs"]:
            lines.append(f"  {key:12} {1 - c['cache_misses'] / c['num_allocs']:.3%} of "
                         f"{c['num_allocs']:,} ({c['upstream_allocs']} upstream allocations)")
    if not lines:
        return None
    return "\n".join(["gpupool allocations served from its caches (pool's or region's), "
                      "warm-up included:", *lines])


def record_errors(errors, into):
    """File :func:`measure_rounds`' errors by column: ``into[key][str(at)]`` gets
    ``"Type: message"`` for each ``(key, at) -> exception`` of ``errors``."""
    for (key, at), exc in errors.items():
        into.setdefault(key, {})[str(at)] = f"{type(exc).__name__}: {exc}"


def problem_lines(out, width, where):
    """Legend lines for ``out["skipped"]`` (key -> reason) and ``out["errors"]`` (key -> at ->
    message): ``"  KEY skipped: reason"``, ``"  KEY error WHERE: message"``, keys padded to
    ``width``; ``where(at)`` says where an error happened (``"at 4 KiB"``)."""
    lines = [f"  {k:{width}} skipped: {why}" for k, why in out["skipped"].items()]
    for key, errors in out["errors"].items():
        lines += [f"  {key:{width}} error {where(at)}: {e}" for at, e in errors.items()]
    return lines


# GPU and environment --------------------------------------------------------------------

def gpu_pool(device=0):
    """``(gpupool.get_pool(device), None)``, or ``(None, reason)`` when there is no GPU.

    An import failure of gpupool itself is not "no GPU": it propagates.
    """
    import gpupool

    try:
        return gpupool.get_pool(device), None
    except gpupool.NoDeviceError as exc:
        return None, f"no GPU ({exc})"


def cuda_torch():
    """``(torch, None)`` when it is importable and sees a CUDA device; else ``(None, why)``."""
    torch, reason = optional_import("torch")
    if torch is not None and not torch.cuda.is_available():
        torch, reason = None, "torch.cuda.is_available() is False"
    return torch, reason


def cuda_torch_or_skip(script, json_path=None):
    """``torch`` when it is importable and sees a CUDA device; else the one-line skip (exit 0)."""
    torch, reason = cuda_torch()
    if torch is None:
        skip(script, reason, json_path)
    return torch


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


def _cpu_model():
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def environment(device=0):
    """Versions and machine facts recorded with every result file."""
    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
    }
    for dist in ("gpupool", "cuda-bindings", "numpy", "cupy-cuda13x", "cupy-cuda12x", "cupy",
                 "torch", "numba-cuda", "numba"):
        version = _version(dist)
        if version is not None:
            info[dist] = version
    spec = importlib.util.find_spec("gpupool")
    if spec is not None and spec.origin:
        # Which build this process imports: an A/B run (tools/gpu/gpu-check.sh's ab step)
        # puts the base's first on PYTHONPATH.
        info["gpupool_from"] = os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))
    info.update(_device_info(device))
    return info


# Command line and output ----------------------------------------------------------------

SIMULATED_HELP = ("run gpupool on gpupool.testing.SimulatedDevice (no GPU needed; checks "
                  "the harness only, the numbers are not GPU numbers)")


def parser(description, columns=False, no_simulated=None, json_help=""):
    """Argument parser with the options every script takes; with ``columns`` (True, or the
    column keys, which its help then lists), ``--columns`` too (read it with
    :func:`column_keys`). A script that has no simulated run names why in
    ``no_simulated``: ``--simulated``'s help then says it skips, and why. ``json_help`` is
    added to ``--json``'s help (when the script writes it more than once, say)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH (its "
                   "folder made if missing)" + json_help)
    p.add_argument("--quick", action="store_true",
                   help="few repetitions: checks the script runs, numbers are rough")
    p.add_argument("--simulated", action="store_true",
                   help=SIMULATED_HELP if no_simulated is None else
                   f"print a skip line and exit 0: {no_simulated} (run_all.py passes the "
                   f"flag to every script)")
    if columns:
        among = "" if columns is True else f", among {', '.join(columns)}"
        p.add_argument("--columns", help=f"comma-separated column keys to run{among} "
                                         f"(default: all)")
    return p


def column_keys(p, spec, known):
    """The column keys a ``--columns`` option names.

    Parameters
    ----------
    p : argparse.ArgumentParser
        The script's parser, for the error.
    spec : str or None
        The option's value: comma-separated keys; None: every known column.
    known : list of str
        The script's column keys, in its order.

    Returns
    -------
    list of str
        ``spec``'s keys in the order given, or ``known``.

    Notes
    -----
    An unknown key, a key named twice and a value naming none end the script through
    ``p.error`` (exit status 2), naming what is wrong.
    """
    if spec is None:
        return list(known)
    wanted = spec.split(",")
    unknown = set(wanted) - set(known)
    if unknown:
        p.error(f"unknown columns {sorted(unknown)}; known: {list(known)}")
    twice = sorted({k for k in wanted if wanted.count(k) > 1})
    if twice:
        p.error(f"columns named twice: {twice}")
    return wanted


def write_json(path, obj):
    """Write ``obj`` as indented JSON to ``path``, creating its folder."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def finish(out, start, report, json_path=None):
    """End a script's run: the report, the elapsed-time line, the JSON file; returns 0.

    Parameters
    ----------
    out : dict
        The results; ``out["script"]`` names the script and ``out.get("simulated")`` marks a
        run on the simulated device. ``out["elapsed_s"]`` is set here.
    start : float
        ``time.perf_counter()`` when the measurements began.
    report : callable
        ``report(out)`` -> the text to print (the script's tables).
    json_path : str, optional
        Where to write ``out`` as JSON (see :func:`write_json`); None: nowhere.
    """
    out["elapsed_s"] = time.perf_counter() - start
    print(report(out))
    print(f"\n{out['script']}: {out['elapsed_s']:.1f} s"
          + (" (simulated device)" if out.get("simulated") else ""))
    if json_path:
        write_json(json_path, out)
    return 0


def skip(script, reason, json_path=None):
    """Print the one-line skip message, write a skip record if asked, and exit 0."""
    print(f"{script}: skipped: {reason}")
    if json_path:
        write_json(json_path, {"script": script, "skipped": reason, "env": environment()})
    sys.exit(0)
