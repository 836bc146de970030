"""The ``gpupool`` package's face: what ``dir(gpupool)`` lists, the signatures that
``inspect.signature`` and ``help()`` show."""

import inspect
import pydoc
import re
import sys
import types

import pytest

from conftest import fresh_python

import gpupool
import gpupool.testing


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


def _public(module):
    """``(qualified name, object)`` of the module's public classes and functions, but
    exception classes (Python gives its own exception classes no signature either) and
    ``DeviceBuffer``, which is made by ``Pool.allocate``, not called."""
    for name in module.__all__:
        obj = getattr(module, name)
        if not callable(obj) or name == "DeviceBuffer" or (
                isinstance(obj, type) and issubclass(obj, BaseException)):
            continue
        yield f"{module.__name__}.{name}", obj


def test_every_public_class_function_and_method_has_a_signature():
    missing = []
    for name, obj in [*_public(gpupool), *_public(gpupool.testing)]:
        members = [(f"{name}.{m}", getattr(obj, m)) for m in vars(obj)
                   if not m.startswith("_") and inspect.isroutine(getattr(obj, m))] \
            if isinstance(obj, type) else []
        for qualified, routine in [(name, obj), *members]:
            try:
                inspect.signature(routine)
            except ValueError:
                missing.append(qualified)
    assert missing == []


@pytest.mark.parametrize("cls", [gpupool.Pool, gpupool.Region, gpupool.DriverUpstream,
                                 gpupool.VmmUpstream, gpupool.AsyncUpstream,
                                 gpupool.testing.SimulatedDevice, gpupool.testing.Failures])
def test_a_class_signature_names_the_parameters_its_docstring_documents(cls):
    # The testing classes are Python classes: their __init__ has the signature and no
    # docstring of its own (help() on it points to the class's, which documents them).
    section = inspect.getdoc(cls).split("\nParameters\n----------\n")[1].split("\n\n")[0]
    documented = [name for names in re.findall(r"^(\w+(?:, \w+)*) : ", section, re.MULTILINE)
                  for name in names.split(", ")]
    assert list(inspect.signature(cls).parameters) == documented
    # help() shows it once, and the docstring no longer carries it
    assert not inspect.getdoc(cls).startswith(cls.__name__ + "(")
    assert pydoc.render_doc(cls, renderer=pydoc.plaintext).count(f"{cls.__name__}(") >= 1


def test_the_class_signatures_are_the_constructors(sim):
    pool = gpupool.Pool(upstream=sim, **{p.name: p.default for p in
                                         inspect.signature(gpupool.Pool).parameters.values()
                                         if p.name != "upstream"})
    gpupool.Region(pool, **{p.name: p.default for p in
                            inspect.signature(gpupool.Region).parameters.values()
                            if p.name != "pool"})
    assert str(inspect.signature(gpupool.PythonUpstream)) == "()"
    gpupool.PythonUpstream()


@pytest.mark.parametrize("name", ["torch", "numba", "rmm", "cupy", "testing"])
def test_a_framework_module_lists_its_api_and_renders_help_without_its_framework(name):
    import importlib

    module = importlib.import_module(f"gpupool.{name}")
    public = [n for n in dir(module) if not n.startswith("__")]
    assert public and set(public) <= set(module.__all__), public
    assert not {"gpupool", "functools", "os", "import_extra", "Pool", "public_dir", "np",
                "ctypes", "mmap", "libc", "parse_limit"} & set(public)
    assert "__doc__" in dir(module)
    # Listing must not reach the framework: help() reads every listed name.
    assert module.__name__ in pydoc.render_doc(module)


def test_torchs_out_of_memory_type_without_pytorch_names_the_extra(monkeypatch):
    # The README names gpupool.torch.OutOfMemoryError; without PyTorch, reaching it says what
    # to install, as use() and mempool() do, not a bare ModuleNotFoundError.
    import gpupool.torch

    monkeypatch.setitem(sys.modules, "torch", None)     # import torch: ModuleNotFoundError
    gpupool.torch._oom_type.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"pip install 'gpupool\[torch\]'"):
            gpupool.torch.OutOfMemoryError
    finally:
        gpupool.torch._oom_type.cache_clear()


def test_torchs_out_of_memory_type_is_listed_once_pytorch_is_imported(monkeypatch):
    # dir() names it when listing it imports nothing (help() reads every name listed).
    import types

    import gpupool.torch

    monkeypatch.setitem(sys.modules, "torch", None)
    assert "OutOfMemoryError" not in dir(gpupool.torch)
    fake = types.ModuleType("torch")
    fake.OutOfMemoryError = type("OutOfMemoryError", (RuntimeError,), {})
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert "OutOfMemoryError" in dir(gpupool.torch)
