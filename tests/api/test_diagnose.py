"""gpupool.diagnose and ``python -m gpupool``: the bug report, on this machine and on a fake
driver."""

import enum
import os
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

import pytest
from conftest import REPO, gpu_available

import gpupool
from gpupool import diagnose
from gpupool.adapters import torch_allocator
from gpupool.testing import SimulatedDevice

GIB = 1 << 30


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NO_DEVICE = 100


class FakeDriver:
    """The calls of cuda.bindings.driver that the report makes, on made-up devices."""

    CUresult = CUresult

    def __init__(self, devices=(), init=CUresult.CUDA_SUCCESS, version=13000, retain=None):
        self.devices = list(devices)          # (name, total bytes, free bytes)
        self.init, self.version = init, version
        self.retain = retain or {}            # ordinal -> error of cuDevicePrimaryCtxRetain
        self.current = []                     # the context stack
        self.retained = 0

    def cuInit(self, flags):
        return (self.init,)

    def cuDriverGetVersion(self):
        return CUresult.CUDA_SUCCESS, self.version

    def cuDeviceGetCount(self):
        return CUresult.CUDA_SUCCESS, len(self.devices)

    def cuDeviceGet(self, ordinal):
        return CUresult.CUDA_SUCCESS, ordinal

    def cuDeviceGetName(self, length, dev):
        return CUresult.CUDA_SUCCESS, self.devices[dev][0].encode().ljust(length, b"\0")

    def cuDeviceTotalMem(self, dev):
        return CUresult.CUDA_SUCCESS, self.devices[dev][1]

    def cuDevicePrimaryCtxRetain(self, dev):
        if dev in self.retain:
            return self.retain[dev], None
        self.retained += 1
        return CUresult.CUDA_SUCCESS, f"ctx{dev}"

    def cuDevicePrimaryCtxRelease(self, dev):
        self.retained -= 1
        return (CUresult.CUDA_SUCCESS,)

    def cuCtxPushCurrent(self, ctx):
        self.current.append(ctx)
        return (CUresult.CUDA_SUCCESS,)

    def cuCtxPopCurrent(self):
        return CUresult.CUDA_SUCCESS, self.current.pop()

    def cuMemGetInfo(self):
        dev = int(self.current[-1].removeprefix("ctx"))
        return CUresult.CUDA_SUCCESS, self.devices[dev][2], self.devices[dev][1]


class NoLibcuda:
    def cuInit(self, flags):
        raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via '
                           'system search.')


def _lines(environ=None, driver=None, pools=None, torch=None):
    facts = diagnose.gather(environ=environ or {}, driver=driver or NoLibcuda(),
                            pools=pools or {}, torch=torch)
    return diagnose.format_report(facts).splitlines()


def test_python_dash_m_gpupool_exits_0_and_names_the_driver_problem():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", GPUPOOL_HARD_LIMIT="lots")
    proc = subprocess.run([sys.executable, "-m", "gpupool"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    output = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0 and proc.stderr == "", output
    lines = proc.stdout.splitlines()
    assert lines[0] == f"gpupool {gpupool.__version__}", output
    assert lines[2].startswith("cuda-bindings 13."), output
    driver = [line for line in lines if line.startswith("CUDA driver: ")]
    if gpu_available():          # the driver is there, the devices hidden
        assert driver == ["CUDA driver: cuInit failed: CUDA_ERROR_NO_DEVICE"], output
    else:
        assert len(driver) == 1, output
        assert driver[0].startswith("CUDA driver: none (libcuda cannot be loaded: "), output
    assert not any(line.startswith("Device ") for line in lines), output
    assert "GPUPOOL_HARD_LIMIT: 'lots': the pool refuses it: malformed memory limit" \
        in proc.stdout, output
    assert sum(line.startswith("gpupool's allocator for PyTorch: ") for line in lines) == 1, \
        output
    assert lines[-1] == "Pools: none made in this process", output


def test_help_exits_0():
    proc = subprocess.run([sys.executable, "-m", "gpupool", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "bug report" in proc.stdout, proc.stderr


def test_versions_come_first():
    lines = _lines()
    assert lines[0] == f"gpupool {gpupool.__version__}"
    assert lines[1].startswith(f"Python {sys.version.split()[0]} (")
    assert lines[2].startswith("cuda-bindings ") and lines[3].startswith("NumPy ")


def test_no_driver_is_one_line_and_the_rest_still_shows():
    lines = _lines(environ={"GPUPOOL_SOFT_LIMIT": "1GiB"})
    driver = [line for line in lines if "driver" in line.lower() and "Upstream" not in line]
    assert driver == [
        'CUDA driver: none (libcuda cannot be loaded: "cuda" is an NVIDIA driver library and '
        'can only be found via system search.); gpupool needs one, or '
        'gpupool.testing.SimulatedDevice as the upstream']
    assert "GPUPOOL_SOFT_LIMIT: '1GiB' = 1073741824 B (1.000 GiB)" in lines


@pytest.mark.parametrize("first_line, version", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 07:09:45 UTC 2025",
     "580.65.06"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  "
     "(dvs-builder@U22-I3-AF03-09-1)  Thu Oct 30 01:00:01 UTC 2025", "580.159.04"),
])
def test_the_kernel_modules_version(monkeypatch, tmp_path, first_line, version):
    version_file = tmp_path / "version"
    version_file.write_text(f"{first_line}\nGCC version:  gcc version 12.2.0\n")
    monkeypatch.setattr(diagnose, "_NVIDIA_VERSION_FILE", str(version_file))
    assert f"CUDA driver {version}, CUDA 13.0 (cuDriverGetVersion: 13000)" in _lines(
        driver=FakeDriver([("A", GIB, GIB)]))


def test_devices_driver_and_cuda_versions(monkeypatch, tmp_path):
    version_file = tmp_path / "version"
    version_file.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul"
                            " 27 07:09:45 UTC 2025\nGCC version:  gcc version 12.2.0\n")
    monkeypatch.setattr(diagnose, "_NVIDIA_VERSION_FILE", str(version_file))
    driver = FakeDriver([("NVIDIA H200", 140 * GIB, 139 * GIB), ("NVIDIA H100", 80 * GIB, GIB)],
                        version=13020, retain={1: CUresult.CUDA_ERROR_OUT_OF_MEMORY})
    lines = _lines(driver=driver)
    assert "CUDA driver 580.65.06, CUDA 13.2 (cuDriverGetVersion: 13020)" in lines
    assert "Device 0: NVIDIA H200, 140.000 GiB total, 139.000 GiB free" in lines
    assert ("Device 1: NVIDIA H100, 80.000 GiB total, free memory unknown "
            "(cuDevicePrimaryCtxRetain failed: CUDA_ERROR_OUT_OF_MEMORY)") in lines
    assert not any(line.startswith("CUDA driver: ") for line in lines)
    assert driver.retained == 0 and driver.current == []   # contexts released, stack as found


def test_driver_without_devices(monkeypatch, tmp_path):
    monkeypatch.setattr(diagnose, "_NVIDIA_VERSION_FILE", str(tmp_path / "absent"))
    lines = _lines(driver=FakeDriver(init=CUresult.CUDA_ERROR_NO_DEVICE))
    assert "CUDA driver (version unknown), CUDA 13.0 (cuDriverGetVersion: 13000)" in lines
    assert "CUDA driver: cuInit failed: CUDA_ERROR_NO_DEVICE" in lines
    assert _lines(driver=FakeDriver()).count("CUDA driver: the driver reports no CUDA device") \
        == 1


def test_upstream_from_the_environment():
    assert "Upstream: 'vmm' (the default; GPUPOOL_UPSTREAM is not set)" in _lines()
    assert "Upstream: 'vmm' (the default; GPUPOOL_UPSTREAM is not set)" in _lines(
        environ={"GPUPOOL_UPSTREAM": ""})               # empty: unset, as for the pool
    assert "Upstream: 'async' (GPUPOOL_UPSTREAM)" in _lines(environ={"GPUPOOL_UPSTREAM": "async"})
    assert ("Upstream: 'VMM': the pool refuses it: must be one of driver, async, vmm "
            "(GPUPOOL_UPSTREAM)") in _lines(environ={"GPUPOOL_UPSTREAM": "VMM"})


@pytest.mark.parametrize("raw, totals, expected", [
    ("1073741824", [], "'1073741824' = 1073741824 B (1.000 GiB)"),
    ("512MiB", [80 * GIB], "'512MiB' = 536870912 B (512.000 MiB)"),
    (" 8 GB ", [], "' 8 GB ' = 8000000000 B (7.451 GiB)"),
    ("50%", [80 * GIB, 4 * GIB],
     "'50%' = 42949672960 B (40.000 GiB) on device 0, 2147483648 B (2.000 GiB) on device 1"),
    ("50%", [], "'50%': a share of each device's memory (no device here to resolve it)"),
    ("150%", [GIB], "'150%': the pool refuses it: a percentage limit must be in (0, 100], got"
                    " '150%'"),
    ("0", [], "'0': the pool refuses it: a memory limit must be positive, got '0'"),
])
def test_describe_limit(raw, totals, expected):
    assert diagnose.describe_limit(raw, totals) == expected


def test_a_malformed_limit_is_shown_not_raised():
    text = diagnose.describe_limit("lots", [])
    assert text.startswith("'lots': the pool refuses it: malformed memory limit 'lots';")
    assert "accepted forms" in text


def test_percent_limits_resolve_on_the_fake_devices():
    driver = FakeDriver([("A", 8 * GIB, GIB)])
    assert "GPUPOOL_HARD_LIMIT: '25%' = 2147483648 B (2.000 GiB) on device 0" in _lines(
        environ={"GPUPOOL_HARD_LIMIT": "25%"}, driver=driver)


def test_each_pool_shows_its_repr_and_status(sim):
    pool = gpupool.Pool(upstream=sim)
    buf = pool.allocate(1000)
    lines = _lines(pools={0: pool})
    start = lines.index("Pool of device 0:")
    assert lines[start + 1] == f"  {pool!r}"
    assert lines[start + 2].startswith("  Simulated device memory usage: ")
    assert lines[start + 3] == "  Memory pool usage: 1.000 KiB (2.000 MiB reserved)"
    assert "Pools: none made in this process" not in lines
    del buf


def test_a_pool_whose_status_fails_is_reported_as_such():
    class Broken(SimulatedDevice):
        def _mem_info(self):
            raise RuntimeError("the context is gone")

    pool = gpupool.Pool(upstream=Broken(device=3))
    lines = _lines(pools={3: pool})
    assert lines[-3:-1] == ["Pool of device 3:", f"  {pool!r}"]
    assert lines[-1].startswith("  status unavailable: ")
    assert "the context is gone" in lines[-1]


def test_report_shows_the_default_pools(default_pools):
    gpupool.set_pool(gpupool.Pool(upstream=SimulatedDevice()))
    text = diagnose.report()
    assert "Pool of device 0:\n  <gpupool.Pool device=0 upstream=SimulatedDevice(" in text


def test_other_installed_distributions_are_named(monkeypatch):
    monkeypatch.setattr(diagnose, "FRAMEWORKS", ("pytest", "no-such-distribution"))
    assert f"Also installed: pytest {pytest.__version__}" in _lines()


# gpupool's allocator for PyTorch ------------------------------------------------------------

TORCH_LINE = "gpupool's allocator for PyTorch: "


def fake_torch(root, cuda="13.0"):
    """A PyTorch as the allocator's build sees one: headers, libraries, its CUDA version
    (None: a CPU-only build)."""
    for header in ("c10/cuda/CUDACachingAllocator.h", "torch/csrc/cuda/CUDAPluggableAllocator.h"):
        (root / "include" / header).parent.mkdir(parents=True, exist_ok=True)
        (root / "include" / header).write_text("")
    (root / "lib").mkdir(exist_ok=True)
    for name in torch_allocator.LIBRARIES:
        (root / "lib" / f"lib{name}.so").write_text("")
    return types.SimpleNamespace(
        __version__="2.11.0+cu130", __file__=str(root / "__init__.py"),
        version=types.SimpleNamespace(cuda=cuda),
        backends=types.SimpleNamespace(cuda=types.SimpleNamespace(is_built=lambda: bool(cuda))),
        _C=types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=True))


@pytest.fixture
def buildable(monkeypatch, tmp_path):
    """A fake CUDA PyTorch with every prerequisite of the build (a compiler that only reports
    its version, CUDA headers), its cache in tmp_path."""
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        pytest.skip("this Python has no C headers")
    cuda = tmp_path / "cuda"
    (cuda / "crt").mkdir(parents=True)
    (cuda / "crt" / "host_config.h").write_text("")
    (cuda / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 13000\n")
    monkeypatch.setattr(torch_allocator, "_cuda_candidates", lambda: iter([cuda]))
    monkeypatch.setattr(torch_allocator, "compiler", lambda: sys.executable)
    monkeypatch.setenv("GPUPOOL_CACHE_DIR", str(tmp_path / "cache"))
    return fake_torch(tmp_path / "torch")


def test_the_report_says_the_allocator_for_pytorch_is_still_to_be_built(buildable):
    (line,) = [x for x in _lines(torch=buildable) if x.startswith(TORCH_LINE)]
    path, _command, _cxx = torch_allocator.plan(buildable)
    assert line == (f"{TORCH_LINE}not built yet for PyTorch 2.11.0+cu130: the first "
                    f"gpupool.torch.use() compiles it (a few seconds, with {sys.executable}) "
                    f"into {path.parent}")


def test_the_report_names_the_built_allocator_for_pytorch(buildable):
    path, _command, _cxx = torch_allocator.plan(buildable)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    assert f"{TORCH_LINE}built for PyTorch 2.11.0+cu130: {path}" in _lines(torch=buildable)


def test_the_report_says_why_the_allocator_for_pytorch_cannot_be_built(buildable, tmp_path,
                                                                       monkeypatch):
    (line,) = [x for x in _lines(torch=fake_torch(tmp_path / "cpu", cuda=None))
               if x.startswith(TORCH_LINE)]
    assert line.startswith(f"{TORCH_LINE}cannot be built here: PyTorch 2.11.0+cu130 was built "
                           f"without CUDA")
    assert line.endswith("gpupool.torch.use() serves PyTorch through its pluggable allocator "
                         "instead (malloc and free only)")
    monkeypatch.setattr(torch_allocator, "_cuda_candidates", lambda: iter([]))
    assert any(x.startswith(f"{TORCH_LINE}cannot be built here: no CUDA runtime headers")
               for x in _lines(torch=buildable))


def test_the_report_says_when_pytorch_is_missing_or_the_pluggable_allocator_is_chosen(
        buildable, monkeypatch):
    lines = _lines(environ={"GPUPOOL_TORCH_ALLOCATOR": "pluggable"}, torch=buildable)
    assert any(x.startswith(TORCH_LINE) and x.endswith(
        "(GPUPOOL_TORCH_ALLOCATOR='pluggable': use() takes the pluggable allocator)")
        for x in lines)
    monkeypatch.setattr(diagnose, "_version", lambda name: None)
    assert diagnose.torch_allocator_state() == "PyTorch is not installed"
