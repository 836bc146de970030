"""tools/profile/first_steps.py and what it shows (Note [The first steps' layout] in
docs/design.md): on the recorded fixed-shape runs a planned region's online steps each touch
more pages than the run floor plus 1%, and on ViT-B/16 its planned steps too, around the rows
the first steps leave for good."""

import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tools", "profile"))

import alloc_trace  # noqa: E402
import first_steps  # noqa: E402

MiB = 1 << 20


def trace_named(name):
    return alloc_trace.load(os.path.join(ROOT, "bench", "data", "traces-real", name + ".npz"))


def test_holes_are_the_gaps_of_a_page_or_more_between_rows():
    rows = [(0, 3 * MiB, 0), (5 * MiB, MiB, 1), (6 * MiB + 512, MiB, 2), (12 * MiB, MiB, 3)]
    assert first_steps.holes(rows) == [(3 * MiB, 2 * MiB), (7 * MiB + 512, 5 * MiB - 512)]
    assert first_steps.pages(2 * MiB - 256, 512, 0) == range(0, 2)


@pytest.mark.parametrize("name, floor, step1, steady", [
    ("resnet50", 5657.7, 5744, 5698), ("vit", 4988.2, 5082, 5054)])
def test_every_step_touches_its_pages_and_the_planned_ones_fewer(name, floor, step1, steady):
    out = first_steps.replay(trace_named(name))
    steps = out["steps"]
    out["live"].clear()
    assert round(max(s["live"] for s in steps.values()) / MiB, 1) == floor
    assert steps[1]["footprint"] == step1 * MiB         # the online step 1
    assert steps[20]["footprint"] == steady * MiB       # a planned step
    # Without a page moved (one synchronize, in step 1), no step reserves less than it
    # touches.
    assert all(s["reserved"] >= s["footprint"] for k, s in steps.items() if k != 1)
    assert steps[29]["synchronizes"] == 1
    assert steps[20]["footprint"] < steps[1]["footprint"]
    # The online steps (the plan comes at the fifth entry) are past 1% above the floor.
    assert all(steps[k]["footprint"] > 1.01 * floor * MiB for k in (1, 2, 3))
    # ViT-B/16's planned steps alone are past 1% above the floor.
    assert (steady > 1.01 * floor) == (name == "vit")


def test_fixed_rows_are_the_first_steps_blocks_live_to_the_end():
    trace = trace_named("resnet50")
    out = first_steps.replay(trace)
    rows = first_steps.fixed_rows(trace, out)
    out["live"].clear()
    first = trace.meta["step_starts"]
    assert all(k < first[1] for *_, k in rows)
    # The optimizer's state, added in step 0, lies as high as step 0 reached.
    assert max(o + n for o, n, k in rows if k >= first[0]) > 5500 * MiB
    assert round(sum(n for _, n, k in rows if k >= first[0]) / MiB) == 260


def test_at_names_the_free_blocks_and_their_neighbours(capsys):
    assert first_steps.main(["resnet50", "--at", "2785"]) == 0
    out = capsys.readouterr().out
    assert "before event 2785 (step 1, a request of 73.5)" in out
    assert "free 24.5 at 5,144.0 (inactive); before it live 24.5 (event 2778, step 1); " \
           "after it live 4.0 (event 2770, step 1)" in out


@pytest.mark.parametrize("argv, said", [
    (["resnet50", "--at", "-1"], "not an allocation"),
    (["gpt2", "--at", "0"], "not an allocation after the first"),     # nothing before it
    (["nosuch"], "no trace 'nosuch'"),
    (["gpt2", "--strategies", "size", "size"], "names each strategy once")])
def test_bad_arguments_exit_2_saying_why(argv, said, capsys):
    with pytest.raises(SystemExit) as stop:
        first_steps.main(argv)
    assert stop.value.code == 2 and said in capsys.readouterr().err
