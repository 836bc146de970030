"""The examples on a GPU: train_digits trains to >= 0.95 with flat reserved memory in region mode;
mixed_frameworks passes data between CuPy, Numba and PyTorch on one pool; ipc_pipeline shares
batches between two processes through CUDA IPC, on both upstreams that export."""

import pytest
from conftest import flat_memory_unmeasurable


def _require_gpu():
    cupy = pytest.importorskip("cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        pytest.skip(f"no CUDA GPU: {exc}")
    if count == 0:
        pytest.skip("no CUDA GPU")


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
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA GPU")
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
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA GPU")
    pytest.importorskip("sklearn", reason="the example's data set ships with scikit-learn")
    proc, output = run_script("examples/train_digits_torch.py", "--quiet", "--epochs", "10",
                              "--compile", compile_mode, "--cudnn-benchmark")
    # The same checks as the eager run's: accuracy, flat memory in the region mode, the gpupool
    # modes' losses equal to PyTorch's allocator's under the same compiled model.
    assert proc.returncode == 0, output
