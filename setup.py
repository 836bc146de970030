"""Build of gpupool's Cython core (C++ mode) against cuda-bindings' cydriver.

cydriver declares its types with ``cdef extern from "cuda.h"``, so CUDA headers are needed at
build time, of the same major.minor version as cuda-bindings where possible. They are looked
up in the nvidia-cuda-runtime wheel (nvidia/cu13/include), $CUDA_HOME/include (or
$CUDA_PATH) and /usr/local/cuda/include; of those found, the one of cuda-bindings' major.minor
is taken, else the closest minor of its major, newer before older (pick_headers). Headers older
than the bindings may lack types that cydriver uses: the build then says, before compiling,
what to install (older_headers_warning), and goes on, as an older minor often builds. Nothing
links against libcuda.
"""

import os
import re
import sys
from importlib import metadata
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

# Every .pyx below gpupool/ is an extension module of its own (its dotted path its name).
MODULES = sorted(str(p.with_suffix("")) for p in Path("gpupool").rglob("*.pyx"))


def _header_version(include):
    text = (include / "cuda.h").read_text(errors="replace")
    match = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", text)
    code = int(match.group(1)) if match else 0
    return code // 1000, code % 1000 // 10


def _required_headers():
    """Headers that cuda-bindings' cydriver.pxd declares its types from (cuda.h, and in some
    versions cudaProfiler.h and others): the include folder must hold all of them."""
    pxd = Path(metadata.distribution("cuda-bindings").locate_file("cuda/bindings/cydriver.pxd"))
    names = re.findall(r"cdef extern from ['\"]([^'\"<>]+)['\"]", pxd.read_text())
    return sorted(set(names) | {"cuda.h"})


def _candidates():
    try:
        dist = metadata.distribution("nvidia-cuda-runtime")
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include"):
            yield "nvidia-cuda-runtime wheel", Path(dist.locate_file(sub))
    except metadata.PackageNotFoundError:
        pass
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            yield f"${var}", Path(os.environ[var]) / "include"
    yield "/usr/local/cuda", Path("/usr/local/cuda/include")


def pick_headers(bindings, found):
    """The best of found, ``[(source, path, (major, minor))]``, for cuda-bindings' (major,
    minor): the same major.minor; else the same major, newer minors first (closest first:
    they declare every type the bindings use), then older ones (newest first); None when
    none has the bindings' major."""
    same_major = [f for f in found if f[2][0] == bindings[0]]
    return min(same_major, default=None,
               key=lambda f: (f[2][1] < bindings[1], abs(f[2][1] - bindings[1])))


def older_headers_warning(headers, bindings):
    """What to do when the headers' (major, minor) is older than cuda-bindings': cydriver may
    then use types the headers lack (the C++ compile fails with "'CUDA_..._st' does not name a
    type"); None when they are not older. Not an error: an older minor often builds."""
    if headers >= bindings:
        return None
    h, b = "{}.{}".format(*headers), "{}.{}".format(*bindings)
    return (f"gpupool build: warning: the CUDA {h} headers are older than cuda-bindings {b}, "
            f"whose cydriver may use types they lack; if the compile fails with \"'CUDA_..._st' "
            f"does not name a type\", install headers of the bindings' version "
            f"(pip install 'nvidia-cuda-runtime=={b}.*') or bindings of the headers' version "
            f"(pip install 'cuda-bindings=={h}.*'), then build again")


def cuda_include():
    """The include folder whose cuda.h best matches the installed cuda-bindings (pick_headers);
    a warning on stderr when its version is older (older_headers_warning)."""
    try:
        bindings = tuple(int(x) for x in metadata.version("cuda-bindings").split(".")[:2])
    except metadata.PackageNotFoundError:
        sys.exit("gpupool build: cuda-bindings is not installed "
                 "(pip install 'cuda-bindings>=13,<14')")
    headers = _required_headers()
    found = [(src, path, _header_version(path)) for src, path in _candidates()
             if all((path / name).is_file() for name in headers)]
    best = pick_headers(bindings, found)
    if best is not None:
        src, path, version = best
        print(f"gpupool build: CUDA {version[0]}.{version[1]} headers from {src} "
              f"({path}); cuda-bindings {bindings[0]}.{bindings[1]}")
        warning = older_headers_warning(version, bindings)
        if warning:
            print(warning, file=sys.stderr)
        return str(path)
    seen = ", ".join(f"{p} (CUDA {v[0]}.{v[1]})" for _, p, v in found) or "none"
    sys.exit(
        f"gpupool build: no include folder with {', '.join(headers)} for CUDA "
        f"{bindings[0]}.x, as cuda-bindings {bindings[0]}.{bindings[1]} needs. Found: {seen}. "
        f"Install the headers with "
        f"pip install 'nvidia-cuda-runtime=={bindings[0]}.{bindings[1]}.*', or set CUDA_HOME.")


def main():
    """Build the extension modules against the chosen CUDA headers."""
    include = cuda_include()
    # No debug info in the shared objects (it tripled the wheel); GPUPOOL_DEBUG_INFO=1 keeps it,
    # for line-level profiles and debuggers.
    debug_info = [] if os.environ.get("GPUPOOL_DEBUG_INFO") == "1" else ["-g0"]
    # GCC stops inlining once a module has grown by inline-unit-growth percent (40 by default),
    # whatever is left: at 40, core/pool.pyx runs out before the magazine fast path
    # (core/fastpath.pxd's fp_take) goes into Pool.mag_take, which the C API calls. 100 inlines
    # it with room to spare: see Note [Hot path across the PoolBase split] in docs/design.md
    # (tests/test_packaging.py checks it).
    inlining = ["--param", "inline-unit-growth=100"]
    extensions = [
        Extension(
            name.replace("/", "."),
            [f"{name}.pyx"],
            include_dirs=[include, "gpupool/include", "gpupool/src"],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", *inlining, *debug_info],
            # C entry points keep plain C names (PyTorch's pluggable allocator looks them up).
            define_macros=[("CYTHON_EXTERN_C", 'extern "C"')],
        )
        for name in MODULES
    ]

    setup(
        ext_modules=cythonize(
            extensions,
            language_level=3,
            compiler_directives={"embedsignature": True},
        )
    )


# setuptools runs this file as __main__ (python setup.py, and its build backend); tests
# import it for pick_headers and older_headers_warning.
if __name__ == "__main__":
    main()
