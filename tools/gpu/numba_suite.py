"""numba-cuda's own tests under Numba's default memory manager and under gpupool's EMM plugin
(``NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba``) on each of its upstreams: no test may fail under
gpupool that passes under the default, beyond the known limits named below.

    python tools/gpu/numba_suite.py [--modules M,M,...] [--runs R,R,...] [--timeout S]
                                    [--json PATH] [--log-dir DIR] [--parallel]

The runs (``RUNS``): ``default`` (Numba's own manager), ``gpupool`` (gpupool's pool on its
default upstream, expandable segments: cuMemCreate memory) and ``gpupool-driver``
(``GPUPOOL_UPSTREAM=driver``: cuMemAlloc memory, where Numba's own ``cuIpcGetMemHandle`` path
works); ``--runs`` picks some of them, the default among them.

Each run gets a fresh process of this script in ``child`` mode, which runs the modules with
unittest (numba-cuda's tests are unittest TestCases; under pytest their classes ask for a
fixture defined in the conftest.py of numba-cuda's source tree, which the wheel does not ship)
and appends a JSON line to a record file as each test starts and ends. A run that crashes or
runs past its timeout so keeps the outcomes so far and names the test that was running
(outcome ``crash`` or ``timeout``). numba-cuda's test support imports ``filecheck``: without it
every module fails to import, under every manager.

The table gives the outcomes per run and, for each gpupool run against the default, the tests
that fail only under gpupool (the criterion: none), those of them a known limit of the run's
upstream explains (``KNOWN_LIMITS``: listed apart, by design), those failing under both and
only under the default. Exit status: 0 when no gpupool run has a test failing only under it
other than by a known limit, and every run finished with the manager and upstream asked for;
1 when some gpupool run has such a test; 2 when a run did not finish (crash, timeout), passed
no test (numba-cuda or the GPU missing) or ran under another manager or upstream.
"""

import argparse
import functools
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
import unittest
from collections import Counter
from typing import NamedTuple

# The memory-management parts of numba-cuda's tests: the driver layer whole, and the
# array, __cuda_array_interface__, IPC, stream and threading parts of the kernel tests.
DEFAULT_MODULES = (
    "numba.cuda.tests.cudadrv",
    "numba.cuda.tests.cudapy.test_array",
    "numba.cuda.tests.cudapy.test_cuda_array_interface",
    "numba.cuda.tests.cudapy.test_ipc",
    "numba.cuda.tests.cudapy.test_stream_api",
    "numba.cuda.tests.cudapy.test_device_array_capture",
    "numba.cuda.tests.cudapy.test_multithreads",
)
GPUPOOL = "gpupool.numba"                    # the plugin's NUMBA_CUDA_MEMORY_MANAGER value


class Run(NamedTuple):
    """A run of the tests: ``manager``, the NUMBA_CUDA_MEMORY_MANAGER value; ``env``, more
    environment variables of its child (name -> value, None: removed); ``upstream``, the name
    of the upstream gpupool's pool must take memory from (None where the manager is Numba's)."""
    manager: str
    env: dict
    upstream: str | None


# Run name -> Run; "default" is the one each gpupool run is compared with.
RUNS = {
    "default": Run("default", {}, None),
    # The pool's default upstream (Note [Default upstream]): expandable segments.
    "gpupool": Run(GPUPOOL, {"GPUPOOL_UPSTREAM": None}, "vmm"),
    "gpupool-driver": Run(GPUPOOL, {"GPUPOOL_UPSTREAM": "driver"}, "driver"),
}


class KnownLimit(NamedTuple):
    """Tests that fail under gpupool on one upstream by design: ``name`` (of the constant),
    ``upstream``, ``where`` (the upstream in words, for the table), ``tests`` (unittest ids)
    and ``reason``."""
    name: str
    upstream: str
    where: str
    tests: tuple
    reason: str


VMM_IPC_LEGACY_HANDLE = KnownLimit(
    "VMM_IPC_LEGACY_HANDLE", "vmm", "on expandable segments",
    ("numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle",),
    "the test sends only handle.reserved and rebuilds a 64-byte legacy CUipcMemHandle for "
    "cuIpcOpenMemHandle, which no export of cuMemCreate memory fits (Note [Numba IPC on "
    "expandable segments]); the gpupool-driver run checks Numba's legacy IPC path")
KNOWN_LIMITS = (VMM_IPC_LEGACY_HANDLE,)
OUTCOMES = ("pass", "fail", "error", "skip", "xfail", "xpass", "crash", "timeout")
FAILING = frozenset({"fail", "error", "xpass", "crash", "timeout"})
DETAIL_CHARS = 2000         # of a failure's traceback kept in the record (its end)


# The child: unittest with a result that records each test as it goes -----------------------

class RecordingResult(unittest.TextTestResult):
    """unittest's verbose result that also appends JSON lines to ``record`` (a text file
    opened for appending): ``{"event": "start", "test": id}`` before each test and
    ``{"event": "end", "test": id, "outcome": ..., "detail": ...}`` after it, flushed."""

    def __init__(self, stream, descriptions, verbosity, *, record, **kwargs):
        super().__init__(stream, descriptions, verbosity, **kwargs)
        self._record = record
        self._outcome = None
        self._detail = ""

    def _write(self, **event):
        self._record.write(json.dumps(event) + "\n")
        self._record.flush()

    def _set(self, outcome, err=None, detail=""):
        # A failing subtest makes the test fail; a later pass of the test does not undo it.
        if self._outcome in FAILING and outcome not in FAILING:
            return
        self._outcome = outcome
        if err is not None:
            detail += "".join(traceback.format_exception(*err))
        self._detail = detail[-DETAIL_CHARS:]

    def startTest(self, test):
        super().startTest(test)
        self._outcome, self._detail = None, ""
        self._write(event="start", test=test.id())

    def stopTest(self, test):
        super().stopTest(test)
        self._write(event="end", test=test.id(), outcome=self._outcome or "pass",
                    detail=self._detail)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._set("pass")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._error_outside_a_test(test, "fail", err)

    def addError(self, test, err):
        super().addError(test, err)
        self._error_outside_a_test(test, "error", err)

    def _error_outside_a_test(self, test, outcome, err):
        # setUpClass/setUpModule errors come on a stand-in that never starts or stops.
        if isinstance(test, unittest.TestCase):
            self._set(outcome, err)
        else:
            self._write(event="end", test=str(test), outcome=outcome,
                        detail="".join(traceback.format_exception(*err))[-DETAIL_CHARS:])

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        if isinstance(test, unittest.TestCase):
            self._set("skip", detail=reason)
        else:
            self._write(event="end", test=str(test), outcome="skip", detail=reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._set("xfail")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._set("xpass", detail="unexpected success")

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            failed = issubclass(err[0], test.failureException)
            self._set("fail" if failed else "error", err, detail=f"{subtest}\n")


def numpy_aliases():
    """Give NumPy back the aliases numba-cuda still names: numba-cuda 0.30 registers an
    overload for ``np.row_stack`` (removed in NumPy 2.5) when it first compiles a kernel, so
    without it every test that compiles one errors under both managers (tests/conftest.py does
    the same for gpupool's own tests). Returns the names added."""
    import numpy as np

    added = []
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack
        added.append("row_stack")
    return added


def upstream_name(upstream, names):
    """The name of ``upstream`` (a gpupool ``Upstream``) in ``names`` (name -> class, as
    ``gpupool.core.upstreams.UPSTREAMS``), matching its class exactly; else its class's name."""
    return next((name for name, kind in names.items() if type(upstream) is kind),
                type(upstream).__name__)


def pool_upstream():
    """The name of the upstream of gpupool's default pool of the current device (made now if
    the tests made none), where the manager is gpupool.numba and gpupool was imported (Numba
    imports the plugin as it makes its first context); else None. A pool that cannot be had
    gives ``"unknown (Error: message)"``."""
    if os.environ.get("NUMBA_CUDA_MEMORY_MANAGER") != GPUPOOL or "gpupool" not in sys.modules:
        return None
    import gpupool
    from gpupool.core.upstreams import UPSTREAMS

    try:
        upstream = gpupool.get_pool().upstream
    except Exception as exc:        # no driver or device: recorded, and run_problems names it
        return f"unknown ({type(exc).__name__}: {exc})"
    return upstream_name(upstream, UPSTREAMS)


def run_child(record_path, names):
    """Run the tests ``names`` (modules, classes or methods) with unittest, verbose output on
    stderr, recording into ``record_path``; the process's exit status is 0 when all passed."""
    with open(record_path, "a") as record:
        record.write(json.dumps({"event": "begin", "manager": os.environ.get(
            "NUMBA_CUDA_MEMORY_MANAGER", "default"), "names": list(names),
            "pid": os.getpid()}) + "\n")
        record.flush()
        numpy_aliases()
        suite = unittest.defaultTestLoader.loadTestsFromNames(names)
        runner = unittest.TextTestRunner(
            stream=sys.stderr, verbosity=2,
            resultclass=functools.partial(RecordingResult, record=record))
        result = runner.run(suite)
        driver = sys.modules.get("numba.cuda.cudadrv.driver")
        installed = getattr(driver, "_memory_manager", None)
        record.write(json.dumps({"event": "done", "tests_run": result.testsRun,
                                 "memory_manager": getattr(installed, "__name__", None),
                                 "upstream": pool_upstream()}) + "\n")
    return 0 if result.wasSuccessful() else 1


# The parent: one child per manager, their records compared ----------------------------------

def read_record(lines, *, timed_out=False):
    """The outcome of a run from its record's lines.

    Parameters
    ----------
    lines : iterable of str
        JSON lines as :class:`RecordingResult` writes them (a last line cut short by a crash
        is ignored).
    timed_out : bool
        Whether the parent killed the child at its timeout.

    Returns
    -------
    dict
        ``tests``: test id -> ``{"outcome", "detail"}`` (a test started and never ended gets
        ``timeout`` when ``timed_out``, else ``crash``); ``finished``: whether the child
        reached its end; ``manager``: the NUMBA_CUDA_MEMORY_MANAGER it saw;
        ``memory_manager``: the name of the class Numba installed (None before a context);
        ``upstream``: the upstream of gpupool's pool at the end (as :func:`pool_upstream`).
    """
    tests, running = {}, None
    run = {"tests": tests, "finished": False, "manager": None, "memory_manager": None,
           "upstream": None}
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        kind = event.get("event")
        if kind == "begin":
            run["manager"] = event["manager"]
        elif kind == "start":
            running = event["test"]
        elif kind == "end":
            tests[event["test"]] = {"outcome": event["outcome"], "detail": event["detail"]}
            if running == event["test"]:
                running = None
        elif kind == "done":
            run["finished"] = True
            run["memory_manager"] = event["memory_manager"]
            run["upstream"] = event.get("upstream")
    if running is not None:
        tests[running] = {"outcome": "timeout" if timed_out else "crash", "detail":
                          "the run was killed at its timeout" if timed_out else
                          "the process died during this test"}
    return run


def counts(tests):
    """Tests per outcome, every outcome of OUTCOMES present (0 where none)."""
    found = Counter(t["outcome"] for t in tests.values())
    return {outcome: found.get(outcome, 0) for outcome in OUTCOMES}


def compare(default, gpupool):
    """The tests whose outcomes differ in kind between the runs (test id -> ``{"outcome",
    "detail"}`` each): sorted lists of ids.

    ``gpupool_only``: failing under gpupool, not under the default (passed, skipped, or not
    run there); ``both``: failing under both; ``default_only``: failing only under the
    default; ``skipped_only_under_gpupool``: skipped under gpupool, run under the default
    (tests numba-cuda limits to its own manager).
    """
    def failing(tests, name):
        return name in tests and tests[name]["outcome"] in FAILING

    names = sorted(set(default) | set(gpupool))
    return {
        "gpupool_only": [n for n in names if failing(gpupool, n) and not failing(default, n)],
        "both": [n for n in names if failing(gpupool, n) and failing(default, n)],
        "default_only": [n for n in names if failing(default, n) and not failing(gpupool, n)],
        "skipped_only_under_gpupool": [
            n for n in names if gpupool.get(n, {}).get("outcome") == "skip"
            and n in default and default[n]["outcome"] != "skip"],
    }


def compare_runs(runs, limits):
    """Each gpupool run of ``runs`` (run name, a key of RUNS -> run as :func:`read_record`
    gives; "default" among them) against the default: run name -> :func:`compare`'s lists,
    the tests of ``gpupool_only`` that a known limit of the run's upstream names taken out
    into ``by_design`` (the name of each such limit in ``limits``, KnownLimits -> the sorted
    ids of its tests failing only under the run, [] if none)."""
    default, diffs = runs["default"]["tests"], {}
    for name, run in runs.items():
        if name == "default":
            continue
        diff = compare(default, run["tests"])
        mine = [limit for limit in limits if limit.upstream == RUNS[name].upstream]
        diff["by_design"] = {limit.name: [n for n in diff["gpupool_only"] if n in limit.tests]
                             for limit in mine}
        explained = {n for tests in diff["by_design"].values() for n in tests}
        diff["gpupool_only"] = [n for n in diff["gpupool_only"] if n not in explained]
        diffs[name] = diff
    return diffs


def run_problems(runs):
    """Why the comparison of ``runs`` (run name, a key of RUNS -> run as :func:`read_record`
    gives, with ``rc``) cannot be trusted: a run that did not finish, in which no test passed
    (numba-cuda or the GPU missing), that saw another manager, or whose gpupool pool took
    memory from another upstream than its Run names (checked where Numba made a context or
    the child found a pool); [] if none."""
    problems = []
    for name, run in runs.items():
        want = RUNS[name]
        if not run["finished"]:
            problems.append(f"{name}: the run did not finish (rc={run['rc']})")
        if run["manager"] != want.manager:
            problems.append(f"{name}: ran with NUMBA_CUDA_MEMORY_MANAGER={run['manager']}, "
                            f"not {want.manager}")
        if not any(test["outcome"] == "pass" for test in run["tests"].values()):
            failed = [test["detail"] for test in run["tests"].values() if test["detail"]]
            problems.append(f"{name}: no test passed, so nothing was compared (it needs "
                            f"numba-cuda and a GPU){': ' + _why(failed[0]) if failed else ''}")
        seen = run["memory_manager"] is not None or run["upstream"] is not None
        if seen and run["upstream"] != want.upstream:
            problems.append(f"{name}: gpupool's pool took memory from upstream "
                            f"{run['upstream']}, not {want.upstream}")
    return problems


def suite_status(diffs, problems):
    """The exit status: 1 when a gpupool run has a test failing only under it that no known
    limit explains (``diffs`` as :func:`compare_runs` gives), else 2 when ``problems``
    (:func:`run_problems`), else 0."""
    if any(diff["gpupool_only"] for diff in diffs.values()):
        return 1
    return 2 if problems else 0


# The line of a traceback that names the exception ("pkg.SomeError: message").
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*:")


def _why(detail):
    """The exception line of a traceback (its last), else its last non-empty line."""
    lines = [line.strip() for line in detail.splitlines() if line.strip()]
    named = [line for line in lines if _EXCEPTION_LINE.match(line)]
    return (named or lines or [""])[-1]


def _environment(name):
    """The environment of run ``name`` in words."""
    words = [f"NUMBA_CUDA_MEMORY_MANAGER={RUNS[name].manager}"]
    words += [f"{key} unset" if value is None else f"{key}={value}"
              for key, value in RUNS[name].env.items()]
    return ", ".join(words)


def format_report(runs, diffs, limits):
    """The table: outcomes per run, each run's environment, the known ``limits``, then for each
    gpupool run (``diffs`` as :func:`compare_runs` gives with ``limits``) the tests in each of
    its lists."""
    width = max(len(o) for o in OUTCOMES)
    name_width = max(len("run"), *map(len, runs))
    lines = [f"{'run':<{name_width}} " + " ".join(f"{o:>{width}}" for o in OUTCOMES)
             + "   total  seconds  rc"]
    for name, run in runs.items():
        row = counts(run["tests"])
        lines.append(f"{name:<{name_width}} " + " ".join(f"{row[o]:>{width}}" for o in OUTCOMES)
                     + f" {len(run['tests']):>7} {run['seconds']:>8.0f} {run['rc']:>3}"
                     + ("" if run["finished"] else "  (did not finish)"))
    for name, run in runs.items():
        pool = "" if run["upstream"] is None else f", the pool's upstream: {run['upstream']}"
        lines.append(f"{name}: {_environment(name)}; Numba's manager class at the end: "
                     f"{run['memory_manager']}{pool}")
    lines += [f"known limit {limit.name} (upstream {limit.upstream}): {', '.join(limit.tests)}: "
              f"{limit.reason}" for limit in limits]
    by_name = {limit.name: limit for limit in limits}
    for name, diff in diffs.items():
        upstream = f"(upstream {RUNS[name].upstream})"
        lists = [(f"fail only under gpupool {upstream}, must be none", diff["gpupool_only"])]
        lists += [(f"fail only under gpupool {by_name[key].where}, by design ({key})", tests)
                  for key, tests in diff["by_design"].items()]
        lists += [(f"fail under both, gpupool {upstream}", diff["both"]),
                  (f"fail only under the default, not gpupool {upstream}", diff["default_only"]),
                  (f"skipped only under gpupool {upstream}", diff["skipped_only_under_gpupool"])]
        for title, tests in lists:
            lines.append(f"{title}: {len(tests)}")
            for test in tests:
                outcomes = ", ".join(f"{run_name} {run['tests'].get(test, {}).get('outcome', '-')}"
                                     for run_name, run in runs.items())
                details = [runs[n]["tests"].get(test, {}).get("detail", "")
                           for n in (name, "default")]
                why = _why(next((d for d in details if d), ""))
                lines.append(f"  {test}  [{outcomes}]  {why[:160]}")
    return "\n".join(lines)


def start_run(name, modules, log_dir):
    """Start the child for run ``name`` (a key of RUNS) in a session of its own, in its Run's
    environment; its record and log go to ``log_dir``/``name``.jsonl and .log. Returns (Popen,
    record path)."""
    record = os.path.join(log_dir, f"{name}.jsonl")
    log = os.path.join(log_dir, f"{name}.log")
    open(record, "w").close()
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER=RUNS[name].manager, **RUNS[name].env)
    env = {key: value for key, value in env.items() if value is not None}
    with open(log, "w") as out:
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "child", record,
                                  *modules], stdout=out, stderr=subprocess.STDOUT,
                                 env=env, start_new_session=True)
    return child, record


def finish_run(child, record, timeout, started):
    """Wait for ``child`` until ``timeout`` seconds after ``started`` (time.monotonic()),
    killing its session (with the processes its tests started) past that; the run as
    :func:`read_record` gives it, with ``rc`` and ``seconds``."""
    timed_out = False
    try:
        rc = child.wait(timeout=max(0.0, started + timeout - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(child.pid, signal.SIGKILL)
        rc = child.wait()
    with open(record) as lines:
        run = read_record(lines, timed_out=timed_out)
    run.update(rc=rc, seconds=time.monotonic() - started)
    return run


def parse_runs(text):
    """The runs ``text`` names (comma-separated keys of RUNS), in RUNS's order.

    Raises
    ------
    ValueError
        A name that is not in RUNS, one named twice, or no "default" and gpupool run to
        compare.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise ValueError(f"--runs: no run {', '.join(unknown)}; the runs: {', '.join(RUNS)}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--runs names {', '.join(twice)} more than once")
    if "default" not in names or len(names) < 2:
        raise ValueError(f"--runs must name default and a gpupool run, not {text!r}")
    return [n for n in RUNS if n in names]


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog="It needs numba-cuda (and its test support's filecheck) and an NVIDIA GPU. Exit "
               "status: 0 when no gpupool run has a test failing only under it beyond the "
               "known limits it lists; 1 when one has; 2 when the runs cannot be compared (a "
               "run did not finish, passed no test, or ran under another manager or "
               "upstream).")
    parser.add_argument("--modules", default=",".join(DEFAULT_MODULES),
                        help="comma-separated test modules, classes or methods (default: "
                             "%(default)s)")
    parser.add_argument("--runs", default=",".join(RUNS),
                        help="comma-separated runs, default and one or more gpupool runs "
                             "(default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=240,
                        help="seconds each run may take (default %(default)s)")
    parser.add_argument("--json", help="write the runs and the comparison here")
    parser.add_argument("--log-dir", default="/tmp/gpupool-numba-suite",
                        help="each run's log and record (default %(default)s)")
    parser.add_argument("--parallel", action="store_true",
                        help="start all the runs at once (one process each on the one GPU)")
    args = parser.parse_args(argv)
    modules = [m.strip() for m in args.modules.split(",") if m.strip()]
    if not modules:
        parser.error("--modules names no test module")
    try:
        names = parse_runs(args.runs)
    except ValueError as exc:
        parser.error(str(exc))
    if args.timeout <= 0:
        parser.error(f"--timeout must be > 0 seconds, not {args.timeout}")
    if any(m.split(".")[0] == "numba" for m in modules) and \
            importlib.util.find_spec("numba") is None:
        print("numba_suite: numba-cuda is not installed, so no run can compare anything "
              "(pip install numba-cuda; its tests also need filecheck and an NVIDIA GPU)",
              file=sys.stderr)
        return 2
    os.makedirs(args.log_dir, exist_ok=True)

    runs, children = {}, {}
    try:
        if args.parallel:
            started = time.monotonic()
            children = {name: start_run(name, modules, args.log_dir) for name in names}
            for name, (child, record) in children.items():
                runs[name] = finish_run(child, record, args.timeout, started)
        else:
            for name in names:
                started = time.monotonic()
                children[name] = start_run(name, modules, args.log_dir)
                runs[name] = finish_run(*children[name], args.timeout, started)
    finally:
        # Stopped early (an exception, or SIGTERM from an outer timeout): no run outlives it.
        for child, _ in children.values():
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    diffs = compare_runs(runs, KNOWN_LIMITS)
    problems = run_problems(runs)
    status = suite_status(diffs, problems)
    print(f"numba-cuda tests: {', '.join(modules)}")
    print(format_report(runs, diffs, KNOWN_LIMITS))
    for problem in problems:
        print("NOT COMPARABLE:", problem)
    if args.json:
        tally = {name: {"gpupool_only": len(diff["gpupool_only"]), "by_design": sum(
            map(len, diff["by_design"].values()))} for name, diff in diffs.items()}
        with open(args.json, "w") as out:
            json.dump({"modules": modules, "runs": runs, "comparisons": diffs, "counts": tally,
                       "known_limits": [limit._asdict() for limit in KNOWN_LIMITS],
                       "problems": problems, "status": status}, out, indent=1)
    return status


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        if len(sys.argv) < 4:
            sys.exit("usage: numba_suite.py child RECORD NAME [NAME ...]")
        sys.exit(run_child(sys.argv[2], sys.argv[3:]))
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main())
