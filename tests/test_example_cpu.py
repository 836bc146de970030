"""The examples on a machine without a GPU: exit status 2 and one line, no traceback."""

import os

import pytest


@pytest.mark.parametrize("script, args", [("train_digits", ["--epochs", "1"]),
                                          ("train_digits_torch", ["--epochs", "1"]),
                                          ("mixed_frameworks", [])])
def test_example_without_gpu_exits_2_with_one_line(run_script, script, args):
    # An empty CUDA_VISIBLE_DEVICES hides every GPU, so this holds on GPU machines too; where
    # a framework is not installed (CI) the example stops even earlier, with the same contract.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    proc, output = run_script(f"examples/{script}.py", *args, env=env, timeout=300)
    assert proc.returncode == 2, output
    assert "Traceback" not in proc.stderr, output
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert lines[0].startswith(f"{script}: "), output
