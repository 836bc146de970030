"""Build a small C extension at benchmark time and import it (the C API benchmarks need one).

Only a C compiler and gpupool's header are needed (no CUDA toolkit): the extension reaches the
pool through gpupool's C API capsule.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

SETUP = """\
from setuptools import Extension, setup
setup(name={name!r}, ext_modules=[Extension({name!r}, {sources!r}, include_dirs={include!r})])
"""


def build(name, sources):
    """Compile ``sources`` into the extension module ``name`` in a temporary folder; import it.

    Parameters
    ----------
    name : str
        The module's name (its ``PyInit_<name>``).
    sources : list of str
        Paths of its C files; gpupool's include folder is on the include path.

    Returns
    -------
    module

    Raises
    ------
    RuntimeError
        The build failed (no compiler, say); the message ends with the compiler's output.
    """
    import gpupool

    tmp = tempfile.mkdtemp(prefix=f"{name}-")
    with open(os.path.join(tmp, "setup.py"), "w", encoding="utf-8") as f:
        f.write(SETUP.format(name=name, sources=[os.path.abspath(s) for s in sources],
                             include=[gpupool.get_include()]))
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", tmp,
                           "--build-temp", os.path.join(tmp, "build")], cwd=tmp,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"building {name} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    path = next(os.path.join(tmp, f) for f in os.listdir(tmp)
                if f.startswith(name) and f.endswith((".so", ".pyd")))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # loaded: the mapping outlives the file
    return module
