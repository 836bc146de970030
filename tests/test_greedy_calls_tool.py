"""tools/profile/greedy_calls.py on a recorded trace: it records every call the planner makes
to the compiled greedy core (one per step's strategy at least), puts the core back after,
replays them with the index by time off and on to the same offsets, work and status, and
refuses a trace it does not know."""

import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tools", "profile"))

import alloc_trace  # noqa: E402
import fragmentation  # noqa: E402
import greedy_calls  # noqa: E402

from gpupool.region import greedy  # noqa: E402


def test_the_recorded_calls_replay_alike_with_the_index_and_the_core_is_put_back():
    (trace,) = [t for t in map(alloc_trace.load, alloc_trace.find(fragmentation.REAL_DIR))
                if t.name == "resnet50"]
    place = greedy.place
    calls = greedy_calls.record(trace)
    assert greedy.place is place
    assert len(calls) >= len(fragmentation.step_plans(trace))
    _, scan = greedy_calls.replay(calls, greedy.place, 0)
    _, index = greedy_calls.replay(calls, greedy.place, 32)
    assert greedy_calls.same(scan, index)
    assert all(status == greedy.DONE for _, _, status in scan)


def test_an_unknown_trace_is_refused(capsys):
    with pytest.raises(SystemExit):
        greedy_calls.main(["nope"])
    assert "unknown traces ['nope']" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["--repeat", "0", "gpt2"], "--repeat must be 1 or more"),
    (["--buckets", "-1", "gpt2"], "--buckets must be 0 or more"),
    (["--buckets", "x", "gpt2"], "--buckets takes integers"),
    (["--core", "no_such_module", "gpt2"], "cannot be imported"),
    (["--core", "os", "gpt2"], "has no place()")])
def test_bad_options_exit_2_saying_why(argv, said, capsys):
    with pytest.raises(SystemExit) as stop:
        greedy_calls.main(argv)
    assert stop.value.code == 2 and said in capsys.readouterr().err
