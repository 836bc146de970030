"""What the installed distribution holds: metadata, the license, extension modules without
debug info, the magazine fast path compiled into the pool's methods. (tools/release/check_dist.sh
builds the wheel and the sdist themselves and checks them.)"""

import importlib.util
from importlib import metadata
from pathlib import Path

import pytest
from conftest import REPO

import gpupool
import gpupool.core.pool

DIST = metadata.distribution("gpupool")
_spec = importlib.util.spec_from_file_location(
    "check_dist", REPO / "tools" / "release" / "check_dist.py")
check_dist = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_dist)


def test_metadata_names_the_project_and_its_extras():
    meta = DIST.metadata
    assert meta["Version"] == gpupool.__version__
    assert meta["Author"] == "gpupool developers"
    assert meta["License"] == "Apache-2.0"
    urls = dict(url.split(", ", 1) for url in meta.get_all("Project-URL"))
    assert urls["Source"] == "https://github.com/gpupool/gpupool"
    assert set(meta.get_all("Provides-Extra")) >= {"test", "cupy", "numba", "torch", "examples"}
    assert 'torch>=2.4; extra == "torch"' in DIST.requires


def test_the_license_comes_with_the_distribution():
    assert DIST.metadata["License-File"] == "LICENSE"
    license_file = next(f for f in DIST.files if f.name == "LICENSE")
    assert "Apache License\n                           Version 2.0" in \
        license_file.read_text()


def test_extension_modules_carry_no_debug_info():
    modules = sorted(Path(gpupool.__file__).parent.glob("**/*.so"))
    assert modules
    for module in modules:
        debug = [s for s in check_dist.section_names(module.read_bytes()) if "debug" in s]
        assert debug == [], f"{module.name} carries debug info"


def test_the_magazine_fast_path_is_compiled_into_the_pools_methods():
    """The C API's cached pair calls Pool.mag_take and Pool.mag_free_handed (through the
    vtable): core/fastpath.pxd's fp_take and fp_free_handed are inlined into them, no function
    of their own, and the thread's once-only setup (gp_make_thread) is not. See
    Note [Hot path across the PoolBase split] in docs/design.md."""
    functions = check_dist.function_symbols(Path(gpupool.core.pool.__file__).read_bytes())
    if not functions:
        pytest.skip("the pool's module is stripped: no symbol table to read")
    assert any("4Pool_mag_take" in f for f in functions)
    assert any("4Pool_mag_free_handed" in f for f in functions)
    for inlined in ("8fastpath_fp_take", "8fastpath_fp_free_handed"):
        assert [f for f in functions if inlined in f] == [], f"{inlined} is not inlined"
    assert any("gp_make_thread" in f for f in functions)
