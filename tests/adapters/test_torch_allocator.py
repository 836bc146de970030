"""gpupool's C++ allocator for PyTorch (src/torch_allocator.cc, adapters/torch_allocator.py)
without a GPU: the source compiles against the installed PyTorch's headers and against other
versions' (GPUPOOL_TORCH_HEADERS), a version mismatch is caught at compile time, the loader
names why it cannot build, and gpupool.torch.use() falls back to the pluggable allocator then.

GPUPOOL_TORCH_HEADERS adds header trees of other PyTorch versions to compile against:
``VERSION=DIR`` entries separated by ``os.pathsep``, DIR holding (part of) a PyTorch include
tree such as the ``headers`` step of tools/gpu/gpu-check.sh returns (c10, ATen/cuda,
torch/csrc/cuda), laid over the installed PyTorch's for what it lacks. The GPU tests of the
allocator are in tests/adapters/test_torch.py (tests/torch_child.py)."""

import os
import subprocess
import types
import warnings
from pathlib import Path

import pytest
from conftest import simulated_default_pool

import gpupool.torch
from gpupool.adapters import torch_allocator as ta

pytestmark = pytest.mark.usefixtures("default_pools")


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def toolchain(torch):
    """(compiler, CUDA include folder) to compile with; skips where there is none."""
    try:
        cxx = ta.compiler()
        cuda = ta.cuda_include("13.0")
    except ta.Unavailable as exc:
        pytest.skip(f"cannot compile here: {exc}")
    if not (ta.torch_includes(torch)[0] / "c10/cuda/CUDACachingAllocator.h").is_file():
        pytest.skip("the installed PyTorch ships no c10/cuda headers")
    return cxx, cuda


def compile_source(command):
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    return result.returncode, result.stderr


def version_shim(folder, major, minor):
    """A folder whose torch/version.h says PyTorch major.minor (searched first)."""
    (folder / "torch").mkdir(parents=True, exist_ok=True)
    (folder / "torch" / "version.h").write_text(
        f"#pragma once\n#define TORCH_VERSION_MAJOR {major}\n#define TORCH_VERSION_MINOR "
        f"{minor}\n#define TORCH_VERSION_PATCH 0\n#define TORCH_VERSION \"{major}.{minor}.0\"\n")
    return folder


def other_versions():
    entries = [e for e in os.environ.get("GPUPOOL_TORCH_HEADERS", "").split(os.pathsep) if e]
    return [pytest.param(*entry.split("=", 1), id=entry.split("=", 1)[0]) for entry in entries] \
        or [pytest.param(None, None, marks=pytest.mark.skip(
            reason="set GPUPOOL_TORCH_HEADERS=VERSION=DIR (e.g. 2.11=/path/to/torch-headers) "
                   "to compile against another PyTorch's headers"))]


# Compiling ----------------------------------------------------------------------------------

def test_it_compiles_to_an_object_against_the_installed_pytorch(torch, toolchain, tmp_path):
    cxx, cuda = toolchain
    out = tmp_path / "allocator.o"
    command = ta.compile_command(out, ta.torch_includes(torch), cuda, abi=ta._abi(torch),
                                 mode="object", cxx=cxx)
    status, errors = compile_source([*command, "-Wall", "-Werror"])
    assert status == 0, errors
    symbols = _symbols(out)
    assert "gpupool_torch_install" in symbols and "gpupool_torch_built_for" in symbols


def test_the_linked_library_exports_its_two_entry_points(torch, toolchain, tmp_path):
    # Linked against libc10 only (a CPU build has no CUDA libraries; a shared library may
    # leave symbols to the process): the class stays hidden, the two C functions are exported.
    cxx, cuda = toolchain
    out = tmp_path / "allocator.so"
    lib = Path(torch.__file__).parent / "lib"
    status, errors = compile_source(ta.compile_command(
        out, ta.torch_includes(torch), cuda, abi=ta._abi(torch), torch_lib=lib, cxx=cxx,
        libraries=("c10",)))
    assert status == 0, errors
    try:
        listing = subprocess.run(["nm", "-D", "--defined-only", str(out)], capture_output=True,
                                 text=True, timeout=60).stdout
    except OSError:
        pytest.skip("no nm here")
    strong = [line.split()[-1] for line in listing.splitlines() if " T " in line]
    # (A compiler that links its C++ runtime in statically exports the runtime's functions
    # too, as the H200 machine's does: only gpupool's own names are checked.)
    ours = sorted(name for name in strong if "gpupool" in name.lower())
    assert ours == ["gpupool_torch_built_for", "gpupool_torch_install"], listing


def _symbols(path):
    """The global symbols an object file defines (nm), or all of it where nm is missing."""
    try:
        return subprocess.run(["nm", "-g", "--defined-only", str(path)], capture_output=True,
                              text=True, timeout=60).stdout
    except OSError:
        return Path(path).read_bytes().decode(errors="replace")


@pytest.mark.parametrize(("version", "folder"), other_versions())
def test_it_compiles_against_another_pytorch_s_headers(torch, toolchain, tmp_path, version,
                                                       folder):
    cxx, cuda = toolchain
    if not (Path(folder) / "c10/cuda/CUDACachingAllocator.h").is_file():
        pytest.skip(f"{folder} holds no c10/cuda/CUDACachingAllocator.h")
    major, minor = version.split(".")[:2]
    includes = [Path(folder), *ta.torch_includes(torch)]
    if not (Path(folder) / "torch/version.h").is_file():
        includes.insert(0, version_shim(tmp_path / "shim", major, minor))
    command = ta.compile_command(None, includes, cuda, mode="syntax", cxx=cxx)
    status, errors = compile_source(command)
    assert status == 0, errors


def test_a_version_mismatch_fails_the_compile(torch, toolchain, tmp_path):
    # The installed PyTorch's CUDAAllocator under another version's macros: the class misses
    # (or has one too many) overrides, which the compiler refuses; a silent ABI mismatch
    # cannot get through, since the allocator is always compiled against the headers of the
    # PyTorch it is loaded into.
    cxx, cuda = toolchain
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    other = (2, 11) if (major, minor) >= (2, 13) else (2, 13)
    includes = [version_shim(tmp_path / "shim", *other), *ta.torch_includes(torch)]
    status, errors = compile_source(ta.compile_command(None, includes, cuda, mode="syntax",
                                                       cxx=cxx))
    assert status != 0
    assert "abstract" in errors or "override" in errors, errors


# Why it cannot be built ---------------------------------------------------------------------

def test_without_cuda_pytorch_the_reason_says_so(torch):
    if torch.backends.cuda.is_built():
        pytest.skip("this PyTorch has CUDA")
    with pytest.raises(ta.Unavailable, match="built without CUDA"):
        ta.install(torch)


def test_no_compiler_is_named(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(ta.Unavailable, match=r"\$CXX=no-such-compiler-here.*apt install g\+\+"):
        ta.compiler()


def test_missing_cuda_headers_name_the_wheels(monkeypatch, tmp_path):
    monkeypatch.setattr(ta, "_cuda_candidates", lambda: iter([tmp_path]))
    with pytest.raises(ta.Unavailable, match="nvidia-cuda-crt"):
        ta.cuda_include("13.0")


def test_the_cuda_headers_of_pytorch_s_major_version_are_chosen(monkeypatch, tmp_path):
    folders = []
    for major in (12, 13):
        folder = tmp_path / f"cu{major}"
        (folder / "crt").mkdir(parents=True)
        (folder / "crt" / "host_config.h").write_text("")
        (folder / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION {major}080\n")
        folders.append(folder)
    monkeypatch.setattr(ta, "_cuda_candidates", lambda: iter(folders))
    assert ta.cuda_include("13.0") == folders[1]
    assert ta.cuda_include("12.8") == folders[0]
    assert ta.cuda_include(None) == folders[0]


def test_a_failed_compile_keeps_a_log_and_quotes_the_error(torch, toolchain, monkeypatch,
                                                           tmp_path):
    broken = tmp_path / "broken.cc"
    broken.write_text("int main( { return 0; }\n")
    monkeypatch.setattr(ta, "SOURCE", broken)
    monkeypatch.setattr(ta, "_check_torch", lambda torch: tmp_path)
    monkeypatch.setenv("GPUPOOL_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ta.Unavailable, match="compiling it against PyTorch .* failed") as info:
        ta.build(torch)
    log = Path(str(info.value).split("the log is ")[1].split(")")[0])
    assert log.is_file() and "broken.cc" in log.read_text()
    assert "error" in str(info.value)
    assert not list((tmp_path / "cache" / "torch-allocator").glob("*.so*"))   # no partial file


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUPOOL_CACHE_DIR", str(tmp_path / "a"))
    assert ta.cache_dir() == tmp_path / "a" / "torch-allocator"
    monkeypatch.delenv("GPUPOOL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ta.cache_dir() == tmp_path / "xdg" / "gpupool" / "torch-allocator"


# use() falls back ---------------------------------------------------------------------------

@pytest.fixture
def fake_cuda_torch(torch, monkeypatch):
    """gpupool.torch sees a PyTorch with CUDA whose allocator records what it is given (the
    real one's headers, libraries and version); use() state is restored after."""
    chosen = []
    fake = types.SimpleNamespace(
        __version__=torch.__version__, __file__=torch.__file__, _C=torch._C,
        version=torch.version, backends=torch.backends,
        cuda=types.SimpleNamespace(
            is_initialized=lambda: False,
            memory=types.SimpleNamespace(change_current_allocator=chosen.append)))
    monkeypatch.setattr(gpupool.torch, "_installed", None)
    monkeypatch.setattr(gpupool.torch, "_cuda_torch", lambda: fake)
    monkeypatch.setattr(gpupool.torch, "_allocator", lambda malloc: ("pluggable", malloc))
    # Tensor sharing (tests/ipc/test_ipc_torch.py, test_torch.py) needs the real PyTorch's classes.
    monkeypatch.setattr(gpupool.torch, "_share_through_gpupool", lambda torch: None)
    return chosen


def test_use_falls_back_to_the_pluggable_allocator_with_a_warning(torch, fake_cuda_torch,
                                                                  monkeypatch):
    monkeypatch.setattr(ta, "install", lambda torch: (_ for _ in ()).throw(
        ta.Unavailable("no C++ compiler was found to build it")))
    with pytest.warns(RuntimeWarning) as record:
        gpupool.torch.use()
    assert len(record) == 1
    message = str(record[0].message)
    assert "no C++ compiler was found" in message
    assert "GPUPOOL_TORCH_ALLOCATOR=pluggable" in message and "memory_stats()" in message
    assert fake_cuda_torch == [("pluggable", gpupool.torch._MALLOC_GLOBAL)]
    assert gpupool.torch.allocator() == "pluggable"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gpupool.torch.use()                     # once installed, no second warning
    assert len(fake_cuda_torch) == 1


def test_the_real_loader_falls_back_on_this_pytorch(torch, fake_cuda_torch):
    if torch.backends.cuda.is_built():
        pytest.skip("this PyTorch has CUDA")
    with pytest.warns(RuntimeWarning, match="built without CUDA"):
        gpupool.torch.use()
    assert gpupool.torch.allocator() == "pluggable"


def test_the_pluggable_allocator_can_be_chosen(fake_cuda_torch, monkeypatch):
    monkeypatch.setenv("GPUPOOL_TORCH_ALLOCATOR", "pluggable")
    monkeypatch.setattr(ta, "install", lambda torch: pytest.fail("not chosen"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gpupool.torch.use()
    assert gpupool.torch.allocator() == "pluggable"


def test_gpupool_s_allocator_is_installed_when_it_loads(fake_cuda_torch, monkeypatch):
    monkeypatch.setattr(ta, "install", lambda torch: "2.13.0")
    gpupool.torch.use()
    assert gpupool.torch.allocator() == "gpupool" and fake_cuda_torch == []
    with pytest.raises(gpupool.GpupoolError, match="already routes every PyTorch allocation"):
        gpupool.torch.mempool()


def test_a_refusal_for_an_initialized_allocator_is_the_too_late_error(fake_cuda_torch,
                                                                     monkeypatch):
    def refuse(torch):
        raise RuntimeError("Can't swap an already initialized allocator")

    monkeypatch.setattr(ta, "install", refuse)
    with pytest.raises(gpupool.GpupoolError, match="must run before PyTorch's first CUDA"):
        gpupool.torch.use()
    assert gpupool.torch.allocator() is None


def test_a_bad_choice_is_refused(fake_cuda_torch, monkeypatch):
    monkeypatch.setenv("GPUPOOL_TORCH_ALLOCATOR", "native")
    with pytest.raises(ValueError, match="GPUPOOL_TORCH_ALLOCATOR='native'"):
        gpupool.torch.use()


# The allocator's logic, run on the simulated device ----------------------------------------
# tests/adapters/torch_allocator_harness.cc includes the allocator's source with host-only stand-ins
# for the c10::cuda and CUDA runtime functions it calls: the class runs over gpupool's real C
# API (and gpupool.torch's failure messages), on a pool of the simulated device.

MiB = 1 << 20
HARNESS = Path(__file__).with_name("torch_allocator_harness.cc")
STATS = ("allocated", "allocated_peak", "allocated_total", "freed_total", "reserved",
         "reserved_peak", "allocations", "allocations_total", "frees_total", "segments",
         "retries", "ooms", "device_allocs", "device_frees", "active")


class Harness:
    """The harness library: calls that raise on a nonzero status with the C++ error."""

    def __init__(self, path):
        import ctypes

        self.c = ctypes
        self.lib = ctypes.PyDLL(str(path))
        self.nogil = ctypes.CDLL(str(path))     # the same library; calls release the GIL
        self.lib.h_error.restype = ctypes.c_char_p
        ta.install_into(self.lib)
        self.call("h_init")

    def call(self, name, *args):
        if getattr(self.lib, name)(*args) != 0:
            raise RuntimeError(self.lib.h_error().decode())

    def value(self, name, *args, kind=None):
        out = (kind or self.c.c_size_t)()
        self.call(name, *args, self.c.byref(out))
        return out.value

    def allocate(self, nbytes, stream=0):
        self.lib.h_set_stream(self.c.c_size_t(stream))
        return self.value("h_allocate", self.c.c_size_t(nbytes))

    def drop(self, ptr):
        self.call("h_drop", self.c.c_size_t(ptr))

    def stats(self):
        out = (self.c.c_int64 * len(STATS))()
        self.call("h_stats", out)
        return dict(zip(STATS, out, strict=True))

    def pool(self, name, pool_id, *args):
        return self.call(name, self.c.c_uint64(pool_id[0]), self.c.c_uint64(pool_id[1]), *args)

    def live(self, pool_id, ptrs):
        array = (self.c.c_size_t * max(len(ptrs), 1))(*ptrs)
        out = self.c.c_int()
        self.pool("h_check_live", pool_id, array, self.c.c_size_t(len(ptrs)), self.c.byref(out))
        return bool(out.value)

    def use_count(self, pool_id):
        out = self.c.c_int()
        self.pool("h_use_count", pool_id, self.c.byref(out))
        return out.value


@pytest.fixture(scope="module")
def harness(torch, toolchain, tmp_path_factory):
    if torch.version.cuda is not None:
        # The stand-ins replace c10::cuda functions that a CUDA build's libc10_cuda, loaded in
        # this process, defines too. On the H200 machine the process crashed (a segmentation
        # fault at the harness's first allocation); the cause was not found (a statically
        # linked C++ runtime, which that machine's compiler uses, does not crash it with a CPU
        # build). There tests/adapters/test_torch.py tests the real allocator under use().
        pytest.skip("the host-only harness needs a CPU build of PyTorch (this one has CUDA: "
                    "tests/adapters/test_torch.py tests the real allocator)")
    cxx, cuda = toolchain
    out = tmp_path_factory.mktemp("harness") / "harness.so"
    command = ta.compile_command(out, ta.torch_includes(torch), cuda, abi=ta._abi(torch),
                                 torch_lib=Path(torch.__file__).parent / "lib", cxx=cxx,
                                 libraries=("c10",), source=HARNESS)
    # -Bsymbolic: the harness's own stand-ins serve it, whatever else the process loaded.
    status, errors = compile_source([*command, "-Wl,-Bsymbolic"])
    assert status == 0, errors
    return Harness(out)


@pytest.fixture
def device():
    """Device 0's default pool: the simulated device, 64 MiB, hard limit 32 MiB."""
    yield from simulated_default_pool(32 * MiB)


def test_tensors_come_from_gpupool_and_go_back_when_they_die(harness, device):
    ptr = harness.allocate(1000)
    assert device.stats().in_use_bytes == 1024
    assert harness.allocate(0) == 0                      # an empty tensor: no block
    harness.drop(ptr)
    assert device.stats().in_use_bytes == 0
    assert harness.allocate(1000) == ptr                 # cached, handed back
    harness.drop(ptr)
    raw = harness.value("h_raw_alloc", harness.c.c_size_t(5000), harness.c.c_size_t(0))
    harness.call("h_raw_delete", harness.c.c_size_t(raw))
    with pytest.raises(RuntimeError, match="did not hand out"):
        harness.call("h_raw_delete", harness.c.c_size_t(raw))
    name = harness.c.create_string_buffer(32)
    harness.call("h_name", name, harness.c.c_size_t(32))
    assert name.value == b"gpupool"


def test_while_the_history_records_an_allocation_without_the_gil_has_python_frames(harness,
                                                                                    device):
    # PyTorch calls its allocator with the GIL released: the allocator gathers the calling
    # thread's frames (taking the GIL) while the memory history records, and only then.
    out = harness.c.c_size_t()
    harness.lib.h_set_stream(harness.c.c_size_t(0))
    gpupool.record_memory_history(max_entries=1000)
    try:
        assert harness.nogil.h_allocate(harness.c.c_size_t(3000), harness.c.byref(out)) == 0
        ptr = out.value
        harness.drop(ptr)
        trace = gpupool.memory_snapshot(device)["device_traces"][0]
    finally:
        gpupool.record_memory_history(None)
    [alloc] = [e for e in trace if e["action"] == "alloc"]
    assert alloc["addr"] == ptr and alloc["size"] == 3000
    assert alloc["frames"][0]["name"] == (
        "test_while_the_history_records_an_allocation_without_the_gil_has_python_frames")


def test_device_stats_are_gpupool_s_counters(harness, device):
    harness.call("h_reset", 1)
    harness.call("h_reset", 0)
    ptrs = [harness.allocate(n) for n in (1000, 3 * MiB)]
    harness.drop(ptrs.pop())
    s, ours = harness.stats(), device.memory_stats()
    assert s["allocated"] == ours["allocated_bytes.all.current"] == 1024 == s["active"]
    assert s["allocated_peak"] == ours["allocated_bytes.all.peak"] == 1024 + 3 * MiB
    assert s["reserved"] == ours["reserved_bytes.all.current"]
    assert s["reserved_peak"] == ours["reserved_bytes.all.peak"]
    assert (s["allocations"], s["segments"]) == (1, ours["segment.all.current"])
    assert (s["allocations_total"], s["frees_total"]) == (2, 1)       # since the reset
    assert (s["allocated_total"], s["freed_total"]) == (1024 + 3 * MiB, 3 * MiB)
    harness.call("h_reset", 1)                           # accumulated: PyTorch's view only
    s = harness.stats()
    assert (s["allocations_total"], s["allocated_total"], s["allocations"]) == (0, 0, 1)
    assert device.memory_stats()["allocation.all.allocated"] >= 2
    harness.call("h_reset", 0)                           # peaks: gpupool's own
    assert harness.stats()["allocated_peak"] == 1024 == device.stats().peak_in_use_bytes
    harness.drop(ptrs.pop())


def test_out_of_memory_is_pytorch_s_error_with_gpupool_s_message(harness, device):
    before = harness.stats()["ooms"]
    with pytest.raises(RuntimeError) as info:
        harness.allocate(48 * MiB)
    message = str(info.value)
    assert message.startswith("OutOfMemoryError: gpupool: out of memory on device 0 "
                              "allocating 48.000 MiB"), message
    assert "hard limit 32.000 MiB" in message
    assert harness.stats()["ooms"] == before + 1
    assert gpupool.torch.last_error() in message


def test_empty_cache_trims_and_cache_info_is_the_largest_block_within_the_limit(harness,
                                                                               device):
    ptr = harness.allocate(3 * MiB)
    harness.drop(ptr)
    assert device.stats().reserved_bytes == 4 * MiB
    harness.lib.h_set_device_free(harness.c.c_size_t(1 << 30))
    largest = harness.c.c_size_t(0)                     # 0: the device's free memory first
    harness.call("h_cache_info", harness.c.byref(largest))
    assert largest.value == 28 * MiB                    # ... within the hard limit's headroom
    harness.lib.h_set_device_free(harness.c.c_size_t(MiB))
    largest = harness.c.c_size_t(0)
    harness.call("h_cache_info", harness.c.byref(largest))
    assert largest.value == 4 * MiB                     # the cached block is larger
    harness.lib.h_set_capturing(1)                      # a capture on the current stream:
    harness.pool("h_empty_cache", (0, 0))               # no trim (it would synchronize)
    assert device.stats().reserved_bytes == 4 * MiB
    harness.lib.h_set_capturing(0)
    harness.pool("h_empty_cache", (0, 0))
    assert device.stats().reserved_bytes == 0


def test_base_allocation_and_copies(harness, device):
    first, second = harness.allocate(1000), harness.allocate(1000)
    base, size = harness.c.c_size_t(), harness.c.c_size_t()
    harness.call("h_base_allocation", harness.c.c_size_t(second), harness.c.byref(base),
                 harness.c.byref(size))
    assert (base.value, size.value) == (first, 2 * MiB)
    harness.call("h_memcpy", 0, 0, 0)                   # one device: cudaMemcpyAsync
    harness.call("h_memcpy", 1, 0, 1)                   # peers with P2P: cudaMemcpyAsync
    with pytest.raises(RuntimeError, match="cudaMemcpyPeerAsync"):
        harness.call("h_memcpy", 1, 0, 0)               # peers without: the peer copy
    for ptr in (first, second):
        harness.drop(ptr)


def test_a_capture_s_allocations_go_to_its_private_pool(harness, device):
    graph, capture = (11, 0), device.upstream.create_stream()
    relaxed = harness.lib.h_relaxed_entries()
    harness.pool("h_begin", graph, harness.c.c_size_t(capture))
    assert harness.use_count(graph) == 1
    temp = harness.allocate(4096, stream=capture)       # the capture's: the private pool's
    out = harness.allocate(8192, stream=capture)
    other = harness.allocate(4096, stream=0)            # another stream's: the pool's
    assert harness.lib.h_relaxed_entries() >= relaxed + 3   # in the relaxed capture mode
    assert harness.lib.h_capture_mode() == 0            # ... and back (global) after each
    harness.drop(temp)
    assert harness.live(graph, [out]) and not harness.live(graph, [out, other])
    harness.pool("h_end", graph)
    harness.drop(other)
    again = harness.allocate(4096, stream=capture)      # after the capture: the pool's, and
    assert again != temp                                # not the graph's freed temporary
    harness.drop(again)
    harness.pool("h_release_pool", graph)               # the graph is gone...
    assert harness.use_count(graph) == 0
    harness.drop(out)
    assert device.stats().in_use_bytes == 0
    kept = device.stats().reserved_bytes
    device.trim()
    assert device.stats().reserved_bytes == kept        # ...its memory still held, until
    synchronizes = harness.lib.h_synchronizes()
    harness.pool("h_empty_cache", (0, 0))               # empty_cache synchronizes and ends it
    assert harness.lib.h_synchronizes() == synchronizes + 1
    assert device.stats().reserved_bytes == 0
    with pytest.raises(RuntimeError, match="no private memory pool"):
        harness.live(graph, [])


def test_a_mempool_counts_its_users_and_refuses_another_allocator(harness, device):
    pool_id = (0, 21)
    harness.pool("h_create_pool", pool_id, 0)
    harness.pool("h_begin", pool_id, harness.c.c_size_t(0))
    assert harness.use_count(pool_id) == 2
    ptr = harness.allocate(1000)
    assert harness.live(pool_id, [ptr])
    harness.pool("h_end", pool_id)
    harness.pool("h_release_pool", pool_id)
    harness.pool("h_release_pool", pool_id)             # the MemPool's end
    with pytest.raises(RuntimeError, match="not in use"):
        harness.pool("h_release_pool", pool_id)
    harness.drop(ptr)
    harness.pool("h_empty_cache", pool_id)              # its emptyCache: it ends
    assert harness.use_count(pool_id) == 0
    with pytest.raises(RuntimeError, match="MemPool with an allocator of its own"):
        harness.pool("h_create_pool", (0, 22), 1)
    with pytest.raises(RuntimeError, match="without beginAllocateToPool"):
        harness.pool("h_end", (0, 23))


def test_a_freed_block_with_stream_uses_waits_for_the_capture_s_end(harness, device):
    graph, side = (31, 0), device.upstream.create_stream()
    ptr = harness.allocate(MiB)
    harness.call("h_record_stream", harness.c.c_size_t(ptr), harness.c.c_size_t(side))
    harness.pool("h_begin", graph, harness.c.c_size_t(device.upstream.create_stream()))
    harness.drop(ptr)                                   # held: its event would be captured
    assert device.stats().in_use_bytes == MiB
    harness.pool("h_end", graph)                        # freed once no capture routes
    assert device.stats().in_use_bytes == 0
    harness.pool("h_release_pool", graph)
    harness.pool("h_empty_cache", (0, 0))


def test_a_checkpointed_pool_state_is_restored(harness, device):
    graph, stream = (41, 0), device.upstream.create_stream()
    harness.pool("h_begin", graph, harness.c.c_size_t(stream))
    a = harness.allocate(4096, stream=stream)
    b = harness.allocate(8192, stream=stream)
    index = harness.c.c_int()
    harness.pool("h_checkpoint", graph, harness.c.byref(index))
    harness.drop(a)                                     # then a dies, c is made
    c = harness.allocate(4096, stream=stream)
    harness.pool("h_end", graph)
    freed, made = (harness.c.c_size_t * 8)(), (harness.c.c_size_t * 8)()
    nfreed, nmade = harness.c.c_size_t(), harness.c.c_size_t()
    harness.call("h_restore", index, freed, harness.c.byref(nfreed), made,
                 harness.c.byref(nmade))
    assert sorted(freed[:nfreed.value]) == sorted([b, c])       # what was live is freed
    assert sorted(made[:nmade.value]) == sorted([a, b])         # the checkpoint's, again
    assert harness.live(graph, [a, b])
    assert device.stats().in_use_bytes == 4096 + 8192
    for ptr in (a, b):
        harness.drop(ptr)
    harness.pool("h_release_pool", graph)
    harness.pool("h_empty_cache", (0, 0))
    assert device.stats().reserved_bytes == 0


def test_the_cuda_runtime_is_linked_by_pytorch_s_major_version(monkeypatch, tmp_path):
    include = tmp_path / "cu13" / "include"
    include.mkdir(parents=True)
    (tmp_path / "cu13" / "lib").mkdir()
    (tmp_path / "cu13" / "lib" / "libcudart.so.13").write_text("")
    monkeypatch.setattr(ta, "_cuda_candidates", lambda: iter([include]))
    assert ta.cudart("13.0") == (tmp_path / "cu13" / "lib", "libcudart.so.13")
    assert ta.cudart("12.8") is None and ta.cudart(None) is None
    command = ta.compile_command("out.so", [tmp_path], include, torch_lib=tmp_path, cxx="c++",
                                 runtime=ta.cudart("13.0"))
    assert "-l:libcudart.so.13" in command and "-ltorch_cuda" in command
