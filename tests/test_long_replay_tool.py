"""tools/profile/long_replay.py's ``--steps N``: the trace's first N steps, what a run of N
steps records."""

import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tools", "profile"))

import long_replay  # noqa: E402


def test_steps_replays_the_first_steps_only(capsys):
    assert long_replay.main(["gpt2-varlen", "0", "--steps", "10"]) == 0
    # The H100's ten-step run of real_models.py, pool alone: 12,884 MiB reserved, 12,834 in
    # use at most.
    out = capsys.readouterr().out
    assert "peak reserved 12,884 MiB" in out and "12,834 MiB)" in out
    assert long_replay.main(["gpt2-varlen", "1", "--steps", "2"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


@pytest.mark.parametrize("argv, said", [
    (["vit", "0", "--steps", "0"], "from 1 to its 30 steps"),
    (["vit", "0", "--steps", "31"], "got 31"),
    (["vit", "1", "--steps", "1"], "passes must be 0")])
def test_steps_out_of_range_exit_2_naming_what_is_accepted(argv, said, capsys):
    with pytest.raises(SystemExit) as stop:
        long_replay.main(argv)
    assert stop.value.code == 2 and said in capsys.readouterr().err

