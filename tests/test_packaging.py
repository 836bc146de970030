"""What the installed distribution holds: metadata, the license, extension modules without
debug info. (tools/release/check_dist.sh builds the wheel and the sdist themselves and checks
them.)"""

import importlib.util
from importlib import metadata
from pathlib import Path

from conftest import REPO

import gpupool
import gpupool.core.pool

DIST = metadata.distribution("gpupool")


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
    spec = importlib.util.spec_from_file_location(
        "check_dist", REPO / "tools" / "release" / "check_dist.py")
    check_dist = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_dist)
    modules = sorted(Path(gpupool.__file__).parent.glob("**/*.so"))
    assert modules
    for module in modules:
        debug = [s for s in check_dist.section_names(module.read_bytes()) if "debug" in s]
        assert debug == [], f"{module.name} carries debug info"
