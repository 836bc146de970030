"""bench/_samplers.py's NativeSampler (``_sampler.c``): real_models.py's memory sampler read by
a native thread. It builds here; without a driver it refuses clearly; on a GPU it reads what the
Python sampler reads."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench"))

import _samplers  # noqa: E402
import real_models  # noqa: E402


def driver_present():
    try:
        _samplers.NativeSampler(0.001)
    except RuntimeError as exc:
        if "no CUDA driver" in str(exc):
            return False
        raise
    return True


@pytest.mark.skipif(driver_present(), reason="a CUDA driver is present")
def test_without_a_driver_it_builds_and_refuses_naming_the_driver():
    with pytest.raises(RuntimeError, match="no CUDA driver: libcuda.so.1"):
        _samplers.NativeSampler(0.001)


@pytest.mark.gpu
def test_on_a_gpu_it_reads_what_the_python_sampler_reads_and_keeps_the_peak():
    native, python = _samplers.NativeSampler(0.0005), _samplers.Sampler(0.0005)
    used = native.used()
    assert used > 0 and abs(used - python.used()) < 64 << 20
    native.start()
    native.sample("forward")
    native.stop()
    assert native.take_peak() >= used > 0
    with pytest.raises(ValueError, match="period_ns must be > 0"):
        _samplers.NativeSampler(0).start()


def test_the_sampler_option_reaches_each_runs_process(monkeypatch):
    seen = []

    def fake_child(model, column, steps, trace_path, cudnn_benchmark):
        seen.append(os.environ.get(_samplers.ENV))
        return {"error": "not run"}

    monkeypatch.setattr(real_models, "run_child", fake_child)
    monkeypatch.setattr(real_models._common, "cuda_torch_or_skip", lambda *a: None)
    monkeypatch.setattr(real_models, "report", lambda out: "")
    monkeypatch.setattr(real_models._common, "finish", lambda result, start, report, path: 0)
    monkeypatch.setenv(_samplers.ENV, "python")     # put back after the test
    assert real_models.main(["--models", "gpt2", "--columns", "gp.vmm", "--sampler",
                             "native"]) == 0
    assert seen == ["native"]
