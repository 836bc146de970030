"""The examples on a machine without a GPU: train_digits trains and ipc_pipeline shares batches
between two processes on the simulated device; the GPU-only examples (and --device gpu) exit 2
with one line, no traceback."""

import os
import pickle

import pytest
from conftest import REPO

# An empty CUDA_VISIBLE_DEVICES hides every GPU, so these hold on GPU machines too.
NO_GPU = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
SIMULATED_LINE = "train_digits: training with NumPy on gpupool's simulated device (host memory)"


@pytest.mark.parametrize("script, args", [("train_digits", ["--device", "gpu", "--epochs", "1"]),
                                          ("train_digits_torch", ["--epochs", "1"]),
                                          ("train_digits_torch",
                                           ["--epochs", "1", "--compile", "reduce-overhead",
                                            "--cudnn-benchmark"]),
                                          ("mixed_frameworks", []),
                                          ("ipc_pipeline", ["--device", "gpu"])])
def test_example_without_gpu_exits_2_with_one_line(run_script, script, args):
    # Where a framework is not installed (CI) the example stops even earlier, with the same
    # contract.
    proc, output = run_script(f"examples/{script}.py", *args, env=NO_GPU, timeout=300)
    assert proc.returncode == 2, output
    assert "Traceback" not in proc.stderr, output
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert lines[0].startswith(f"{script}: "), output


def _summary_rows(stdout):
    """The summary table's rows by mode, each split on whitespace."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("mode "))
    assert lines[header].split()[-1] == "ms/step"
    rows = {}
    for line in lines[header + 2:]:
        if line.split()[:1] not in (["region"], ["no-region"]):
            return rows
        rows[line.split()[0]] = line.split()
    return rows


def test_train_digits_trains_on_the_simulated_device_without_gpu(run_script, tmp_path):
    pytest.importorskip("sklearn", reason="the example's data set ships with scikit-learn")
    pytest.importorskip("matplotlib")
    plot = tmp_path / "memory.png"
    proc, output = run_script("examples/train_digits.py", "--epochs", "10", "--plot", str(plot),
                              env=NO_GPU, timeout=300)
    # Exit status 0 means: test accuracy >= 0.95 in both modes, the region mode's reserved
    # bytes equal after epochs 1 and 10.
    assert proc.returncode == 0, output
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(SIMULATED_LINE + ", because "), output
    for mode in ("region", "no-region"):
        epochs = [line for line in lines if line.startswith(f"[{mode}] epoch ")]
        assert len(epochs) == 10, output
    # the pool's report after every epoch line
    assert sum(line.startswith("Memory pool usage: ") for line in lines) == 20, output
    rows = _summary_rows(proc.stdout)
    assert set(rows) == {"region", "no-region"}, output
    for row in rows.values():
        assert float(row[1]) >= 0.95, output
    region = rows["region"]
    assert region[3] == region[4] and region[5] == "yes", output   # reserved, flat?
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", output


def test_ipc_pipeline_shares_batches_between_processes_on_the_simulated_device(run_script):
    proc, output = run_script("examples/ipc_pipeline.py", "--batches", "12", "--depth", "3",
                              env=NO_GPU, timeout=300)
    # Exit status 0 means: every batch's sums right, the consumer's receipts in the
    # producer's memory, at most 3 batches in use, blocks reused, the consumer clean.
    assert proc.returncode == 0, output
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("ipc_pipeline: sharing batches on gpupool's simulated device"), \
        output
    checks = [line for line in lines if line.startswith("[")]
    assert len(checks) == 5 and all(line.startswith("[ok] ") for line in checks), output


def test_train_digits_simulated_as_asked(run_script):
    pytest.importorskip("sklearn", reason="the example's data set ships with scikit-learn")
    proc, output = run_script("examples/train_digits.py", "--device", "simulated", "--epochs",
                              "1", "--mode", "region", "--quiet", timeout=300)
    # One epoch is too few for 0.95: exit status 1, the accuracy check named; memory still flat.
    assert proc.returncode == 1, output
    assert proc.stdout.splitlines()[0] == SIMULATED_LINE + ", as asked (--device simulated)"
    assert list(_summary_rows(proc.stdout)) == ["region"], output
    (line,) = proc.stderr.splitlines()
    assert line.startswith("train_digits: check failed: region: test accuracy "), output
    assert line.endswith(" is below 0.95"), output


def test_train_digits_writes_a_memory_snapshot(run_script, tmp_path):
    pytest.importorskip("sklearn", reason="the example's data set ships with scikit-learn")
    path = tmp_path / "digits.pickle"
    proc, output = run_script("examples/train_digits.py", "--device", "simulated", "--epochs",
                              "1", "--mode", "region", "--quiet", "--snapshot", str(path),
                              timeout=300)
    assert proc.returncode == 1, output         # one epoch: accuracy below 0.95, as above
    assert f"Memory snapshot for PyTorch's visualizer (https://pytorch.org/memory_viz): {path}" \
        in proc.stdout.splitlines(), output
    snapshot = pickle.loads(path.read_bytes())
    trace = snapshot["device_traces"][0]
    assert [e["action"] for e in trace[:2]] == ["segment_alloc", "alloc"]
    assert sum(e["action"] == "alloc" for e in trace) > 1000
    assert any(f["filename"].endswith("autograd.py") for e in trace for f in e["frames"])
    [region] = snapshot["regions"]
    assert region["cached_bytes"] > 0
    assert sum(s["total_size"] for s in snapshot["segments"]) == 2 << 20
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    assert "total_reserved: 2.0MiB" in memory_viz.segsum(snapshot)


def test_train_digits_cupy_mode_needs_a_gpu(run_script):
    proc, output = run_script("examples/train_digits.py", "--device", "simulated", "--mode",
                              "cupy", timeout=300)
    assert proc.returncode == 2, output
    assert proc.stderr.splitlines() == [
        "train_digits: the cupy mode needs a GPU and CuPy; on the simulated device --mode is one"
        " of region, no-region or all"], output


def test_train_digits_plot_without_matplotlib_stops_before_training(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import train_digits

    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)   # import fails
    status = train_digits.main(["--device", "simulated", "--plot", "never.png"])
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err == "train_digits: --plot needs matplotlib: pip install matplotlib (or run" \
                  " without --plot)\n"


def test_memory_plot_draws_every_mode(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import _plot

    class Result:
        def __init__(self, mode, trace):
            self.mode, self.trace = mode, trace

    plt = _plot.pyplot()
    drawn = []
    monkeypatch.setattr(plt, "close", lambda fig: drawn.append(fig))
    path = tmp_path / "plot.svg"
    _plot.save_memory_plot(plt, [Result("region", [(1 << 20, 2 << 20)] * 3),
                                 Result("no-region", [(1 << 20, 2 << 20), (3 << 20, 4 << 20)])],
                           str(path), "title")
    (ax,) = drawn[0].axes
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert lines == {"region: reserved": [2, 2, 2], "region: in use": [1, 1, 1],
                     "no-region: reserved": [2, 4], "no-region: in use": [1, 3]}
    assert path.read_text().lstrip().startswith("<?xml")


def test_memory_plot_to_an_unwritable_path_fails_with_one_line(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import _digits
    import _plot

    class Result:
        mode, trace = "region", [(1, 2)]

    with pytest.raises(_digits.RunFailed, match="cannot write the plot to .*missing"):
        _plot.save_memory_plot(_plot.pyplot(), [Result()], str(tmp_path / "missing" / "p.png"),
                               "title")
