"""The examples on a machine without a GPU: train_digits trains and ipc_pipeline shares batches
between two processes on the simulated device; the GPU-only examples (and --device gpu) exit 2 with
one line, no traceback (mixed_frameworks naming every library missing, and that it needs a GPU), and
--help works whatever is missing, explaining every option with its default. On a GPU (marked
gpu): train_digits trains to >= 0.95 with flat reserved memory in region mode; mixed_frameworks
passes data between CuPy, Numba and PyTorch on one pool; ipc_pipeline shares batches between two
processes through CUDA IPC, on both upstreams that export; sleep_wake swaps a PyTorch trainer and
an inference engine through sleep and wake, on both of use()'s allocators."""

import argparse
import json
import os
import pickle
import re
import subprocess
import sys
import types

import pytest
from conftest import REPO, flat_memory_unmeasurable

# An empty CUDA_VISIBLE_DEVICES hides every GPU, so these hold on GPU machines too.
NO_GPU = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
SIMULATED_LINE = "train_digits: training with NumPy on gpupool's simulated device (host memory)"


@pytest.mark.parametrize("script, args", [("train_digits", ["--device", "gpu", "--epochs", "1"]),
                                          ("train_digits_torch", ["--epochs", "1"]),
                                          ("train_digits_torch",
                                           ["--epochs", "1", "--compile", "reduce-overhead",
                                            "--cudnn-benchmark"]),
                                          ("mixed_frameworks", []),
                                          ("sleep_wake", []),
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
    # The missing GPU first, before any missing library: no install for nothing.
    assert "there is no GPU (" in lines[0], output
    assert lines[0].index("there is no GPU (") < min(
        [lines[0].find(w) for w in ("install", "cannot be imported") if w in lines[0]],
        default=len(lines[0])), output


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
    # the pool's report after every epoch line, naming the simulated device, not a GPU
    assert sum(line.startswith("Memory pool usage: ") for line in lines) == 20, output
    assert sum(line.startswith("Simulated device memory usage: ") for line in lines) == 20, output
    assert not any("GPU memory" in line for line in lines), output
    rows = _summary_rows(proc.stdout)
    assert set(rows) == {"region", "no-region"}, output
    for row in rows.values():
        assert float(row[1]) >= 0.95, output
    region = rows["region"]
    assert region[3] == region[4] and region[5] == "yes", output   # reserved, flat?
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", output


@pytest.mark.parametrize("upstream", [[], ["--upstream", "driver"]], ids=["default", "driver"])
def test_ipc_pipeline_shares_batches_between_processes_on_the_simulated_device(run_script,
                                                                              upstream):
    proc, output = run_script("examples/ipc_pipeline.py", "--batches", "12", "--depth", "3",
                              *upstream, env=NO_GPU, timeout=300)
    # Exit status 0 means: every batch's sums right, the consumer's receipts in the
    # producer's memory, at most 3 batches in use, blocks reused, the consumer clean.
    assert proc.returncode == 0, output
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("ipc_pipeline: sharing batches on gpupool's simulated device"), \
        output
    ignored = [line for line in lines if "is ignored" in line]
    assert ignored == ([] if not upstream else [
        "ipc_pipeline: --upstream driver is ignored: the simulated device shares memfd host "
        "memory, neither vmm pages nor driver segments"]), output
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


def test_train_digits_names_its_two_peaks_and_an_ignored_upstream(run_script):
    pytest.importorskip("sklearn", reason="the example's data set ships with scikit-learn")
    proc, output = run_script("examples/train_digits.py", "--device", "simulated", "--epochs",
                              "1", "--mode", "region", "--quiet",
                              env=dict(os.environ, GPUPOOL_UPSTREAM="driver"), timeout=300)
    assert proc.returncode == 1, output         # one epoch: accuracy below 0.95, as above
    lines = proc.stdout.splitlines()
    assert lines[1] == ("train_digits: GPUPOOL_UPSTREAM='driver' is ignored: the simulated "
                        "device is the pool's upstream"), output
    # The region's peak is one step's buffers; the table's, the pool's over the whole run.
    (region,) = [line for line in lines if line.startswith("Region: ")]
    assert ", peak in use by a step's buffers " in region, output
    (header,) = [line for line in lines if line.startswith("mode ")]
    assert "peak in use, whole run (MiB)" in header and header.count("peak") == 1, output


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
    assert any(f["filename"].endswith("_autograd.py") for e in trace for f in e["frames"])
    [region] = snapshot["regions"]
    assert region["cached_bytes"] > 0
    assert sum(s["total_size"] for s in snapshot["segments"]) == 2 << 20
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    assert "total_reserved: 2.0MiB" in memory_viz.segsum(snapshot)


def test_train_digits_cupy_mode_needs_a_gpu(run_script):
    proc, output = run_script("examples/train_digits.py", "--device", "simulated", "--mode",
                              "cupy", timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", output
    assert proc.stderr.splitlines() == [
        "train_digits: the cupy mode needs a GPU and CuPy; on the simulated device --mode is one"
        " of region, no-region or all"], output


@pytest.mark.parametrize("device", ["auto", "gpu"], ids=["auto", "asked-for-the-gpu"])
def test_train_digits_cupy_mode_without_a_gpu_says_only_that(run_script, device):
    # One line, no word of training on the simulated device (which the cupy mode cannot do),
    # and no advice to choose a device that would not run it either.
    proc, output = run_script("examples/train_digits.py", "--device", device, "--mode", "cupy",
                              env=NO_GPU, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", output
    (line,) = proc.stderr.splitlines()
    assert line.startswith("train_digits: the cupy mode needs a GPU and CuPy: "), output
    assert line.endswith("; without them --mode is one of region, no-region or all (gpupool's"
                         " simulated device)"), output
    assert "--device" not in line, output


def test_mixed_frameworks_help_works_whatever_is_missing(run_script):
    proc, output = run_script("examples/mixed_frameworks.py", "--help", env=NO_GPU, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", output
    assert proc.stdout.startswith("usage: mixed_frameworks.py"), output
    assert "It needs an NVIDIA GPU, CuPy, numba-cuda and PyTorch" in proc.stdout, output


def test_mixed_frameworks_names_every_missing_library_in_one_line(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import mixed_frameworks

    monkeypatch.setattr(mixed_frameworks, "FRAMEWORKS", (
        ("no_such_lib_a", "lib-a"), ("numpy", "numpy"), ("no_such_lib_b", "lib-b")))
    with pytest.raises(mixed_frameworks.SetupError) as info:
        mixed_frameworks.import_frameworks()
    message = str(info.value)
    assert message.startswith("no_such_lib_a, no_such_lib_b cannot be imported "
                              "(pip install 'gpupool[lib-a,lib-b]'): no_such_lib_a: No module named")
    assert "numpy" not in message and "\n" not in message


def test_no_gpu_gives_the_drivers_reason_without_its_advice(monkeypatch):
    """Not the driver error's advice to use the simulated device, which the GPU examples
    cannot (each says what its own command line offers)."""
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import _gpu

    import gpupool

    def no_device(device):
        raise gpupool.NoDeviceError(
            "CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected (cuInit). Without a GPU, "
            "use gpupool.testing.SimulatedDevice as the upstream: ...")

    monkeypatch.setattr(gpupool, "get_pool", no_device)
    assert _gpu.no_gpu() == ("there is no GPU (CUDA_ERROR_NO_DEVICE: no CUDA-capable device is "
                             "detected (cuInit))")
    assert _gpu.missing("CuPy is not installed", None) == (
        "there is no GPU (CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected (cuInit)), "
        "and CuPy is not installed")
    monkeypatch.setattr(gpupool, "get_pool", lambda device: object())
    assert _gpu.no_gpu() is None
    assert _gpu.missing(None) is None and _gpu.missing() is None
    assert _gpu.missing("CuPy is not installed") == "CuPy is not installed"


def test_mixed_frameworks_names_the_missing_gpu_before_the_missing_libraries(monkeypatch,
                                                                             run_script):
    """Without a GPU the line says so first, whatever is installed: a user learns it before
    installing PyTorch for nothing."""
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import _gpu
    import mixed_frameworks

    monkeypatch.setattr(mixed_frameworks, "FRAMEWORKS", (("numpy", "numpy"),
                                                         ("no_such_lib", "lib")))
    monkeypatch.setattr(_gpu, "no_gpu", lambda: "there is no GPU (why)")
    with pytest.raises(mixed_frameworks.SetupError) as info:
        mixed_frameworks.set_up()
    assert str(info.value).startswith(
        "this example needs an NVIDIA GPU, CuPy, numba-cuda and PyTorch, but there is no GPU "
        "(why), and no_such_lib cannot be imported (pip install 'gpupool[lib]'): ")
    # As run: the GPU hidden, whichever libraries this machine has.
    proc, output = run_script("examples/mixed_frameworks.py", env=NO_GPU, timeout=300)
    assert proc.returncode == 2, output
    assert proc.stderr.startswith("mixed_frameworks: this example needs an NVIDIA GPU, CuPy, "
                                  "numba-cuda and PyTorch, but there is no GPU ("), output


@pytest.mark.parametrize("torch_module", [None, "cpu-only"], ids=["missing", "cpu-only"])
def test_the_torch_examples_name_the_missing_gpu_before_pytorch(monkeypatch, torch_module):
    """train_digits_torch (and sleep_wake, which shares its check): PyTorch missing or built
    without CUDA, the missing GPU is named first."""
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")    # what its import sets
    import _gpu
    import train_digits_torch

    fake = types.SimpleNamespace(
        __version__="2.9.0+cpu", backends=types.SimpleNamespace(
            cuda=types.SimpleNamespace(is_built=lambda: False)),
        cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", fake if torch_module else None)
    monkeypatch.setattr(_gpu, "no_gpu", lambda: "there is no GPU (why)")
    with pytest.raises(train_digits_torch.SetupError) as info:
        train_digits_torch.require_torch_gpu()
    library = ("PyTorch 2.9.0+cpu was built without CUDA" if torch_module else
               "PyTorch cannot be imported: ")
    assert str(info.value).startswith(
        "this example needs an NVIDIA GPU and a CUDA build of PyTorch, but there is no GPU "
        f"(why), and {library}"), str(info.value)


@pytest.mark.parametrize("script, needs", [
    ("train_digits_torch.py", "It needs an NVIDIA GPU, a CUDA build of PyTorch and scikit-learn"),
    ("sleep_wake.py", "It needs an NVIDIA GPU and a CUDA build of PyTorch")])
def test_a_torch_example_s_help_says_what_it_needs(run_script, script, needs):
    proc, output = run_script(f"examples/{script}", "--help", env=NO_GPU, timeout=120)
    assert proc.returncode == 0, output
    assert proc.stdout.startswith(f"usage: {script} "), output
    assert needs in " ".join(proc.stdout.split()), output


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


# On a GPU (marked gpu) -----------------------------------------------------------------

def _require_gpu():
    cupy = pytest.importorskip("cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        pytest.skip(f"no CUDA GPU: {exc}")
    if count == 0:
        pytest.skip("no CUDA GPU")


def _require_torch_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA GPU")


def _summary_header(lines):
    """The index of the summary table's header line (``mode ...``)."""
    return next(i for i, line in enumerate(lines) if line.startswith("mode "))


@pytest.mark.gpu
@flat_memory_unmeasurable
def test_train_digits_region_mode(run_script):
    _require_gpu()
    pytest.importorskip("sklearn", reason="the example's data set ships with scikit-learn")
    proc, output = run_script("examples/train_digits.py", "--device", "gpu", "--epochs", "30",
                              "--mode", "region", "--quiet")
    # Exit status 0 means: test accuracy >= 0.95 and reserved bytes equal after epochs 1 and 30.
    assert proc.returncode == 0, output
    assert "Summary (30 epochs" in proc.stdout, output
    lines = proc.stdout.splitlines()
    header = _summary_header(lines)
    assert "ms/step" in lines[header], output
    row = lines[header + 2].split()
    assert row[0] == "region", output
    assert row[5] == "yes", output  # the flat? column


@pytest.mark.gpu
def test_mixed_frameworks_share_one_pool(run_script):
    _require_gpu()
    for name in ("numba.cuda", "torch"):
        pytest.importorskip(name)
    proc, output = run_script("examples/mixed_frameworks.py")
    # Exit status 0 means every check passed: hand-offs at the producer's address, each
    # library's allocations in the pool, CuPy's own pool empty, results equal to NumPy's.
    assert proc.returncode == 0, output
    checks = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert len(checks) == 8 and all(line.startswith("[ok] ") for line in checks), output
    assert proc.stdout.count("Memory pool usage: ") == 1, output


@pytest.mark.gpu
def test_train_digits_torch_all_modes(run_script):
    _require_torch_gpu()
    pytest.importorskip("sklearn", reason="the example's data set ships with scikit-learn")
    proc, output = run_script("examples/train_digits_torch.py", "--quiet")
    # Exit status 0 means: accuracy >= 0.95 in every mode, the region mode's reserved bytes
    # equal after epochs 1 and 30, and both gpupool modes' losses within 1e-6 of PyTorch's.
    assert proc.returncode == 0, output
    lines = proc.stdout.splitlines()
    header = _summary_header(lines)
    rows = {line.split()[0]: line.split() for line in lines[header + 2:header + 5]}
    assert set(rows) == {"region", "no-region", "torch"}, output
    assert rows["region"][7] == "yes", output  # the flat? column


@pytest.mark.gpu
@pytest.mark.parametrize("upstream", ["vmm", "driver"])
def test_ipc_pipeline_shares_batches_between_processes(run_script, upstream):
    _require_gpu()
    proc, output = run_script("examples/ipc_pipeline.py", "--device", "gpu", "--batches", "32",
                              "--depth", "3", "--upstream", upstream)
    assert proc.returncode == 0, output
    assert proc.stdout.splitlines()[0] == \
        f"ipc_pipeline: sharing batches on the GPU (upstream {upstream!r})", output
    checks = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert len(checks) == 5 and all(line.startswith("[ok] ") for line in checks), output


@pytest.mark.gpu
@pytest.mark.parametrize("compile_mode", ["default", "reduce-overhead"])
def test_train_digits_torch_compiled_with_cudnn_benchmark(run_script, compile_mode):
    _require_torch_gpu()
    pytest.importorskip("sklearn", reason="the example's data set ships with scikit-learn")
    proc, output = run_script("examples/train_digits_torch.py", "--quiet", "--epochs", "10",
                              "--compile", compile_mode, "--cudnn-benchmark")
    # The same checks as the eager run's: accuracy, flat memory in the region mode, the gpupool
    # modes' losses equal to PyTorch's allocator's under the same compiled model.
    assert proc.returncode == 0, output


@pytest.mark.gpu
@pytest.mark.parametrize("allocator", ["gpupool", "pluggable"])
def test_sleep_wake_swaps_a_trainer_and_an_engine(run_script, allocator):
    _require_torch_gpu()
    proc, output = run_script("examples/sleep_wake.py",
                              env=dict(os.environ, GPUPOOL_TORCH_ALLOCATOR=allocator))
    # Exit status 0 means every check passed: the device's free memory after sleep, addresses
    # and bytes kept, the sleeping tag's allocation refused naming it, the losses equal to the
    # run without sleeping, the engine's output kept across its own sleep.
    assert proc.returncode == 0, output
    assert f"allocator {allocator!r}" in proc.stdout.splitlines()[0], output
    checks = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert len(checks) == 6 and all(line.startswith("[ok] ") for line in checks), output


def test_train_digits_help_explains_every_option(run_script):
    proc, output = run_script("examples/train_digits.py", "--help", timeout=120)
    assert proc.returncode == 0, output
    options = proc.stdout.split("options:\n")[1]
    # each option's line (or the line after it) has words after the option itself
    entries = re.split(r"\n  (?=-)", "\n" + options.strip("\n"))
    bare = [e.split()[0] for e in entries if e.strip() and len(e.split("  ", 1)) < 2
            and "\n" not in e.strip()]
    assert bare == [], output
    assert "default 30" in options and "all (default)" in " ".join(options.split()), output


# Every example that runs as a script (the others are its modules).
SCRIPTS = sorted(p.stem for p in (REPO / "examples").glob("*.py")
                 if '__name__ == "__main__"' in p.read_text())

# Runs the example in argv[1] with --help, recording what each add_argument call was given;
# prints them as the last line, as JSON (a default as its text, None where there is none).
RECORD_OPTIONS = """
import argparse, json, os, runpy, sys
options = []
add_argument = argparse.ArgumentParser.add_argument
def recording(self, *names, **kwargs):
    default = kwargs.get("default")
    options.append({"names": names, "help": kwargs.get("help"),
                    "default": None if default in (None, False) else str(default)})
    return add_argument(self, *names, **kwargs)
argparse.ArgumentParser.add_argument = recording
sys.argv = [sys.argv[1], "--help"]
sys.path.insert(0, os.path.dirname(sys.argv[0]))   # as running the script puts its folder
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exit:
    assert exit.code in (0, None), exit.code
print(json.dumps([o for o in options if o["names"] != ("-h", "--help")]))
"""


def test_the_examples_that_run_as_scripts_are_found():
    assert {"ipc_pipeline", "sleep_wake", "train_digits", "train_digits_torch"} <= set(SCRIPTS)


def test_the_examples_modules_that_do_not_run_are_named_as_helpers():
    """Listing examples/ shows what to run: a module that is no script (it does nothing as
    one) carries a ``_`` prefix, as the scripts' helpers do."""
    helpers = [p.name for p in (REPO / "examples").glob("*.py") if p.stem not in SCRIPTS]
    assert "_autograd.py" in helpers
    assert [name for name in helpers if not name.startswith("_")] == []


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_option_of_an_example_is_explained_with_its_default(script):
    proc = subprocess.run([sys.executable, "-c", RECORD_OPTIONS,
                           str(REPO / "examples" / f"{script}.py")],
                          cwd=REPO, env=NO_GPU, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for option in json.loads(proc.stdout.splitlines()[-1]):
        text = option["help"]
        if text == argparse.SUPPRESS:
            continue
        assert text, f"{script}: {option['names']} has no help text"
        if option["default"] is not None:
            shown = "%(default)s" in text or option["default"] in text
            assert shown and "default" in text, \
                f"{script}: {option['names']}'s help does not show its default {option['default']}"
