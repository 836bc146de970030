"""The ``gpupool`` package's face: what ``dir(gpupool)`` lists."""

import types

from conftest import fresh_python

import gpupool


def test_dir_lists_the_public_api_and_no_stray_module():
    public = [name for name in dir(gpupool) if not name.startswith("__")]
    assert set(public) >= set(gpupool.__all__)
    assert "os" not in public and "format_status" not in public
    modules = {name for name in public if isinstance(getattr(gpupool, name), types.ModuleType)}
    assert modules <= {"cupy", "diagnose", "numba", "testing", "torch"}, modules
    assert "__version__" in dir(gpupool)


def test_a_public_module_is_listed_once_imported():
    code = """
        import gpupool
        before = "torch" in dir(gpupool)
        import gpupool.torch
        print(before, "torch" in dir(gpupool), "core" in dir(gpupool))
    """
    proc = fresh_python(code)
    assert proc.stdout.split() == ["False", "True", "False"], proc.stderr
