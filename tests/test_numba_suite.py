"""tools/gpu/numba_suite.py without numba-cuda: its record of canned unittest modules run under
each manager's environment variable (outcomes, subtests, class set-up errors, a crash and a
timeout), the comparison, the table and the exit status; the record's parser on canned lines."""

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


@pytest.mark.parametrize("parallel", [False, True])
def test_tests_that_fail_only_under_gpupool_are_named_and_fail_the_run(canned, capsys,
                                                                       parallel):
    status, result = _suite(canned, "--modules", "canned_tests", "--timeout", "120",
                            *(["--parallel"] if parallel else []))
    table = capsys.readouterr().out
    case = "canned_tests.TestCanned."
    assert status == 1 and result["status"] == 1
    assert result["gpupool_only"] == [
        "canned_tests.TestCanned.test_errors_under_gpupool",
        "canned_tests.TestCanned.test_fails_under_gpupool",
        "canned_tests.TestCanned.test_subtest_fails_under_gpupool",
        "setUpClass (canned_tests.TestSetUpClassErrorsUnderGpupool)"]
    assert result["both"] == [case + "test_fails_under_both"]
    assert result["default_only"] == [case + "test_fails_under_the_default"]
    assert result["skipped_only_under_gpupool"] == [case + "test_skipped_under_gpupool"]
    assert result["problems"] == []
    default, gpupool = result["runs"]["default"], result["runs"]["gpupool"]
    none = dict.fromkeys(numba_suite.OUTCOMES, 0)
    assert numba_suite.counts(default["tests"]) == dict(none, **{
        "pass": 6, "fail": 2, "skip": 1, "xfail": 1})
    assert numba_suite.counts(gpupool["tests"]) == dict(none, **{
        "pass": 2, "fail": 3, "error": 2, "skip": 2, "xfail": 1})
    assert (default["manager"], gpupool["manager"]) == ("default", "gpupool.numba")
    assert default["finished"] and gpupool["finished"]
    assert "has no attribute 'id'" in gpupool["tests"][case + "test_errors_under_gpupool"][
        "detail"]
    assert "(i=1)" in gpupool["tests"][case + "test_subtest_fails_under_gpupool"]["detail"]
    assert "fail only under gpupool (must be none): 4" in table
    assert ("  canned_tests.TestCanned.test_fails_under_the_default  [default fail, gpupool "
            "pass]  AssertionError: False is not true") in table
    assert ("gpupool: NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba, Numba's manager class at the "
            "end: None") in table
    assert ("  canned_tests.TestCanned.test_errors_under_gpupool  [default pass, gpupool "
            "error]  AttributeError: 'CUdevice' object has no attribute 'id'") in table
    for name in ("default", "gpupool"):         # each run's verbose log and record
        assert "test_passes" in (canned / "logs" / f"{name}.log").read_text()
        assert (canned / "logs" / f"{name}.jsonl").exists()


def test_a_clean_comparison_exits_0(canned):
    status, result = _suite(canned, "--modules",
                            "canned_tests.TestCanned.test_passes,"
                            "canned_tests.TestCanned.test_fails_under_both")
    assert status == 0
    assert result["gpupool_only"] == [] and len(result["both"]) == 1


@pytest.mark.parametrize("end, outcome", [("crash", "crash"), ("hang", "timeout")])
def test_a_run_that_dies_names_the_test_it_was_in_and_keeps_the_rest(canned, monkeypatch,
                                                                     end, outcome):
    monkeypatch.setenv("CANNED_END", end)
    status, result = _suite(canned, "--modules", "canned_ends", "--timeout", "20")
    gpupool = result["runs"]["gpupool"]
    assert status == 1
    assert result["gpupool_only"] == ["canned_ends.TestEnds.test_b_dies_under_gpupool"]
    assert {n: t["outcome"] for n, t in gpupool["tests"].items()} == {
        "canned_ends.TestEnds.test_a_first": "pass",
        "canned_ends.TestEnds.test_b_dies_under_gpupool": outcome}
    assert not gpupool["finished"] and result["runs"]["default"]["finished"]
    assert result["problems"] == [f"gpupool: the run did not finish (rc={gpupool['rc']})"]


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
    assert result["both"] == ["unittest.loader._FailedTest.no_such_numba_tests"]
    assert "No module named 'no_such_numba_tests'" in (
        result["runs"]["gpupool"]["tests"][result["both"][0]]["detail"])


def test_a_run_under_another_manager_is_not_comparable():
    lines = ['{"event": "begin", "manager": "default", "names": ["m"]}',
             '{"event": "start", "test": "m.T.t"}',
             '{"event": "end", "test": "m.T.t", "outcome": "pass", "detail": ""}',
             '{"event": "done", "tests_run": 1, "memory_manager": null}']
    run = dict(numba_suite.read_record(lines), rc=0)
    assert run["finished"] and run["tests"] == {"m.T.t": {"outcome": "pass", "detail": ""}}
    assert numba_suite.run_problems({"default": run, "gpupool": run}) == [
        "gpupool: ran with NUMBA_CUDA_MEMORY_MANAGER=default, not gpupool.numba"]


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


def test_comparison_of_canned_outcomes():
    def tests(**outcomes):
        return {name: {"outcome": outcome, "detail": ""} for name, outcome in outcomes.items()}

    default = tests(a="pass", b="skip", c="fail", d="error", e="pass", f="pass")
    gpupool = tests(a="error", b="xpass", c="error", d="pass", e="skip", g="crash")
    assert numba_suite.compare(default, gpupool) == {
        "gpupool_only": ["a", "b", "g"], "both": ["c"], "default_only": ["d"],
        "skipped_only_under_gpupool": ["e"]}


@pytest.mark.parametrize("args, message", [
    (["--modules", " , "], "--modules names no test module"),
    (["--timeout", "0"], "--timeout must be > 0 seconds, not 0.0")])
def test_bad_options_are_refused(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        numba_suite.main(["--log-dir", str(tmp_path), *args])
    assert message in capsys.readouterr().err



def test_the_table_names_the_exception_of_a_failure():
    detail = ("Traceback (most recent call last):\n  File \"driver.py\", line 308\n"
              "numba.cuda.cudadrv.error.CudaSupportError: Error at driver init: \n\n"
              "CUDA driver library cannot be found.\n:\n")
    run = {"tests": {"m.T.t": {"outcome": "error", "detail": detail}}, "finished": True,
           "manager": "gpupool.numba", "memory_manager": None, "rc": 1, "seconds": 1.0}
    table = numba_suite.format_report({"default": run, "gpupool": run},
                                      numba_suite.compare(run["tests"], run["tests"]))
    assert ("  m.T.t  [default error, gpupool error]  numba.cuda.cudadrv.error."
            "CudaSupportError: Error at driver init:") in table


def test_the_children_alias_numpy_s_row_stack_for_numba_cuda(monkeypatch):
    # numba-cuda 0.30 names np.row_stack (gone in NumPy 2.5) when it compiles a kernel: a
    # child without the alias errors on every such test, under both managers.
    import numpy as np

    monkeypatch.delattr(np, "row_stack", raising=False)
    assert numba_suite.numpy_aliases() == ["row_stack"]
    assert np.row_stack is np.vstack
    assert numba_suite.numpy_aliases() == []
