"""Run every benchmark script, collect their JSON, print their tables last.

Each script runs as a subprocess (``sys.executable``), so the frameworks' caches and CUDA
state of one do not leak into the next. Everything goes to ``--out DIR``:
``NAME.json`` (a script's results), ``NAME.txt`` (its tables), ``NAME.log`` (its progress and
errors), ``NAME.png`` (its plot: region_memory draws its own, ``plots.py`` the latency,
threads and trace-replay ones) and ``results.json`` (all of
them, with the environment). With ``--repeat 2`` the latency and throughput scripts run
twice (the second run's files are ``NAME.2.*``) and the spread of every median between the two
runs is printed last. Run::

    python bench/run_all.py --out /tmp/bench [--quick] [--only alloc_latency,...] [--repeat 2]

Exits 0 with a one-line skip message when there is no GPU; 1 when a script failed.
"""

import json
import os
import subprocess
import sys
import threading
import time

import _common
import plots

HERE = os.path.dirname(os.path.abspath(__file__))
# (script, timeout in seconds). Seen on an H200: alloc_latency ~25 s, cross_stream ~10 s.
# Estimated: threads ~20 s, trace_replay well under a minute.
# real_models: about 15-25 s per (model, allocator), 21 pairs (seen on an H200, 2026-12-01).
# Estimated: sleep_cycle well under a minute (pinning 2 x 10 GiB, then seconds of copies).
SCRIPTS = [("alloc_latency", 240), ("cross_stream", 120), ("capi_latency", 120),
           ("threads", 180), ("trace_replay", 180), ("fragmentation", 60), ("ipc", 120),
           ("region_memory", 240), ("real_models", 900), ("rmm_resource", 120),
           ("sleep_cycle", 300)]
# Scripts that ``--repeat N`` runs N times (the latency and throughput ones), for the spread
# of the same code's medians between runs.
REPEATABLE = ("alloc_latency", "cross_stream", "capi_latency", "threads", "rmm_resource")
# Scripts that draw a plot: each gets ``--plot OUT/NAME.png``.
PLOTTING = {"region_memory", "real_models"}


def _tee(pipe, sink, lines):
    """Read a subprocess pipe line by line into ``lines``, echoing to ``sink`` if given."""
    for line in pipe:
        if sink is not None:
            sink.write(line)
            sink.flush()
        lines.append(line)


def run_script(name, timeout, out_dir, flags, label=None):
    """Run one script; returns its record: rc, seconds, stdout, and its JSON (or an error).

    Its files are ``out_dir/LABEL.{json,txt,log}`` (``label`` defaults to ``name``).
    """
    label = label or name
    json_path = os.path.join(out_dir, f"{label}.json")
    if os.path.exists(json_path):
        os.remove(json_path)
    cmd = [sys.executable, os.path.join(HERE, f"{name}.py"), "--json", json_path, *flags]
    if name in PLOTTING:
        cmd += ["--plot", os.path.join(out_dir, f"{name}.png")]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, log = [], []
    readers = [threading.Thread(target=_tee, args=(proc.stdout, None, out), daemon=True),
               threading.Thread(target=_tee, args=(proc.stderr, sys.stderr, log), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        log.append(f"run_all: {name} killed after {timeout} s\n")
        print(log[-1], end="", file=sys.stderr)
    for reader in readers:
        reader.join(timeout=5)
    stdout = "".join(out)
    record = {"rc": proc.returncode, "seconds": time.perf_counter() - start, "stdout": stdout}
    for suffix, text in ((".txt", stdout), (".log", "".join(log))):
        with open(os.path.join(out_dir, label + suffix), "w", encoding="utf-8") as f:
            f.write(text)
    try:
        with open(json_path, encoding="utf-8") as f:
            record["results"] = json.load(f)
    except (OSError, ValueError) as exc:
        record["error"] = f"no JSON from {name}: {exc}"
    if proc.returncode != 0:
        record["error"] = f"{name} exited with {proc.returncode}; see {label}.log"
    return record


def medians(obj, path=()):
    """Yield ``(path, value)`` for every dict with a numeric ``median`` in a script's JSON."""
    if isinstance(obj, dict):
        if isinstance(obj.get("median"), int | float):
            yield path, obj["median"]
        for key, value in obj.items():
            if key != "median":
                yield from medians(value, (*path, key))


def _label(path):
    """A row label from a JSON path: structural keys dropped, sizes and thread counts named."""
    parts = []
    for key in path:
        if key in ("columns", "results", "ops_per_s"):
            continue
        if key.isdigit():
            count = int(key)
            key = (_common.format_size(count) if count >= 256 else
                   f"{count} thread" + ("s" if count > 1 else ""))
        parts.append(key)
    return " ".join(parts)


def spread(runs):
    """Rows ``[label, median of run 1, ..., run N, spread]`` for the medians found at the same
    place in every run's JSON; spread = (largest - smallest) / smallest."""
    found = [dict(medians(r)) for r in runs]
    rows = []
    for path, first in found[0].items():
        values = [first] + [f.get(path) for f in found[1:]]
        if any(v is None for v in values):
            continue
        low, high = min(values), max(values)
        rel = (high - low) / low if low > 0 else None
        rows.append({"row": _label(path), "medians": values, "spread": rel})
    return rows


def spread_table(name, rows):
    """The printed table of :func:`spread`'s rows for one script."""
    runs = len(rows[0]["medians"]) if rows else 0
    body = [[r["row"], *(_common.format_ns(v) for v in r["medians"]),
             "-" if r["spread"] is None else f"{r['spread']:.1%}"] for r in rows]
    worst = max((r["spread"] for r in rows if r["spread"] is not None), default=None)
    title = (f"{name}: the same code run {runs} times, median of each run and their spread "
             "(largest - smallest) / smallest" + ("" if worst is None else
                                                  f"; worst {worst:.1%}"))
    return _common.format_table(["row", *(f"run {i + 1}" for i in range(runs)), "spread"],
                                body, title)


def main(argv=None):
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(HERE, "out"), metavar="DIR",
                   help="folder for the results (default: bench/out)")
    p.add_argument("--only", help="comma-separated script names (default: all)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run the latency and throughput scripts (" + ", ".join(REPEATABLE) +
                        ") N times, all of them once before any again, and print the spread "
                        "of each median between the runs (default: 1)")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    names = [n for n, _ in SCRIPTS]
    wanted = args.only.split(",") if args.only else names
    if set(wanted) - set(names):
        p.error(f"unknown scripts {sorted(set(wanted) - set(names))}; known: {names}")
    if not args.simulated:
        _, reason = _common.gpu_pool()
        if reason is not None:
            _common.skip("run_all", reason,
                         os.path.join(args.out, "results.json") if args.json is None
                         else args.json)
    os.makedirs(args.out, exist_ok=True)
    flags = [f for f, on in (("--quick", args.quick), ("--simulated", args.simulated)) if on]
    start = time.perf_counter()
    records, repeats = {}, {}
    for run in range(args.repeat):
        for name, timeout in SCRIPTS:
            if name not in wanted or (run and name not in REPEATABLE):
                continue
            label = name if run == 0 else f"{name}.{run + 1}"
            print(f"run_all: {label} ...", file=sys.stderr, flush=True)
            records[label] = run_script(name, timeout, args.out, flags, label)
            repeats.setdefault(name, []).append(records[label])
            print(f"run_all: {label}: rc {records[label]['rc']}, "
                  f"{records[label]['seconds']:.1f} s", file=sys.stderr, flush=True)
    spreads = {name: spread([r["results"] for r in runs]) for name, runs in repeats.items()
               if len(runs) > 1 and all("results" in r for r in runs)}
    summary = {"env": _common.environment(), "flags": flags, "repeat": args.repeat,
               "elapsed_s": time.perf_counter() - start,
               "scripts": {n: {k: v for k, v in r.items() if k != "stdout"}
                           for n, r in records.items()},
               "spread": spreads}
    _common.write_json(args.json or os.path.join(args.out, "results.json"), summary)
    plotted, unplotted = plots.write_all(summary, args.out)
    failed = [n for n, r in records.items() if "error" in r]
    for name, runs in repeats.items():
        print(f"\n===== {name} =====\n{runs[0]['stdout'].rstrip()}")
    for name, rows in spreads.items():
        print(f"\n===== spread: {name} =====\n{spread_table(name, rows)}")
    for line in [f"plot: {p}" for p in plotted] + [f"no plot: {w}" for w in unplotted]:
        print(line)
    print(f"\nrun_all: {len(records)} scripts in {summary['elapsed_s']:.0f} s; results in "
          f"{os.path.abspath(args.out)}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
