"""tools/profile/step_profile.py and gpu_time.py: the argument checks they make before anything
touches a GPU."""

import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, os.path.join(ROOT, "tools", "profile"))

import gpu_time  # noqa: E402
import step_profile  # noqa: E402

TOOLS = [step_profile, gpu_time]


@pytest.mark.parametrize("tool", TOOLS)
def test_an_unknown_column_exits_2_naming_the_columns(tool, capsys):
    with pytest.raises(SystemExit) as exc:
        tool.main(["gpt2", "gp.nonesuch"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "gp.nonesuch" in err and "gp.vmm.plan" in err and "torch.exp" in err


@pytest.mark.skipif(step_profile.no_gpu() is None, reason="a GPU is present")
@pytest.mark.parametrize("tool", TOOLS)
def test_without_a_gpu_it_exits_2_saying_so(tool, capsys):
    with pytest.raises(SystemExit) as exc:
        tool.main(["gpt2", "gp.vmm.plan"])
    assert exc.value.code == 2
    assert "needs a GPU" in capsys.readouterr().err


@pytest.mark.parametrize(("tool", "option", "message"), [
    (step_profile, ["--steps", "0"], "--steps and --top must be >= 1"),
    (step_profile, ["--top", "-1"], "--steps and --top must be >= 1"),
    (gpu_time, ["--from", "5", "--steps", "5"], "need 0 <= --from < --steps"),
    (gpu_time, ["--from", "-1"], "need 0 <= --from < --steps"),
    (gpu_time, ["--top", "-1"], "need 0 <= --from < --steps"),
])
def test_counts_out_of_range_exit_2_before_any_gpu_check(tool, option, message, capsys,
                                                        monkeypatch):
    monkeypatch.setattr(step_profile, "no_gpu", lambda: pytest.fail("asked for a GPU"))
    with pytest.raises(SystemExit) as exc:
        tool.main(["gpt2", "gp.vmm.plan", *option])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_gpu_time_splits_kernels_into_steps_at_their_markers():
    marks = [(0, 1, "spin_kernel"), (10, 30, "gemm"), (20, 40, "add"), (100, 101, "spin_kernel"),
             (110, 150, "gemm")]
    bounds = [(0, 100), (100, 151)]
    sums, busy = gpu_time.per_step(marks, bounds)
    assert sums == [0.04, 0.04] and busy == [0.03, 0.04]      # ms: 20 + 20 us, united 30 us
    assert gpu_time.union_ms([(0, 10), (5, 20), (30, 40)]) == 0.03
