"""gpupool's C++ allocator for PyTorch (src/torch_allocator.cc, _torch_allocator.py) without a
GPU: the source compiles against the installed PyTorch's headers and against other versions'
(GPUPOOL_TORCH_HEADERS), a version mismatch is caught at compile time, the loader names why
it cannot build, and gpupool.torch.use() falls back to the pluggable allocator then.

GPUPOOL_TORCH_HEADERS adds header trees of other PyTorch versions to compile against:
``VERSION=DIR`` entries separated by ``os.pathsep``, DIR holding (part of) a PyTorch include
tree such as the ``headers`` step of tools/gpu-check.sh returns (c10, ATen/cuda,
torch/csrc/cuda), laid over the installed PyTorch's for what it lacks. The GPU tests of the
allocator are in tests/test_torch.py (tests/torch_child.py)."""

import os
import subprocess
import types
import warnings
from pathlib import Path

import pytest

import gpupool.torch
from gpupool import _torch_allocator as ta

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
    strong = sorted(line.split()[-1] for line in listing.splitlines() if " T " in line)
    assert strong == ["gpupool_torch_built_for", "gpupool_torch_install"], listing


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
