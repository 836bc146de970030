"""Run every benchmark script, collect their JSON, print their tables last.

Each script runs as a subprocess (``sys.executable``), so the frameworks' caches and CUDA
state of one do not leak into the next. Everything goes to ``--out DIR``:
``NAME.json`` (a script's results), ``NAME.txt`` (its tables), ``NAME.log`` (its progress and
errors), ``NAME.png`` (its plot, for the scripts that draw one) and ``results.json`` (all of
them, with the environment). Run::

    python bench/run_all.py --out /tmp/bench [--quick] [--only alloc_latency,...]

Exits 0 with a one-line skip message when there is no GPU; 1 when a script failed.
"""

import json
import os
import subprocess
import sys
import threading
import time

import _common

HERE = os.path.dirname(os.path.abspath(__file__))
# (script, timeout in seconds). Seen on an H200: alloc_latency ~25 s, cross_stream ~10 s.
SCRIPTS = [("alloc_latency", 240), ("cross_stream", 120), ("capi_latency", 120),
           ("region_memory", 240)]
# Scripts that draw a plot: each gets ``--plot OUT/NAME.png``.
PLOTTING = {"region_memory"}


def _tee(pipe, sink, lines):
    """Read a subprocess pipe line by line into ``lines``, echoing to ``sink`` if given."""
    for line in pipe:
        if sink is not None:
            sink.write(line)
            sink.flush()
        lines.append(line)


def run_script(name, timeout, out_dir, flags):
    """Run one script; returns its record: rc, seconds, stdout, and its JSON (or an error)."""
    json_path = os.path.join(out_dir, f"{name}.json")
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
        with open(os.path.join(out_dir, name + suffix), "w", encoding="utf-8") as f:
            f.write(text)
    try:
        with open(json_path, encoding="utf-8") as f:
            record["results"] = json.load(f)
    except (OSError, ValueError) as exc:
        record["error"] = f"no JSON from {name}: {exc}"
    if proc.returncode != 0:
        record["error"] = f"{name} exited with {proc.returncode}; see {name}.log"
    return record


def main(argv=None):
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(HERE, "out"), metavar="DIR",
                   help="folder for the results (default: bench/out)")
    p.add_argument("--only", help="comma-separated script names (default: all)")
    args = p.parse_args(argv)
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
    records = {}
    for name, timeout in SCRIPTS:
        if name in wanted:
            print(f"run_all: {name} ...", file=sys.stderr, flush=True)
            records[name] = run_script(name, timeout, args.out, flags)
            print(f"run_all: {name}: rc {records[name]['rc']}, "
                  f"{records[name]['seconds']:.1f} s", file=sys.stderr, flush=True)
    summary = {"env": _common.environment(), "flags": flags,
               "elapsed_s": time.perf_counter() - start,
               "scripts": {n: {k: v for k, v in r.items() if k != "stdout"}
                           for n, r in records.items()}}
    _common.write_json(args.json or os.path.join(args.out, "results.json"), summary)
    failed = [n for n, r in records.items() if "error" in r]
    for name, record in records.items():
        print(f"\n===== {name} =====\n{record['stdout'].rstrip()}")
    print(f"\nrun_all: {len(records)} scripts in {summary['elapsed_s']:.0f} s; results in "
          f"{os.path.abspath(args.out)}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
