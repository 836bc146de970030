"""bench/_samplers.py: real_models.py's memory samplers. The native one (``_sampler.c``) builds
here, without a driver refuses clearly, and on a GPU reads what the Python one reads; the Python
one samples on its thread and keeps the peak (on a scripted driver here)."""

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


def test_the_python_sampler_samples_on_its_thread_and_keeps_the_peak(monkeypatch):
    # A driver of scripted readings: the thread's reads set the peak, take_peak starts over.
    import threading
    import types

    import cuda.bindings

    readings, read = iter([1000, 5000, 2000] + [3000] * 10_000), threading.Event()

    def mem_info():
        used = next(readings)
        read.set()
        return 0, 10_000 - used, 10_000

    fake = types.SimpleNamespace(
        cuInit=lambda flags: (0,), cuDeviceGet=lambda n: (0, n),
        cuDevicePrimaryCtxRetain=lambda dev: (0, "ctx"), cuCtxSetCurrent=lambda ctx: (0,),
        cuMemGetInfo=mem_info)
    monkeypatch.setattr(cuda.bindings, "driver", fake, raising=False)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", fake)
    sampler = _samplers.Sampler(0.0005)
    assert sampler.used() == 1000
    read.clear()
    sampler.start()
    assert read.wait(10)
    sampler.stop()
    assert sampler.take_peak() == 5000
    assert sampler.take_peak() == 3000      # the next period starts at the current value
    monkeypatch.setattr(fake, "cuCtxSetCurrent", lambda ctx: (3,))
    with pytest.raises(RuntimeError, match="cuCtxSetCurrent failed: 3"):
        sampler.used()
