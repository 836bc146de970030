"""A Cython module cimports gpupool.capi (the .pxd) and allocates through the C API."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

import gpupool
from gpupool.testing import SimulatedDevice

pytest.importorskip("Cython")

SOURCE = textwrap.dedent("""
    # cython: language_level=3
    from gpupool.capi cimport gpupool_api, gpupool_import, gpupool_stats, GPUPOOL_OK

    cdef const gpupool_api* api = gpupool_import()

    def roundtrip(size_t nbytes):
        cdef void* ptr = NULL
        cdef gpupool_stats stats
        cdef int code
        with nogil:
            code = api.allocate(0, nbytes, 0, &ptr)
        if code != GPUPOOL_OK:
            raise MemoryError(api.error_string(code).decode())
        api.get_stats(0, &stats)
        in_use = stats.in_use_bytes
        with nogil:
            code = api.free(0, ptr, 0)
        return <size_t>ptr, in_use, code
""")

SETUP = textwrap.dedent("""
    import os
    import gpupool
    from Cython.Build import cythonize
    from setuptools import Extension, setup
    # The folder holding the gpupool package, for gpupool/capi.pxd (an editable install is
    # not on sys.path, where Cython looks by default).
    packages = os.path.dirname(os.path.dirname(gpupool.__file__))
    setup(ext_modules=cythonize([Extension("capi_user", ["capi_user.pyx"],
                                           include_dirs=[gpupool.get_include()])],
                                include_path=[packages]))
""")


@pytest.mark.usefixtures("default_pools")
def test_cython_module_allocates_through_the_pxd(tmp_path):
    (tmp_path / "capi_user.pyx").write_text(SOURCE)
    (tmp_path / "setup.py").write_text(SETUP)
    result = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"],
                            cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    path = next(p for p in os.listdir(tmp_path) if p.startswith("capi_user") and
                p.endswith(".so"))
    gpupool.set_pool(gpupool.Pool(upstream=SimulatedDevice()))
    spec = importlib.util.spec_from_file_location("capi_user", tmp_path / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ptr, in_use, code = module.roundtrip(1000)
    assert ptr % 256 == 0 and in_use == 1024 and code == 0
    assert gpupool.get_pool(0).stats().in_use_bytes == 0
