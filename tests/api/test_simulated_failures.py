"""``gpupool.testing.Failures``: which simulated driver calls fail, when, and how; injected
with ``SimulatedDevice(failures=...)`` and ``sim.inject``."""

import pytest

import gpupool
from gpupool.testing import Failures, SimulatedDevice


def test_the_nth_call_fails_as_out_of_memory_and_only_it():
    sim = SimulatedDevice(failures=Failures("alloc", nth=2))
    first = sim._alloc(512)
    with pytest.raises(MemoryError, match="injected failure of alloc"):
        sim._alloc(512)
    sim._free(sim._alloc(512))                         # the third works again
    sim._free(first)
    assert [name for name, _ in sim.calls] == ["alloc", "alloc", "alloc", "free", "free"]
    assert sim.used == 0                                # the failed call took nothing
    assert [(name, args) for name, args, _ in sim.failures.injected] == [("alloc", (512,))]


def test_times_fails_that_many_calls_and_none_every_one_after():
    sim = SimulatedDevice(failures=Failures(("event_record", "free"), nth=2, times=2))
    event = sim._event_create()
    outcomes = []
    for call in (lambda: sim._event_record(event, 0), lambda: sim._free(sim._alloc(1)),
                 lambda: sim._event_record(event, 0), lambda: sim._event_record(event, 0)):
        try:
            call()
            outcomes.append("ok")
        except gpupool.CudaError as exc:
            outcomes.append(exc.name)
    # The free is the second call of the named kinds, the third record the third.
    assert outcomes == ["ok", "CUDA_ERROR_UNKNOWN", "CUDA_ERROR_UNKNOWN", "ok"]
    assert sim.used == 1                                # the failed free freed nothing
    sim.inject(Failures("free", nth=1, times=None))
    for _ in range(3):
        with pytest.raises(gpupool.CudaError):
            sim._free(next(iter(sim._arrays)))


def test_other_calls_fail_with_a_cuda_error_of_the_code_given():
    sim = SimulatedDevice(failures=Failures("synchronize", nth=1))
    with pytest.raises(gpupool.CudaError) as info:
        sim._synchronize()
    assert (info.value.code, info.value.name) == (999, "CUDA_ERROR_UNKNOWN")
    assert info.value.message == sim.failures.injected[0][2]
    sim.inject(Failures("alloc", nth=1, code=700))      # a memory call, another code
    with pytest.raises(gpupool.CudaError) as info:
        sim._alloc(1)
    assert (info.value.code, info.value.name) == (700, "CUDA_ERROR_ILLEGAL_ADDRESS")
    sim.inject(Failures("event_record", nth=1, code=2))
    with pytest.raises(MemoryError):
        sim._event_record(sim._event_create(), 0)


def test_a_rate_fails_the_same_calls_for_the_same_seed():
    def failed(seed):
        sim = SimulatedDevice(failures=Failures("mem_info", rate=0.3, seed=seed))
        out = []
        for _ in range(200):
            try:
                sim._mem_info()
                out.append(False)
            except gpupool.CudaError:
                out.append(True)
        assert len(sim.failures.injected) == sum(out) and sim.failures.seen == 200
        return out

    assert failed(1) == failed(1) != failed(2)
    assert 30 < sum(failed(1)) < 90


def test_the_steps_of_a_map_fail_in_order_and_map_nothing():
    sim = SimulatedDevice(capacity=1 << 22, virtual_memory=True, page=1 << 20)
    va = sim._reserve()
    for step, error in (("create", MemoryError), ("map", MemoryError),
                        ("set_access", gpupool.CudaError)):
        sim.inject(Failures(step, nth=1))
        with pytest.raises(error, match=f"injected failure of {step}"):
            sim._map(va, 1 << 20)
        assert sim.used == 0 and not sim.mapped(va)
    sim.inject(None)
    sim._map(va, 1 << 20)
    assert sim.mapped(va)


def test_stream_id_fails_without_a_log_entry():
    sim = SimulatedDevice(failures=Failures("stream_id", nth=1))
    stream = sim.create_stream()
    with pytest.raises(gpupool.CudaError):
        sim._stream_id(stream)
    assert sim._stream_id(stream) > 0 and sim.calls == []


def test_inject_replaces_and_clears():
    sim = SimulatedDevice()
    assert sim.failures is None
    failures = Failures("trim", nth=1)
    assert sim.inject(failures) is failures and sim.failures is failures
    assert sim.inject(None) is None
    sim._trim()
    assert failures.seen == 0
    with pytest.raises(TypeError, match="Failures or None"):
        sim.inject("alloc")
    with pytest.raises(TypeError, match="Failures or None"):
        SimulatedDevice(failures={"alloc": 1})


@pytest.mark.parametrize("calls, keywords, match", [
    ("malloc", {"nth": 1}, "unknown call names \\['malloc'\\]"),
    ((), {"nth": 1}, "unknown call names"),
    ("alloc", {"nth": 1, "rate": 0.5}, "either nth"),
    ("alloc", {}, "either nth"),
    ("alloc", {"nth": 0}, "nth must be"),
    ("alloc", {"nth": 1, "times": 0}, "times must be"),
    ("alloc", {"rate": 1.5}, "rate must be"),
    ("alloc", {"nth": 1, "code": 0}, "code must be"),
    ("alloc", {"nth": 1, "code": 123456}, "code must be"),
])
def test_bad_specs_are_refused(calls, keywords, match):
    with pytest.raises(ValueError, match=match):
        Failures(calls, **keywords)


def test_repr_says_what_fails_and_how_often():
    failures = Failures("alloc", rate=0.5, seed=3)
    assert repr(failures) == "Failures(['alloc'], rate=0.5, seed=3: 0 injected of 0 calls)"
    assert "nth=2, times=1, code=700" in repr(Failures(("free",), nth=2, code=700))
