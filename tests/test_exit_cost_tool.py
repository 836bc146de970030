"""tools/profile/exit_cost.py on a recorded trace: a row per step, its columns in their
places, and the upstream calls a planned region makes per step against a region without a
plan: no event, stream wait, synchronize, unmap or trim of its own, only maps (a record
step's plan maps pages for its places as it reaches them)."""

import collections
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tools", "profile"))

import alloc_trace  # noqa: E402
import exit_cost  # noqa: E402
import fragmentation  # noqa: E402

import gpupool  # noqa: E402
from gpupool.region import placement, planned  # noqa: E402


def trace_named(name):
    (trace,) = [t for t in map(alloc_trace.load, alloc_trace.find(fragmentation.REAL_DIR))
                if t.name == name]
    return trace


def test_a_row_per_step_and_the_spies_removed_after():
    trace = trace_named("gpt2-ckpt")
    originals = (gpupool.Region, planned.Planner.exited, planned.Planner.place,
                 planned.Planner.record, placement._side_by_side)
    rows = exit_cost.steps_of(trace, passes=1)
    assert (gpupool.Region, planned.Planner.exited, planned.Planner.place,
            planned.Planner.record, placement._side_by_side) == originals
    starts = trace.meta["step_starts"]
    assert len(rows) == len(starts) + len(starts) - 1
    assert all(set(ms) == set(exit_cost.COLUMNS) for ms, _ in rows)
    assert any(ms["greedy"] > 0 for ms, _ in rows)      # it plans: the greedy was timed
    plain = exit_cost.steps_of(trace, passes=1, plan=False)
    assert len(plain) == len(rows)
    assert all(ms["greedy"] == ms["planner"] == ms["record"] == 0 for ms, _ in plain)


def test_a_planned_step_makes_no_upstream_call_but_maps_that_the_online_way_does_not(
        default_pools):
    trace = trace_named("llama-ckpt")
    for capi in (False, True):
        planned_rows = exit_cost.steps_of(trace, passes=1, capi=capi)
        plain_rows = exit_cost.steps_of(trace, passes=1, capi=capi, plan=False)
        for (_, mine), (_, theirs) in zip(planned_rows, plain_rows, strict=True):
            extra = collections.Counter(mine)
            extra.subtract(theirs)
            assert {name for name, n in extra.items() if n > 0} <= {"map", "map MiB"}


def test_an_unknown_trace_or_negative_passes_exit_2_naming_what_is_accepted(capsys):
    for argv, said in ((["nope"], "one of bert-varlen,"), (["vit", "--passes", "-1"],
                                                           "passes must be 0 or more")):
        try:
            exit_cost.main(argv)
        except SystemExit as stop:
            assert stop.code == 2
        else:
            raise AssertionError(f"{argv} ran")
        assert said in capsys.readouterr().err


def test_host_work_and_plans_taken_at_the_exit_make_the_same_upstream_calls():
    # Where the plan is taken (at the exit, or at the next call after host work that holds
    # the GIL or not) moves time only: every step makes the same calls.
    trace = trace_named("gpt2-ckpt")
    base = exit_cost.steps_of(trace)
    for options in ({"sync": True}, {"host_ms": 0.5, "host": "busy"},
                    {"host_ms": 0.5, "host": "sleep"}):
        rows = exit_cost.steps_of(trace, **options)
        assert [calls for _, calls in rows] == [calls for _, calls in base], options
        assert all(set(ms) == set(exit_cost.COLUMNS) for ms, _ in rows)


@pytest.mark.parametrize(("argv", "said"), [
    (["--host-ms", "-1"], "--host-ms must be a finite number of milliseconds, 0 or more"),
    (["--host-ms", "inf"], "--host-ms must be a finite number of milliseconds, 0 or more"),
    (["--host-ms", "nan"], "--host-ms must be a finite number of milliseconds, 0 or more"),
    (["--sync", "--no-plan"], "--no-plan makes none"),
])
def test_bad_host_work_or_options_that_contradict_exit_2(capsys, argv, said):
    try:
        exit_cost.main(["vit", *argv])
    except SystemExit as stop:
        assert stop.code == 2
    else:
        raise AssertionError("ran")
    assert said in capsys.readouterr().err


def test_the_planner_column_is_never_negative():
    # "greedy" is the wall time of the strategies run side by side, inside place and record:
    # the planner's own part (their time less it) cannot go below zero.
    rows = exit_cost.steps_of(trace_named("gpt2-ckpt"), sync=True)
    assert any(ms["greedy"] > 0 for ms, _ in rows)
    assert all(ms["planner"] >= 0 for ms, _ in rows), [ms["planner"] for ms, _ in rows]
