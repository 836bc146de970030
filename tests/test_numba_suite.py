"""tools/gpu/numba_suite.py without numba-cuda: its record of canned unittest modules run under
each run's environment (manager, upstream; outcomes, subtests, class set-up errors, a crash and
a timeout), the upstream a child's pool used, the comparison of each gpupool run with the
default, the known limits, the table and the exit status; the record's parser on canned lines;
the choice of runs."""

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO

_spec = importlib.util.spec_from_file_location(
    "numba_suite", REPO / "tools" / "gpu" / "numba_suite.py")
numba_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(numba_suite)

# Canned numba-cuda tests: what each does depends on the manager the run names.
HEADER = '''
import os
import time
import unittest

GPUPOOL = os.environ["NUMBA_CUDA_MEMORY_MANAGER"] == "gpupool.numba"
DRIVER = GPUPOOL and os.environ.get("GPUPOOL_UPSTREAM") == "driver"
'''

CANNED = HEADER + '''

class TestCanned(unittest.TestCase):
    def test_passes(self):
        pass

    def test_fails_under_gpupool(self):
        self.assertFalse(GPUPOOL, "an assertion that gpupool breaks")

    def test_errors_under_gpupool(self):
        if GPUPOOL:
            raise AttributeError("'CUdevice' object has no attribute 'id'")

    def test_fails_under_both(self):
        self.assertEqual(1, 2)

    def test_fails_under_the_default(self):
        self.assertTrue(GPUPOOL)

    def test_fails_only_on_expandable_segments(self):
        self.assertFalse(GPUPOOL and not DRIVER, "a limit of cuMemCreate memory")

    def test_fails_only_on_the_driver_upstream(self):
        self.assertFalse(DRIVER, "a bug of the driver upstream")

    @unittest.skipIf(GPUPOOL, "Deallocation specific to Numba memory management")
    def test_skipped_under_gpupool(self):
        pass

    @unittest.skip("skipped under both")
    def test_skipped_under_both(self):
        pass

    @unittest.expectedFailure
    def test_expected_failure(self):
        self.assertTrue(False)

    def test_subtest_fails_under_gpupool(self):
        for i in range(3):
            with self.subTest(i=i):
                self.assertFalse(GPUPOOL and i == 1)


class TestSetUpClassErrorsUnderGpupool(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if GPUPOOL:
            raise RuntimeError("no context")

    def test_in_the_class(self):
        pass
'''

ENDS = HEADER + '''

class TestEnds(unittest.TestCase):
    def test_a_first(self):
        pass

    def test_b_dies_under_gpupool(self):
        if GPUPOOL and os.environ.get("CANNED_END") == "crash":
            os._exit(3)
        if GPUPOOL and os.environ.get("CANNED_END") == "hang":
            time.sleep(600)

    def test_c_after(self):
        pass
'''


@pytest.fixture
def canned(tmp_path, monkeypatch):
    """The canned modules importable by the runs' children; the log directory."""
    (tmp_path / "canned_tests.py").write_text(CANNED)
    (tmp_path / "canned_ends.py").write_text(ENDS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return tmp_path


def _suite(canned, *args):
    out = canned / "suite.json"
    status = numba_suite.main(["--log-dir", str(canned / "logs"), "--json", str(out), *args])
    return status, json.loads(out.read_text())


CASE = "canned_tests.TestCanned."
# A known limit of the vmm upstream, as VMM_IPC_LEGACY_HANDLE, naming a canned test.
CANNED_LIMIT = numba_suite.KnownLimit(
    "CANNED_LIMIT", "vmm", "on expandable segments",
    (CASE + "test_fails_only_on_expandable_segments",), "cuMemCreate memory cannot do it")
GPUPOOL_ONLY = [CASE + "test_errors_under_gpupool", CASE + "test_fails_under_gpupool",
                CASE + "test_subtest_fails_under_gpupool",
                "setUpClass (canned_tests.TestSetUpClassErrorsUnderGpupool)"]


@pytest.mark.parametrize("parallel", [False, True])
def test_tests_that_fail_only_under_gpupool_are_named_and_fail_the_run(canned, capsys,
                                                                       monkeypatch, parallel):
    monkeypatch.setattr(numba_suite, "KNOWN_LIMITS", (CANNED_LIMIT,))
    monkeypatch.setenv("GPUPOOL_UPSTREAM", "driver")    # the gpupool run removes it
    status, result = _suite(canned, "--modules", "canned_tests", "--timeout", "120",
                            *(["--parallel"] if parallel else []))
    table = capsys.readouterr().out
    vmm, driver = result["comparisons"]["gpupool"], result["comparisons"]["gpupool-driver"]
    assert status == 1 and result["status"] == 1
    assert list(result["runs"]) == ["default", "gpupool", "gpupool-driver"]
    assert vmm["gpupool_only"] == GPUPOOL_ONLY
    assert vmm["by_design"] == {"CANNED_LIMIT": [
        CASE + "test_fails_only_on_expandable_segments"]}
    assert driver["gpupool_only"] == sorted(
        GPUPOOL_ONLY + [CASE + "test_fails_only_on_the_driver_upstream"])
    assert driver["by_design"] == {}
    assert result["counts"] == {"gpupool": {"gpupool_only": 4, "by_design": 1},
                                "gpupool-driver": {"gpupool_only": 5, "by_design": 0}}
    assert result["known_limits"][0]["name"] == "CANNED_LIMIT"
    for diff in (vmm, driver):
        assert diff["both"] == [CASE + "test_fails_under_both"]
        assert diff["default_only"] == [CASE + "test_fails_under_the_default"]
        assert diff["skipped_only_under_gpupool"] == [CASE + "test_skipped_under_gpupool"]
    assert result["problems"] == []
    runs = result["runs"]
    none = dict.fromkeys(numba_suite.OUTCOMES, 0)
    assert numba_suite.counts(runs["default"]["tests"]) == dict(none, **{
        "pass": 8, "fail": 2, "skip": 1, "xfail": 1})
    assert numba_suite.counts(runs["gpupool"]["tests"]) == dict(none, **{
        "pass": 3, "fail": 4, "error": 2, "skip": 2, "xfail": 1})
    assert numba_suite.counts(runs["gpupool-driver"]["tests"]) == dict(none, **{
        "pass": 3, "fail": 4, "error": 2, "skip": 2, "xfail": 1})
    assert [run["manager"] for run in runs.values()] == [
        "default", "gpupool.numba", "gpupool.numba"]
    assert all(run["finished"] and run["upstream"] is None for run in runs.values())
    gpupool = runs["gpupool"]
    assert "has no attribute 'id'" in gpupool["tests"][CASE + "test_errors_under_gpupool"][
        "detail"]
    assert "(i=1)" in gpupool["tests"][CASE + "test_subtest_fails_under_gpupool"]["detail"]
    assert "fail only under gpupool (upstream vmm), must be none: 4" in table
    assert "fail only under gpupool (upstream driver), must be none: 5" in table
    assert ("known limit CANNED_LIMIT (upstream vmm): canned_tests.TestCanned.test_fails_only_"
            "on_expandable_segments: cuMemCreate memory cannot do it") in table
    assert ("fail only under gpupool on expandable segments, by design (CANNED_LIMIT): 1\n"
            "  canned_tests.TestCanned.test_fails_only_on"
            "_expandable_segments  [default pass, gpupool fail, gpupool-driver pass]  "
            "AssertionError: True is not false : a limit of cuMemCreate memory") in table
    assert ("  canned_tests.TestCanned.test_fails_under_the_default  [default fail, gpupool "
            "pass, gpupool-driver pass]  AssertionError: False is not true") in table
    assert ("gpupool: NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba, GPUPOOL_UPSTREAM unset; "
            "Numba's manager class at the end: None") in table
    assert ("gpupool-driver: NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba, GPUPOOL_UPSTREAM=driver; "
            "Numba's manager class at the end: None") in table
    assert ("  canned_tests.TestCanned.test_fails_only_on_the_driver_upstream  [default pass, "
            "gpupool pass, gpupool-driver fail]  AssertionError: True is not false : a bug of "
            "the driver upstream") in table
    for name in runs:                           # each run's verbose log and record
        assert "test_passes" in (canned / "logs" / f"{name}.log").read_text()
        assert (canned / "logs" / f"{name}.jsonl").exists()


@pytest.mark.parametrize("limits, status", [((), 1), ((CANNED_LIMIT,), 0)])
def test_only_a_known_limit_of_the_vmm_upstream_excuses_a_failure(canned, monkeypatch,
                                                                   limits, status):
    monkeypatch.setattr(numba_suite, "KNOWN_LIMITS", limits)
    got, result = _suite(canned, "--modules", "canned_tests.TestCanned.test_passes,"
                         "canned_tests.TestCanned.test_fails_only_on_expandable_segments")
    assert got == result["status"] == status
    assert result["counts"]["gpupool"] == {"gpupool_only": status, "by_design": 1 - status}
    assert result["counts"]["gpupool-driver"] == {"gpupool_only": 0, "by_design": 0}


def test_a_failure_only_on_the_driver_upstream_fails_the_run(canned, monkeypatch):
    monkeypatch.setattr(numba_suite, "KNOWN_LIMITS", (CANNED_LIMIT,))
    status, result = _suite(canned, "--modules",
                            "canned_tests.TestCanned.test_fails_only_on_the_driver_upstream")
    assert status == 1
    assert result["comparisons"]["gpupool-driver"]["gpupool_only"] == [
        CASE + "test_fails_only_on_the_driver_upstream"]
    assert result["comparisons"]["gpupool"]["gpupool_only"] == []


def test_runs_picks_the_runs_in_the_table_s_order(canned):
    status, result = _suite(canned, "--modules", "canned_tests.TestCanned.test_passes",
                            "--runs", "gpupool-driver, default")
    assert status == 0 and list(result["runs"]) == ["default", "gpupool-driver"]
    assert list(result["comparisons"]) == ["gpupool-driver"]
    assert sorted(p.name for p in (canned / "logs").iterdir()) == [
        "default.jsonl", "default.log", "gpupool-driver.jsonl", "gpupool-driver.log"]


def test_a_clean_comparison_exits_0(canned):
    status, result = _suite(canned, "--modules",
                            "canned_tests.TestCanned.test_passes,"
                            "canned_tests.TestCanned.test_fails_under_both")
    assert status == 0
    for diff in result["comparisons"].values():
        assert diff["gpupool_only"] == [] and len(diff["both"]) == 1


@pytest.mark.parametrize("end, outcome", [("crash", "crash"), ("hang", "timeout")])
def test_a_run_that_dies_names_the_test_it_was_in_and_keeps_the_rest(canned, monkeypatch,
                                                                     end, outcome):
    monkeypatch.setenv("CANNED_END", end)
    status, result = _suite(canned, "--modules", "canned_ends", "--timeout", "20")
    runs = result["runs"]
    assert status == 1
    for name in ("gpupool", "gpupool-driver"):
        assert result["comparisons"][name]["gpupool_only"] == [
            "canned_ends.TestEnds.test_b_dies_under_gpupool"]
        assert {n: t["outcome"] for n, t in runs[name]["tests"].items()} == {
            "canned_ends.TestEnds.test_a_first": "pass",
            "canned_ends.TestEnds.test_b_dies_under_gpupool": outcome}
        assert not runs[name]["finished"]
    assert runs["default"]["finished"]
    assert result["problems"] == [f"{name}: the run did not finish (rc={runs[name]['rc']})"
                                  for name in ("gpupool", "gpupool-driver")]


def test_stopping_the_suite_stops_its_runs(canned, monkeypatch):
    # As gpu-check.sh's timeout does: SIGTERM to the suite while a run's test hangs.
    monkeypatch.setenv("CANNED_END", "hang")
    record = canned / "logs" / "gpupool.jsonl"
    suite = subprocess.Popen([sys.executable, str(REPO / "tools" / "gpu" / "numba_suite.py"),
                              "--modules", "canned_ends", "--parallel", "--timeout", "300",
                              "--log-dir", str(canned / "logs")])
    deadline = time.monotonic() + 120
    while "test_b_dies_under_gpupool" not in (record.read_text() if record.exists() else ""):
        assert time.monotonic() < deadline and suite.poll() is None
        time.sleep(0.1)
    pid = json.loads(record.read_text().splitlines()[0])["pid"]
    suite.send_signal(signal.SIGTERM)
    assert suite.wait(timeout=60) == 128 + signal.SIGTERM
    try:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):    # a failing check leaves none behind
            os.kill(pid, signal.SIGKILL)


def test_a_module_that_does_not_import_errors_under_both(canned):
    status, result = _suite(canned, "--modules", "canned_tests.TestCanned.test_passes,"
                                                 "no_such_numba_tests")
    assert status == 0
    for name, diff in result["comparisons"].items():
        assert diff["both"] == ["unittest.loader._FailedTest.no_such_numba_tests"]
        assert "No module named 'no_such_numba_tests'" in (
            result["runs"][name]["tests"][diff["both"][0]]["detail"])


def _record(manager, memory_manager=None, upstream=None):
    """The read record of a finished run of one passing test."""
    lines = [json.dumps({"event": "begin", "manager": manager, "names": ["m"]}),
             '{"event": "start", "test": "m.T.t"}',
             '{"event": "end", "test": "m.T.t", "outcome": "pass", "detail": ""}',
             json.dumps({"event": "done", "tests_run": 1, "memory_manager": memory_manager,
                         "upstream": upstream})]
    return dict(numba_suite.read_record(lines), rc=0)


def test_a_run_under_another_manager_is_not_comparable():
    run = _record("default")
    assert run["finished"] and run["tests"] == {"m.T.t": {"outcome": "pass", "detail": ""}}
    assert numba_suite.run_problems({"default": run, "gpupool": run, "gpupool-driver": run}) == [
        "gpupool: ran with NUMBA_CUDA_MEMORY_MANAGER=default, not gpupool.numba",
        "gpupool-driver: ran with NUMBA_CUDA_MEMORY_MANAGER=default, not gpupool.numba"]


@pytest.mark.parametrize("vmm_upstream, driver_upstream, problems", [
    ("vmm", "driver", []),
    ("driver", "driver", ["gpupool: gpupool's pool took memory from upstream driver, not vmm"]),
    ("vmm", None, ["gpupool-driver: gpupool's pool took memory from upstream None, not driver"]),
    ("vmm", "unknown (NoDeviceError: no driver)", [
        "gpupool-driver: gpupool's pool took memory from upstream unknown (NoDeviceError: no "
        "driver), not driver"])])
def test_a_gpupool_run_on_another_upstream_is_not_comparable(vmm_upstream, driver_upstream,
                                                             problems):
    runs = {"default": _record("default", "NumbaCUDAMemoryManager"),
            "gpupool": _record("gpupool.numba", "GpupoolNumbaManager", vmm_upstream),
            "gpupool-driver": _record("gpupool.numba", "GpupoolNumbaManager", driver_upstream)}
    assert runs["gpupool"]["upstream"] == vmm_upstream
    assert numba_suite.run_problems(runs) == problems


def test_without_a_context_or_a_pool_the_upstream_is_not_checked():
    # No Numba context made and gpupool never imported: no pool took any memory.
    runs = {"default": _record("default"), "gpupool": _record("gpupool.numba"),
            "gpupool-driver": _record("gpupool.numba")}
    assert numba_suite.run_problems(runs) == []
    runs["default"] = _record("default", upstream="vmm")    # a pool the default must not use
    assert numba_suite.run_problems(runs) == [
        "default: gpupool's pool took memory from upstream vmm, not None"]


def test_a_run_in_which_no_test_passed_is_not_comparable():
    # Without numba-cuda every module fails to import under every manager: no comparison.
    lines = [json.dumps({"event": "begin", "manager": "default", "names": ["numba"]}),
             '{"event": "start", "test": "unittest.loader._FailedTest.numba"}',
             json.dumps({"event": "end", "test": "unittest.loader._FailedTest.numba",
                         "outcome": "error", "detail": "Traceback (most recent call last):\n"
                         "ModuleNotFoundError: No module named 'numba'\n"}),
             json.dumps({"event": "done", "tests_run": 1, "memory_manager": None,
                         "upstream": None})]
    empty = dict(numba_suite.read_record(lines), rc=1)
    runs = {"default": empty, "gpupool": dict(empty, manager="gpupool.numba")}
    problems = numba_suite.run_problems(runs)
    assert problems == [
        f"{name}: no test passed, so nothing was compared (it needs numba-cuda and a GPU): "
        "ModuleNotFoundError: No module named 'numba'" for name in runs]
    assert numba_suite.suite_status(numba_suite.compare_runs(runs, ()), problems) == 2


POOL = HEADER + '''
import gpupool
from gpupool.testing import SimulatedDevice


class TestPool(unittest.TestCase):
    def test_makes_the_default_pool(self):
        gpupool.set_pool(gpupool.Pool(upstream=SimulatedDevice()), 0)
'''


def test_a_gpupool_child_records_its_pool_s_upstream(canned):
    (canned / "canned_pool.py").write_text(POOL)
    status, result = _suite(canned, "--modules", "canned_pool")
    runs = result["runs"]
    assert [run["upstream"] for run in runs.values()] == [
        None, "SimulatedDevice", "SimulatedDevice"]
    assert status == result["status"] == 2
    assert result["problems"] == [
        "gpupool: gpupool's pool took memory from upstream SimulatedDevice, not vmm",
        "gpupool-driver: gpupool's pool took memory from upstream SimulatedDevice, not driver"]


def test_an_upstream_is_named_by_its_exact_class():
    from gpupool.core.upstreams import UPSTREAMS
    from gpupool.testing import SimulatedDevice

    class Sub(SimulatedDevice):
        pass

    device = SimulatedDevice()
    assert numba_suite.upstream_name(device, {"sim": SimulatedDevice}) == "sim"
    assert numba_suite.upstream_name(device, UPSTREAMS) == "SimulatedDevice"
    assert numba_suite.upstream_name(Sub(), {"sim": SimulatedDevice}) == "Sub"


def test_the_record_parser_ignores_a_line_cut_short_and_names_the_running_test():
    lines = ['{"event": "begin", "manager": "gpupool.numba", "names": ["m"]}',
             '{"event": "start", "test": "m.T.a"}',
             '{"event": "end", "test": "m.T.a", "outcome": "skip", "detail": "no IPC"}',
             '{"event": "start", "test": "m.T.b"}',
             '{"event": "end", "test": "m.T.b", "outc']
    run = numba_suite.read_record(lines)
    assert run["manager"] == "gpupool.numba" and not run["finished"]
    assert run["tests"] == {"m.T.a": {"outcome": "skip", "detail": "no IPC"},
                            "m.T.b": {"outcome": "crash",
                                      "detail": "the process died during this test"}}
    assert numba_suite.read_record(lines, timed_out=True)["tests"]["m.T.b"]["outcome"] == \
        "timeout"


def _tests(**outcomes):
    return {name: {"outcome": outcome, "detail": ""} for name, outcome in outcomes.items()}


def test_comparison_of_canned_outcomes():
    default = _tests(a="pass", b="skip", c="fail", d="error", e="pass", f="pass")
    gpupool = _tests(a="error", b="xpass", c="error", d="pass", e="skip", g="crash")
    assert numba_suite.compare(default, gpupool) == {
        "gpupool_only": ["a", "b", "g"], "both": ["c"], "default_only": ["d"],
        "skipped_only_under_gpupool": ["e"]}


@pytest.mark.parametrize("vmm, driver, limits, status", [
    # a, the test a vmm limit names, fails only on vmm: by design.
    ({"a": "fail"}, {}, (CANNED_LIMIT._replace(tests=("a",)),), 0),
    ({"a": "fail"}, {}, (), 1),                                       # no limit: it counts
    ({"a": "fail"}, {}, (CANNED_LIMIT._replace(tests=("b",)),), 1),   # a limit of others
    ({"a": "fail"}, {}, (CANNED_LIMIT._replace(upstream="driver", tests=("a",)),), 1),
    # The same test failing on the driver upstream is not excused by the vmm limit.
    ({"a": "fail"}, {"a": "fail"}, (CANNED_LIMIT._replace(tests=("a",)),), 1),
    ({"a": "fail", "b": "error"}, {}, (CANNED_LIMIT._replace(tests=("a",)),), 1),
    ({}, {"b": "crash"}, (CANNED_LIMIT._replace(tests=("a",)),), 1)])
def test_the_status_of_each_gpupool_run_against_the_default(vmm, driver, limits, status):
    default = _tests(a="pass", b="pass", c="fail")

    def run(failing):
        return {"tests": {**default, **_tests(**failing)}}

    runs = {"default": {"tests": default}, "gpupool": run(vmm), "gpupool-driver": run(driver)}
    diffs = numba_suite.compare_runs(runs, limits)
    assert numba_suite.suite_status(diffs, []) == status
    assert numba_suite.suite_status(diffs, ["a run did not finish"]) == (status or 2)
    assert all(diff["both"] == ["c"] for diff in diffs.values())
    excused = [n for names in diffs["gpupool"]["by_design"].values() for n in names]
    assert sorted(excused + diffs["gpupool"]["gpupool_only"]) == sorted(vmm)
    assert diffs["gpupool-driver"]["gpupool_only"] == sorted(driver)
    assert diffs["gpupool-driver"]["by_design"] == {
        limit.name: [] for limit in limits if limit.upstream == "driver"}


def test_the_known_ipc_limit_of_expandable_segments_is_named():
    limit = numba_suite.VMM_IPC_LEGACY_HANDLE
    assert numba_suite.KNOWN_LIMITS == (limit,)
    assert limit.name == "VMM_IPC_LEGACY_HANDLE" and limit.upstream == "vmm"
    assert limit.tests == ("numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle",)
    assert "CUipcMemHandle" in limit.reason
    assert numba_suite.RUNS["gpupool"].upstream == "vmm"
    assert numba_suite.RUNS["gpupool-driver"] == numba_suite.Run(
        "gpupool.numba", {"GPUPOOL_UPSTREAM": "driver"}, "driver")


@pytest.mark.parametrize("args, message", [
    (["--modules", " , "], "--modules names no test module"),
    (["--timeout", "0"], "--timeout must be > 0 seconds, not 0.0"),
    (["--runs", "default,gpupool-vmm"],
     "--runs: no run gpupool-vmm; the runs: default, gpupool, gpupool-driver"),
    (["--runs", "default,gpupool,default"], "--runs names default more than once"),
    (["--runs", "gpupool,gpupool-driver"],
     "--runs must name default and a gpupool run, not 'gpupool,gpupool-driver'"),
    (["--runs", "default"], "--runs must name default and a gpupool run, not 'default'")])
def test_bad_options_are_refused(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        numba_suite.main(["--log-dir", str(tmp_path), *args])
    assert message in capsys.readouterr().err


def test_the_table_names_the_exception_of_a_failure():
    detail = ("Traceback (most recent call last):\n  File \"driver.py\", line 308\n"
              "numba.cuda.cudadrv.error.CudaSupportError: Error at driver init: \n\n"
              "CUDA driver library cannot be found.\n:\n")

    def run(outcome, detail, upstream):
        return {"tests": {"m.T.t": {"outcome": outcome, "detail": detail}}, "finished": True,
                "manager": "gpupool.numba", "memory_manager": None, "upstream": upstream,
                "rc": 1, "seconds": 1.0}

    runs = {"default": run("error", detail, None), "gpupool": run("error", detail, "vmm")}
    table = numba_suite.format_report(runs, numba_suite.compare_runs(runs, ()), ())
    assert ("  m.T.t  [default error, gpupool error]  numba.cuda.cudadrv.error."
            "CudaSupportError: Error at driver init:") in table
    assert "Numba's manager class at the end: None, the pool's upstream: vmm" in table
    # Each gpupool run's list gives that run's reason, not another run's skip.
    runs = {"default": run("pass", "", None), "gpupool": run("error", detail, "vmm"),
            "gpupool-driver": run("skip", "not on the driver upstream", "driver")}
    table = numba_suite.format_report(runs, numba_suite.compare_runs(runs, ()), ())
    assert ("fail only under gpupool (upstream vmm), must be none: 1\n  m.T.t  [default pass, "
            "gpupool error, gpupool-driver skip]  numba.cuda.cudadrv.error.CudaSupportError:"
            ) in table
    assert ("skipped only under gpupool (upstream driver): 1\n  m.T.t  [default pass, gpupool "
            "error, gpupool-driver skip]  not on the driver upstream") in table


def test_the_children_alias_numpy_s_row_stack_for_numba_cuda(monkeypatch):
    # numba-cuda 0.30 names np.row_stack (gone in NumPy 2.5) when it compiles a kernel: a
    # child without the alias errors on every such test, under both managers.
    import numpy as np

    monkeypatch.delattr(np, "row_stack", raising=False)
    assert numba_suite.numpy_aliases() == ["row_stack"]
    assert np.row_stack is np.vstack
    assert numba_suite.numpy_aliases() == []


def test_without_numba_cuda_it_says_so_and_runs_nothing(monkeypatch, capsys, tmp_path):
    real = numba_suite.importlib.util.find_spec
    monkeypatch.setattr(numba_suite.importlib.util, "find_spec",
                        lambda name, *a: None if name == "numba" else real(name, *a))
    assert numba_suite.main(["--log-dir", str(tmp_path / "logs")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("numba_suite: numba-cuda is not installed")
    assert not (tmp_path / "logs").exists()          # no run started
