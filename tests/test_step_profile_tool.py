"""tools/profile/step_profile.py: the argument checks it makes before anything touches a GPU."""

import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, os.path.join(ROOT, "tools", "profile"))

import step_profile  # noqa: E402


def test_an_unknown_column_exits_2_naming_the_columns(capsys):
    with pytest.raises(SystemExit) as exc:
        step_profile.main(["gpt2", "gp.nonesuch"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "gp.nonesuch" in err and "gp.vmm.plan" in err and "torch.exp" in err


@pytest.mark.skipif(step_profile.no_gpu() is None, reason="a GPU is present")
def test_without_a_gpu_it_exits_2_saying_so(capsys):
    with pytest.raises(SystemExit) as exc:
        step_profile.main(["gpt2", "gp.vmm.plan"])
    assert exc.value.code == 2
    assert "needs a GPU" in capsys.readouterr().err


@pytest.mark.parametrize("option", [["--steps", "0"], ["--top", "-1"]])
def test_steps_and_top_below_one_exit_2_before_any_gpu_check(option, capsys, monkeypatch):
    monkeypatch.setattr(step_profile, "no_gpu", lambda: pytest.fail("asked for a GPU"))
    with pytest.raises(SystemExit) as exc:
        step_profile.main(["gpt2", "gp.vmm.plan", *option])
    assert exc.value.code == 2
    assert "--steps and --top must be >= 1" in capsys.readouterr().err
