"""What the installed distribution holds: metadata, the license, extension modules without
debug info, the magazine fast path compiled into the pool's methods; and setup.py's choice of
CUDA headers. (tools/release/check_dist.sh builds the wheel and the sdist themselves and checks
them.)"""

import importlib.util
import shutil
import subprocess
import sys
import zipfile
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
_spec = importlib.util.spec_from_file_location("gpupool_setup", REPO / "setup.py")
setup_py = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(setup_py)          # builds nothing: setup() runs only as __main__


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


def found(*versions):
    return [(f"source {v}", Path(f"/cuda-{v[0]}.{v[1]}/include"), v) for v in versions]


@pytest.mark.parametrize("bindings, versions, picked", [
    ((13, 3), [(13, 0), (13, 3), (13, 5)], (13, 3)),     # the same major.minor, wherever it is
    ((13, 3), [(13, 0), (13, 5), (13, 4)], (13, 4)),     # else the closest newer minor
    ((13, 5), [(13, 0), (13, 2), (12, 9)], (13, 2)),     # else the newest older one
    ((13, 0), [(12, 9)], None),                          # never another major
])
def test_setup_picks_the_headers_of_the_bindings_version_first(bindings, versions, picked):
    best = setup_py.pick_headers(bindings, found(*versions))
    assert (best and best[2]) == picked


def test_setup_says_what_to_install_when_the_headers_are_older_than_the_bindings():
    warning = setup_py.older_headers_warning((13, 0), (13, 5))
    assert "CUDA 13.0 headers are older than cuda-bindings 13.5" in warning
    assert "does not name a type" in warning
    assert "pip install 'nvidia-cuda-runtime==13.5.*'" in warning
    assert "pip install 'cuda-bindings==13.0.*'" in warning
    assert setup_py.older_headers_warning((13, 3), (13, 3)) is None
    assert setup_py.older_headers_warning((13, 5), (13, 3)) is None


def test_setup_warns_before_compiling_and_goes_on(tmp_path, monkeypatch, capsys):
    """Headers older than cuda-bindings (13.0 under 13.3 builds on the GPU machine) get the
    warning, not an error: cuda_include returns them."""
    include = tmp_path / "include"
    include.mkdir()
    for name in setup_py._required_headers():
        (include / name).write_text("")
    bindings = setup_py.metadata.version("cuda-bindings").split(".")
    older = int(bindings[1]) - 1
    if older < 0:
        pytest.skip(f"cuda-bindings {'.'.join(bindings[:2])} has no older minor")
    code = int(bindings[0]) * 1000 + older * 10             # as cuda.h writes 13.0: 13000
    (include / "cuda.h").write_text(f"#define CUDA_VERSION {code}\n")
    monkeypatch.setattr(setup_py, "_candidates", lambda: iter([("$CUDA_HOME", include)]))
    assert setup_py.cuda_include() == str(include)
    out, err = capsys.readouterr()
    assert f"CUDA {bindings[0]}.{older} headers from $CUDA_HOME" in out
    assert "are older than cuda-bindings" in err and "pip install" in err


def test_an_editable_install_finds_the_package_beside_a_folder_of_its_name(tmp_path):
    """From the folder that holds a clone named gpupool, ``import gpupool`` is the clone's
    package, not the clone's root as a namespace package: the editable wheel puts the project
    root on sys.path (a .pth line), which the path's own search reaches, where a finder of
    setuptools' would run only after it. See Note [Editable install] in docs/design.md.
    The project's configuration is built without its extension modules (setup.py's part),
    which do not choose the layout."""
    clone = tmp_path / "gpupool"
    (clone / "gpupool").mkdir(parents=True)
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, clone / name)
    shutil.copy(REPO / "gpupool" / "__init__.py", clone / "gpupool")
    built = subprocess.run(
        [sys.executable, "-c", "from setuptools import build_meta; "
         "print(build_meta.build_editable('dist'))"],
        cwd=clone, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    site = tmp_path / "site-packages"
    with zipfile.ZipFile(clone / "dist" / built.stdout.split()[-1]) as wheel:
        wheel.extractall(site)
    (pth,) = site.glob("*.pth")
    assert pth.read_text().split() == [str(clone)]
    # As the interpreter of a venv would: its site-packages after the working directory (-E:
    # no PYTHONPATH, -S: this interpreter's own site-packages left out).
    found = subprocess.run(
        [sys.executable, "-E", "-S", "-c", f"import importlib.util, site; "
         f"site.addsitedir({str(site)!r}); print(importlib.util.find_spec('gpupool').origin)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert found.stdout.strip() == str(clone / "gpupool" / "__init__.py"), found.stderr
