"""Build, load and install gpupool's C++ allocator for PyTorch (``src/torch_allocator.cc``,
which includes ``src/torch_allocator.h`` and ``src/torch_stats.h``).

The allocator subclasses PyTorch's ``CUDAAllocator``, whose virtual functions change from one
PyTorch version to the next, so it is never shipped built: it is compiled on first use against
the installed PyTorch's headers and libraries (``torch/include``, ``torch/lib``), the CUDA
runtime's headers and gpupool's C API header, by the C++ compiler (``$CXX``, else ``c++``,
``g++`` or ``clang++``), and kept in ``$GPUPOOL_CACHE_DIR`` (default
``$XDG_CACHE_HOME/gpupool``, ``~/.cache/gpupool``) under a name that hashes all it depends
on. No CUDA toolkit is needed: the headers of the ``nvidia-cuda-runtime`` and
``nvidia-cuda-crt`` wheels (``nvidia/cu13/include``) serve, as do ``$CUDA_HOME/include`` and
``/usr/local/cuda/include``.

:func:`install` raises :class:`Unavailable` with the reason and the fix when the allocator
cannot be built or loaded (PyTorch without CUDA, no compiler, no headers, a failed compile);
``gpupool.torch.use()`` then falls back to PyTorch's pluggable allocator. :func:`state` says
in one line, without compiling, whether it is built, still to be built, or why it cannot be
(``python -m gpupool`` shows it).
"""

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from gpupool.adapters import torch_entry

PACKAGE = os.path.dirname(os.path.dirname(__file__))
INCLUDE = os.path.join(PACKAGE, "include")          # gpupool.get_include(): the C API header
SRC = Path(PACKAGE) / "src"
SOURCE = SRC / "torch_allocator.cc"
# What SOURCE includes from SRC: one translation unit, compiled as SOURCE.
LOCAL_HEADERS = ("torch_allocator.h", "torch_stats.h")
HEADERS = ("gpupool.h", "gpupool_status.h")
LIBRARIES = ("c10", "c10_cuda", "torch_cuda")
CUDA_FIX = ("pip install 'nvidia-cuda-runtime==13.*' 'nvidia-cuda-crt==13.*' (the CUDA 13 "
            "headers, no toolkit), or set CUDA_HOME to a CUDA toolkit")
# c10's CUDA macros include a header that CUDA builds of PyTorch generate; CPU-only builds
# lack it (the compile checks of the tests run there), and it defines only Windows exports.
NO_CONFIGURE_FILE = "C10_CUDA_NO_CMAKE_CONFIGURE_FILE"


class Unavailable(Exception):
    """gpupool's C++ allocator cannot be built or loaded here; the message says why and what
    to do."""


def cache_dir():
    """Where built allocators are kept: ``$GPUPOOL_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/gpupool`` (``~/.cache/gpupool``), in ``torch-allocator``."""
    root = os.environ.get("GPUPOOL_CACHE_DIR")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpupool"
    return Path(root) / "torch-allocator"


def compiler():
    """The C++ compiler: ``$CXX``, else the first of ``c++``, ``g++``, ``clang++`` found."""
    wanted = os.environ.get("CXX")
    for name in [wanted] if wanted else ["c++", "g++", "clang++"]:
        path = shutil.which(name)
        if path:
            return path
    raise Unavailable(
        f"no C++ compiler ({'$CXX=' + wanted if wanted else 'c++, g++ or clang++'}) was found "
        f"to build it: install one (Debian, Ubuntu: apt install g++) or set CXX")


def _cuda_major(include):
    text = (include / "cuda_runtime_api.h").read_text(errors="replace")
    for line in text.splitlines():
        if line.startswith("#define CUDART_VERSION"):
            return int(line.split()[2]) // 1000
    return None


def _cuda_candidates():
    """Include folders that may hold CUDA's headers: the nvidia-* wheels' (nvidia/cu13/include
    and the like), $CUDA_HOME's, /usr/local/cuda's."""
    try:
        import nvidia  # the namespace package of the nvidia-* wheels
    except ModuleNotFoundError:
        nvidia = None
    for root in getattr(nvidia, "__path__", []):
        yield from sorted(Path(root).glob("*/include"))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            yield Path(os.environ[var]) / "include"
    yield Path("/usr/local/cuda/include")


def cuda_include(cuda_version):
    """The folder of CUDA's runtime headers for a PyTorch built with CUDA ``cuda_version``
    ("13.0"): one holding ``cuda_runtime_api.h`` and ``crt/host_config.h`` (which
    ``cuda_runtime.h`` includes), of the same major version where one is found."""
    found = [p for p in _cuda_candidates()
             if (p / "cuda_runtime_api.h").is_file() and (p / "crt/host_config.h").is_file()]
    if not found:
        raise Unavailable(f"no CUDA runtime headers (cuda_runtime_api.h with "
                          f"crt/host_config.h) were found to build it: {CUDA_FIX}")
    major = int(str(cuda_version).split(".")[0]) if cuda_version else None
    return next((p for p in found if _cuda_major(p) == major), found[0])


def cudart(cuda_version):
    """``(folder, file name)`` of the CUDA runtime library of PyTorch's CUDA major version
    (``libcudart.so.13``) where one is found, else None: the allocator is linked against it,
    by the same name as PyTorch's copy (the process loads one); without it, its runtime calls
    are found through PyTorch's libc10_cuda, which needs it."""
    major = str(cuda_version).split(".")[0] if cuda_version else None
    if major is None:
        return None
    name = f"libcudart.so.{major}"
    folders = [include.parent / lib for include in _cuda_candidates()
               for lib in ("lib", "lib64")]
    return next(((f, name) for f in folders if (f / name).is_file()), None)


def _abi(torch):
    return int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))


def torch_includes(torch):
    """PyTorch's include folders (as ``torch.utils.cpp_extension.include_paths()``)."""
    root = Path(torch.__file__).parent / "include"
    return [root, root / "torch" / "csrc" / "api" / "include"]


def compile_command(output, torch_include, cuda_include_dir, *, abi=1, torch_lib=None,
                    mode="shared", cxx=None, libraries=LIBRARIES, source=None,
                    runtime=None):
    """The compiler's command line for the allocator.

    Parameters
    ----------
    output : path
        The file to write (``mode="syntax"``: none is written).
    torch_include : list of paths
        PyTorch's include folders, searched in order.
    cuda_include_dir : path
        CUDA's runtime headers.
    abi : {0, 1}
        ``_GLIBCXX_USE_CXX11_ABI``, as PyTorch was built.
    torch_lib : path, optional
        PyTorch's ``lib`` folder, to link against (``mode="shared"``).
    libraries : sequence of str
        The libraries of ``torch_lib`` to link (``mode="shared"``).
    source : path, optional
        The file to compile: the allocator's source (the tests' harness includes it).
    runtime : (path, str), optional
        The CUDA runtime library's folder and file name, to link too (:func:`cudart`).
    mode : {"shared", "object", "syntax"}
        A loadable library, an object file (no link), or a check of the source only.
    """
    flags = ["-std=c++17", "-fPIC", "-O2", "-fvisibility=hidden",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    if not any((Path(d) / "c10/cuda/impl/cuda_cmake_macros.h").is_file() for d in torch_include):
        flags.append(f"-D{NO_CONFIGURE_FILE}")
    includes = [INCLUDE, str(SOURCE.parent), sysconfig.get_paths()["include"],
                *map(str, torch_include), str(cuda_include_dir)]
    command = [cxx or compiler(), *flags, *(f"-I{d}" for d in includes), str(source or SOURCE)]
    if mode == "syntax":
        return [*command, "-fsyntax-only"]
    if mode == "object":
        return [*command, "-c", "-o", str(output)]
    lib = str(torch_lib)
    command = [*command, "-shared", "-o", str(output), f"-L{lib}", f"-Wl,-rpath,{lib}",
               *(f"-l{name}" for name in libraries)]
    if runtime is not None:
        command += [f"-L{runtime[0]}", f"-l:{runtime[1]}", f"-Wl,-rpath-link,{runtime[0]}"]
    return command


def _compiler_version(cxx):
    try:
        result = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        raise Unavailable(f"the C++ compiler {cxx} cannot be run ({exc})") from None
    return result.stdout.splitlines()[0] if result.stdout else ""


def _check_torch(torch):
    """PyTorch's CUDA build with its headers and libraries; returns its lib folder."""
    if not torch.backends.cuda.is_built() or not torch.version.cuda:
        raise Unavailable(f"PyTorch {torch.__version__} was built without CUDA: install a CUDA "
                          f"build of PyTorch (pip install torch)")
    include = torch_includes(torch)[0]
    for header in ("c10/cuda/CUDACachingAllocator.h", "torch/csrc/cuda/CUDAPluggableAllocator.h"):
        if not (include / header).is_file():
            raise Unavailable(f"PyTorch {torch.__version__} ships no C++ header {header} "
                              f"(in {include}): reinstall PyTorch from its wheel")
    lib = Path(torch.__file__).parent / "lib"
    for name in LIBRARIES:
        if not (lib / f"lib{name}.so").is_file():
            raise Unavailable(f"PyTorch {torch.__version__} has no lib{name}.so in {lib}: "
                              f"install a CUDA build of PyTorch")
    return lib


def plan(torch):
    """Where the allocator for this PyTorch is kept, and how it is compiled.

    Returns
    -------
    (Path, list of str, str)
        The built library's path in :func:`cache_dir` (its name hashes the sources, the
        compiler's command and version, and PyTorch's version and place), the compiler's
        command line with ``"OUT"`` for the file it writes, and the compiler.

    Raises
    ------
    Unavailable
        PyTorch has no CUDA, or no compiler, Python headers or CUDA headers are found.
    """
    lib = _check_torch(torch)
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        raise Unavailable("Python's C headers (Python.h) are missing: install them (Debian, "
                          "Ubuntu: apt install python3-dev)")
    cxx = compiler()
    command = compile_command("OUT", torch_includes(torch), cuda_include(torch.version.cuda),
                              abi=_abi(torch), torch_lib=lib, cxx=cxx,
                              runtime=cudart(torch.version.cuda))
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), *((SRC / h).read_bytes() for h in LOCAL_HEADERS),
                 *(Path(INCLUDE, h).read_bytes() for h in HEADERS)):
        key.update(part)
    key.update("\0".join([*command, _compiler_version(cxx), torch.__version__,
                          torch.__file__]).encode())
    version = torch.__version__.replace("+", "_")
    return cache_dir() / f"torch_allocator-{version}-{key.hexdigest()[:16]}.so", command, cxx


def state(torch):
    """One line for a report: whether the allocator for ``torch`` is built, is still to be
    compiled by the first ``gpupool.torch.use()``, or cannot be built here, and why. Never
    raises for a missing prerequisite."""
    try:
        path, _command, cxx = plan(torch)
    except Unavailable as exc:
        return (f"cannot be built here: {exc}; gpupool.torch.use() serves PyTorch through its "
                f"pluggable allocator instead (malloc and free only)")
    if path.is_file():
        return f"built for PyTorch {torch.__version__}: {path}"
    return (f"not built yet for PyTorch {torch.__version__}: the first gpupool.torch.use() "
            f"compiles it (a few seconds, with {cxx}) into {path.parent}")


def build(torch):
    """The path of the allocator built for this PyTorch, compiled first if not cached.

    Raises
    ------
    Unavailable
        PyTorch has no CUDA, no compiler or headers are found, or the compile failed (the
        message gives the compiler's first errors and the log's path).
    """
    path, command, cxx = plan(torch)
    if path.is_file():
        return path
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=folder, suffix=".so.partial")
    os.close(fd)
    log = path.with_suffix(".log")
    try:
        command = [partial if part == "OUT" else part for part in command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            log.write_text(" ".join(command) + "\n" + result.stdout + result.stderr)
            errors = [line for line in result.stderr.splitlines() if "error" in line][:3]
            raise Unavailable(
                f"compiling it against PyTorch {torch.__version__} failed ({cxx}; the log is "
                f"{log}): {' | '.join(errors) or result.stderr[-500:]}")
        os.replace(partial, path)       # atomic: a concurrent build writes the same file
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return path


@functools.cache
def _library(path):
    # PyDLL: its functions are called with the GIL held (gpupool_import needs it).
    try:
        return ctypes.PyDLL(str(path))
    except OSError as exc:
        raise Unavailable(f"the built allocator {path} cannot be loaded ({exc}): delete it to "
                          f"rebuild, or check that PyTorch's CUDA libraries load") from None


def install_into(library):
    """Call the loaded library's ``gpupool_torch_install`` with gpupool.torch's hooks (its
    failure message, its allocate that gathers Python frames for the memory history, and
    the history's switch). Raises RuntimeError with the library's reason if it refuses."""
    hooks = ctypes.CDLL(torch_entry.__file__)
    error = ctypes.create_string_buffer(2048)
    library.gpupool_torch_install.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                              ctypes.c_char_p, ctypes.c_size_t]
    status = library.gpupool_torch_install(
        ctypes.cast(hooks.gpupool_torch_failure_message, ctypes.c_void_p),
        ctypes.cast(hooks.gpupool_torch_allocate_gathering, ctypes.c_void_p),
        ctypes.addressof(ctypes.c_int.in_dll(hooks, "gpupool_torch_recording")),
        error, len(error))
    if status != 0:
        raise RuntimeError(error.value.decode(errors="replace"))


def install(torch):
    """Build (if needed), load and make gpupool's allocator PyTorch's CUDA allocator.

    Returns the version of PyTorch it was compiled against.

    Raises
    ------
    Unavailable
        It cannot be built or loaded (see :func:`build`).
    RuntimeError
        PyTorch refused it (its CUDA allocator is initialized already).
    """
    library = _library(build(torch))
    install_into(library)
    library.gpupool_torch_built_for.restype = ctypes.c_char_p
    return library.gpupool_torch_built_for().decode()
