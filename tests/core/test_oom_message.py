"""The OutOfMemoryError's forensics (core/oom.pyx): requests that can never fit, the largest
free block and fragmentation, bytes by owner and stream, other processes' use (NVML), and the
GPUPOOL_OOM_SNAPSHOT dump, on the simulated device."""
import logging
import os
import pickle
import subprocess
import sys
import types

import pytest

import gpupool
from gpupool.core import oom
from gpupool.stats import format_bytes
from gpupool.testing import SimulatedDevice

MIB = 1 << 20


def oom_of(pool, nbytes):
    with pytest.raises(gpupool.OutOfMemoryError) as info:
        pool.allocate(nbytes)
    return info.value


def test_a_request_above_the_hard_limit_can_never_fit():
    pool = gpupool.Pool(hard_limit=1000, upstream=SimulatedDevice())
    error = oom_of(pool, 2000)
    message = str(error)
    assert "can never fit: 2000 B requested, hard limit 1000 B" in message
    assert "Free buffers" not in message and "GPUPOOL_HARD_LIMIT" in message
    assert (error.requested_bytes, error.limit_bytes, error.in_use_bytes) == (2000, 1000, 0)
    assert pickle.loads(pickle.dumps(error)).by_owner == error.by_owner == {"pool": 0}


@pytest.mark.parametrize("page, limit, nbytes, needs, holds", [
    (2 * MIB, "3MB", 2_500_000, "2 pages of 2.000 MiB", "1 page of 2.000 MiB"),
    (4096, 3 * 4096 + 100, 3 * 4096 + 50, "4 pages of 4.000 KiB", "3 pages of 4.000 KiB"),
])
def test_a_request_whose_pages_exceed_the_hard_limit_can_never_fit(page, limit, nbytes, needs,
                                                                    holds):
    """On an expandable upstream the pool maps whole pages: a request within the limit whose
    pages are not is refused, the message naming the pages, and the limit's whole pages
    serve."""
    pool = gpupool.Pool(hard_limit=limit, upstream=SimulatedDevice(virtual_memory=True,
                                                                   page=page))
    error = oom_of(pool, nbytes)
    message = str(error)
    exact = pool.hard_limit
    assert (f"the request can never fit: it needs {needs} (the upstream maps whole pages) and "
            f"the hard limit {format_bytes(exact)} ({exact} B) holds {holds}") in message
    assert "Raise the limit to a whole number of pages" in message
    # A simulated device: the fix named is one the simulated device takes.
    assert "a gpupool.testing.SimulatedDevice without virtual_memory=True, whose segments " \
        "can be the exact request" in message
    assert "upstream='driver'" not in message and "Free buffers" not in message
    assert (error.requested_bytes, error.limit_bytes) == (nbytes, exact)
    largest = exact // page * page
    assert pool.allocate(largest).nbytes == largest
    assert pool._verify() == []


@pytest.mark.parametrize("virtual_memory", [False, True])
def test_a_request_above_the_simulated_device_s_memory_can_never_fit(virtual_memory):
    """The simulated device declares its total (``total_bytes``): a fresh pool's error names
    it, without a mem_info call."""
    sim = SimulatedDevice(virtual_memory=virtual_memory)            # 1 GiB
    error = oom_of(gpupool.Pool(upstream=sim), 2 << 30)
    message = str(error)
    assert ("the request can never fit: 2147483648 B requested, the device has 1.000 GiB "
            "(1073741824 B). Split the allocation") in message
    assert "Free buffers" not in message
    assert error.device_total_bytes == sim.total_bytes == 1 << 30
    assert "mem_info" not in [name for name, _ in sim.calls]


class Undeclared(SimulatedDevice):
    """A Python upstream that declares no total, as one of a user's own may not."""

    total_bytes = None


def test_an_undeclared_total_is_known_once_mem_info_is_called():
    sim = Undeclared(capacity=4 * MIB)
    pool = gpupool.Pool(upstream=sim)
    assert oom_of(pool, 8 * MIB).device_total_bytes is None     # not asked: no driver call
    assert pool.mem_info() == (4 * MIB, 4 * MIB)                # remembered from here on
    sim.calls.clear()
    error = oom_of(pool, 8 * MIB)
    assert "can never fit: 8388608 B requested, the device has 4.000 MiB (4194304 B)" in str(
        error)
    assert error.device_total_bytes == 4 * MIB and error.device_free_bytes is None
    assert "mem_info" not in [name for name, _ in sim.calls]


def test_fragmented_cache_is_counted_exactly():
    pool = gpupool.Pool(hard_limit=8 * MIB, upstream=SimulatedDevice())
    bufs = [pool.allocate(MIB) for _ in range(8)]
    del bufs[::2]                          # four free 1 MiB blocks, each between live ones
    error = oom_of(pool, 4 * MIB)
    assert (error.cached_bytes, error.largest_free_bytes, error.unusable_cached_bytes) == (
        4 * MIB, MIB, 4 * MIB)
    assert (error.in_use_bytes, error.reserved_bytes) == (4 * MIB, 8 * MIB)
    message = str(error)
    assert "largest free block 1.000 MiB" in message
    assert "4.000 MiB of the cached bytes cannot serve this request: fragmentation" in message
    assert "can never fit" not in message and "Free buffers" in message
    # The way out of fragmentation named for this upstream, not a GPU's (upstream='vmm').
    assert "(gpupool.testing.SimulatedDevice(virtual_memory=True) grows segments instead)" in \
        message and "upstream='vmm'" not in message
    assert error.by_stream == {0: 4 * MIB}
    del bufs


def test_an_expandable_pool_is_not_told_to_use_expandable_segments():
    pool = gpupool.Pool(hard_limit=8 * MIB, upstream=SimulatedDevice(virtual_memory=True))
    bufs = [pool.allocate(MIB // 2) for _ in range(16)]
    del bufs[::2]                          # eight free 512 KiB blocks, each between live ones
    error = oom_of(pool, 3 * MIB)
    message = str(error)
    assert error.unusable_cached_bytes > 0 and "fragmentation" in message
    assert "fragmented memory joins once the buffers between its blocks are freed" in message
    assert "grows segments instead" not in message and "virtual_memory=True" not in message
    del bufs


def test_cached_blocks_that_could_serve_are_not_unusable():
    pool = gpupool.Pool(hard_limit=8 * MIB, upstream=SimulatedDevice())
    bufs = [pool.allocate(MIB) for _ in range(8)]
    del bufs[::2]
    error = oom_of(pool, 6 * MIB)
    assert error.unusable_cached_bytes == 4 * MIB
    small = gpupool.Pool(hard_limit=MIB, upstream=SimulatedDevice())
    keep = small.allocate(MIB)
    error = oom_of(small, 512)
    assert (error.cached_bytes, error.unusable_cached_bytes, error.largest_free_bytes) == (
        0, 0, 0)
    assert "fragmentation" not in str(error)
    del keep, bufs


def test_bytes_by_owner_name_the_region_holding_them():
    pool = gpupool.Pool(hard_limit=4 * MIB, upstream=SimulatedDevice())
    outside = pool.allocate(MIB)
    region = gpupool.Region(pool=pool, name="step")
    with region:
        inside = pool.allocate(2 * MIB)
        error = oom_of(pool, 2 * MIB)
    owners = error.by_owner
    assert owners.pop("pool") == MIB
    [(label, nbytes)] = owners.items()
    assert label.startswith("region ") and label.endswith(" 'step'") and nbytes == 2 * MIB
    assert f"In use by {label} 2.000 MiB, pool 1.000 MiB" in str(error)
    assert sum(error.by_stream.values()) == error.in_use_bytes == 3 * MIB
    del outside, inside


def test_the_message_for_adapters_is_the_same(sim):
    pool = gpupool.Pool(hard_limit=MIB, upstream=sim)
    assert "can never fit: 2097152 B requested, hard limit 1.000 MiB (1048576 B)" in (
        pool._oom_message(2 * MIB))


def test_without_nvml_or_a_device_others_use_is_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)        # not installed
    assert oom.nvml_memory(0) is None
    error = oom_of(gpupool.Pool(hard_limit=MIB, upstream=SimulatedDevice()), 2 * MIB)
    assert error.device_used_by_others_bytes is None


def fake_nvml(count=1, fail=False):
    process = types.SimpleNamespace
    calls = []

    def handle_by_index(index):
        calls.append(("index", index))
        return index

    def memory_info(handle):
        if fail:
            raise RuntimeError("NVML_ERROR_UNKNOWN")
        return types.SimpleNamespace(free=3 * MIB, total=16 * MIB, used=13 * MIB)

    module = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: count, nvmlDeviceGetHandleByIndex=handle_by_index,
        nvmlDeviceGetHandleByUUID=lambda uuid: calls.append(("uuid", uuid)) or uuid,
        nvmlDeviceGetMemoryInfo=memory_info,
        nvmlDeviceGetComputeRunningProcesses=lambda handle: [
            process(pid=os.getpid(), usedGpuMemory=8 * MIB),
            process(pid=-1, usedGpuMemory=5 * MIB), process(pid=-2, usedGpuMemory=None)])
    return module, calls


def test_nvml_gives_other_processes_use_and_is_failure_tolerant(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    module, calls = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    assert oom.nvml_memory(0) == (3 * MIB, 16 * MIB, 5 * MIB)       # this process excluded
    assert calls == [("index", 0), "shutdown"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234,3")
    assert oom.nvml_memory(0) is not None and ("uuid", "GPU-1234") in calls
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-5")
    assert oom.nvml_memory(0) is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    module, _ = fake_nvml(count=2)               # NVML's order may not be CUDA's
    monkeypatch.setitem(sys.modules, "pynvml", module)
    assert oom.nvml_memory(1) is None
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert oom.nvml_memory(1) is not None
    module, calls = fake_nvml(fail=True)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    assert oom.nvml_memory(0) is None and calls[-1] == "shutdown"


def test_the_first_out_of_memory_writes_the_snapshot_once(tmp_path, monkeypatch, caplog):
    path = tmp_path / "oom.pickle"
    monkeypatch.setenv("GPUPOOL_OOM_SNAPSHOT", str(path))
    pool = gpupool.Pool(hard_limit=2 * MIB, upstream=SimulatedDevice())
    keep = pool.allocate(MIB)
    with caplog.at_level(logging.WARNING, logger="gpupool"):
        oom_of(pool, 2 * MIB)
    assert [r.levelno for r in caplog.records if str(path) in r.getMessage()] == [
        logging.WARNING]
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert {"segments", "device_traces", "allocator_settings", "regions"} <= set(snapshot)
    assert any(b["state"] == "active_allocated" and b["size"] == MIB
               for s in snapshot["segments"] for b in s["blocks"])
    path.unlink()
    oom_of(pool, 2 * MIB)                       # only once per process
    assert not path.exists()
    del keep


def test_a_snapshot_that_cannot_be_written_is_logged_and_the_error_stays(tmp_path):
    code = ("import logging, gpupool; from gpupool.testing import SimulatedDevice\n"
            "logging.basicConfig(level=logging.WARNING)\n"
            "pool = gpupool.Pool(hard_limit=1 << 20, upstream=SimulatedDevice())\n"
            "try:\n    pool.allocate(2 << 20)\n"
            "except gpupool.OutOfMemoryError as e:\n    print('raised', e.requested_bytes)\n")
    env = dict(os.environ, GPUPOOL_OOM_SNAPSHOT=str(tmp_path / "missing" / "oom.pickle"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"raised {2 << 20}"
    assert "could not be written" in done.stderr and "No such file" in done.stderr
