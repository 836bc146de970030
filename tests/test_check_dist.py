"""tools/release/check_dist.py on small archives made here (the real wheel and sdist:
check_dist.sh)."""

import importlib.util
import io
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

import gpupool.core.pool

_spec = importlib.util.spec_from_file_location(
    "check_dist", REPO / "tools" / "release" / "check_dist.py")
check_dist = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_dist)

COMPILED = Path(gpupool.core.pool.__file__)     # built by this checkout's setup.py
WHEEL_BASICS = ("gpupool/__init__.py", "gpupool/py.typed", "gpupool/capi.pxd",
                "gpupool/include/gpupool.h", "gpupool/src/gp_lock.h",
                "gpupool/src/torch_allocator.cc", "gpupool-0.1.0.dist-info/licenses/LICENSE")


def _wheel(path, files):
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return path


def _sdist(path, names):
    with tarfile.open(path, "w:gz") as sdist:
        for name in names:
            info = tarfile.TarInfo(f"gpupool-0.1.0/{name}")
            info.size = 1
            sdist.addfile(info, io.BytesIO(b"x"))
    return path


def test_section_names_of_a_compiled_module():
    names = check_dist.section_names(COMPILED.read_bytes())
    assert ".text" in names and ".dynsym" in names
    with pytest.raises(ValueError, match="not a 64-bit"):
        check_dist.section_names(b"#!/bin/sh\n")


def test_function_symbols_of_a_compiled_module():
    functions = check_dist.function_symbols(COMPILED.read_bytes())
    assert any("4Pool_mag_take" in f for f in functions)        # a local (static) function
    assert any("PyInit_pool" in f for f in functions)           # an exported one
    with pytest.raises(ValueError, match="not a 64-bit"):
        check_dist.function_symbols(b"#!/bin/sh\n")


def test_a_good_wheel_passes(tmp_path):
    files = dict.fromkeys(WHEEL_BASICS, b"")
    files["gpupool/core/pool.cpython-311-x86_64-linux-gnu.so"] = COMPILED.read_bytes()
    assert check_dist.check_wheel(_wheel(tmp_path / "g.whl", files), ["core/pool"]) == []


def test_wheel_problems_are_each_named(tmp_path, monkeypatch):
    files = dict.fromkeys(WHEEL_BASICS[:-1], b"")          # no LICENSE
    files["gpupool/core/pool.cpp"] = b"// generated"
    files["gpupool/c_api/table.h"] = b"/* generated */"
    monkeypatch.setattr(check_dist, "MAX_WHEEL_BYTES", 10)
    problems = check_dist.check_wheel(_wheel(tmp_path / "g.whl", files), ["core/pool"])
    assert problems[:4] == ["wheel: generated source gpupool/c_api/table.h",
                            "wheel: generated source gpupool/core/pool.cpp",
                            "wheel: no compiled module for gpupool/core/pool.pyx",
                            "wheel: no LICENSE in its .dist-info/licenses"]
    assert problems[4].startswith("wheel: ") and problems[4].endswith(" bytes, more than 10")
    assert len(problems) == 5


def test_a_module_with_debug_info_is_refused(tmp_path):
    elf = bytearray(COMPILED.read_bytes())
    # Rename the section ".dynsym" to ".debug_" + "s" in place, as a stand-in for debug info.
    at = elf.index(b".dynsym\0")
    elf[at:at + 8] = b".debugs\0"
    files = dict.fromkeys(WHEEL_BASICS, b"")
    files["gpupool/core/pool.x.so"] = bytes(elf)
    (problem,) = check_dist.check_wheel(_wheel(tmp_path / "g.whl", files), ["core/pool"])
    assert problem == "wheel: gpupool/core/pool.x.so carries debug info (.debugs)"


def test_sdist_against_its_checkout(tmp_path):
    source = tmp_path / "src"
    for name in ("gpupool/core/pool.pyx", "gpupool/core/pool.pxd", "tests/test_x.py", "README.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text("x")
    complete = ["gpupool/core/pool.pyx", "gpupool/core/pool.pxd", "tests/test_x.py", "README.md"]
    assert check_dist.check_sdist(_sdist(tmp_path / "a.tar.gz", complete), source) == []
    broken = _sdist(tmp_path / "b.tar.gz", complete[1:] + ["gpupool/_pool.cpp", "gpupool/_x.so"])
    assert check_dist.check_sdist(broken, source) == [
        "sdist: generated or compiled gpupool/_pool.cpp",
        "sdist: generated or compiled gpupool/_x.so",
        "sdist: gpupool/core/pool.pyx is missing"]


def test_main_needs_a_wheel_and_an_sdist(capsys):
    assert check_dist.main(["only-one.whl"]) == 2
    assert "usage:" in capsys.readouterr().err
