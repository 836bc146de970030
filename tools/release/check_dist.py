"""Check a built wheel and sdist of gpupool against the checkout they were built from.

::

    python tools/release/check_dist.py dist/gpupool-*.whl dist/gpupool-*.tar.gz

The wheel must hold the package's Python modules, stubs, ``.pxd`` files, headers and the C++
source of its allocator for PyTorch (``src/torch_allocator.cc``, compiled on first use), one
compiled module per ``.pyx``, none with debug info, and the license in its ``.dist-info``; no
C++ that Cython generated (``.cpp``, the headers of ``cdef public`` functions), and at most
``MAX_WHEEL_BYTES``. The sdist must hold every ``.py``, ``.pyx``, ``.pxd``, ``.pyi`` and header
of the package, the tests and the examples they run, README.md and LICENSE; no ``.cpp`` and no
compiled module.
``tools/release/check_dist.sh`` builds both and runs this. Exit status 1, one line a problem,
when a check fails; 0 and a summary otherwise.
"""

import fnmatch
import struct
import sys
import tarfile
import zipfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1]
MAX_WHEEL_BYTES = 3 << 19  # 1.5 MiB: about 0.5 MiB today; 3.5 MiB with debug info
# Patterns, relative to the checkout, of what the sdist must carry.
SDIST_SOURCES = ("gpupool/**/*.py", "gpupool/**/*.pyx", "gpupool/**/*.pxd", "gpupool/**/*.pyi",
                 "gpupool/**/*.pxi",
                 "gpupool/py.typed", "gpupool/include/*.h", "gpupool/src/*.h",
                 "gpupool/src/*.cc", "tests/**/*.py", "tests/**/*.cc",
                 "examples/*.py", "README.md", "LICENSE", "MANIFEST.in", "setup.py",
                 "setup.cfg", "pyproject.toml")
GENERATED = ("*.cpp", "gpupool/c_api/table.h", "gpupool/adapters/torch_entry.h")  # Cython's output


def _section_headers(elf):
    """(name offset, type, file offset, size, link) of each section of an ELF64 little-endian
    file, and the section names' table (bytes).

    Raises
    ------
    ValueError
        ``elf`` is not a 64-bit little-endian ELF file.
    """
    if elf[:6] != b"\x7fELF\x02\x01":
        raise ValueError("not a 64-bit little-endian ELF file")
    (offset,) = struct.unpack_from("<Q", elf, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", elf, 0x3A)
    headers = []
    for i in range(count):
        base = offset + i * entry_size
        name, kind = struct.unpack_from("<II", elf, base)
        at, size = struct.unpack_from("<QQ", elf, base + 0x18)
        (link,) = struct.unpack_from("<I", elf, base + 0x28)
        headers.append((name, kind, at, size, link))
    _, _, names_at, names_size, _ = headers[names_index]
    return headers, elf[names_at:names_at + names_size]


def _string(table, n):
    return table[n:table.index(b"\0", n)].decode()


def section_names(elf):
    """The section names of an ELF64 little-endian shared object, given as bytes.

    Raises
    ------
    ValueError
        ``elf`` is not a 64-bit little-endian ELF file.
    """
    headers, names = _section_headers(elf)
    return [_string(names, h[0]) for h in headers]


def function_symbols(elf):
    """The (mangled) names of the functions in the symbol table (``.symtab``, local functions
    included) of an ELF64 little-endian shared object, given as bytes; an empty set when the
    object is stripped.

    Raises
    ------
    ValueError
        ``elf`` is not a 64-bit little-endian ELF file.
    """
    headers, _ = _section_headers(elf)
    functions = set()
    for _, kind, at, size, link in headers:
        if kind != 2:                       # SHT_SYMTAB
            continue
        strings_at, strings_size = headers[link][2:4]
        strings = elf[strings_at:strings_at + strings_size]
        for base in range(at, at + size, 24):
            name, info = struct.unpack_from("<IB", elf, base)
            if info & 0xF == 2:             # STT_FUNC
                functions.add(_string(strings, name))
    return functions


def _matching(names, patterns):
    return sorted(n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns))


def check_wheel(path, pyx_modules):
    """Problems of the wheel at ``path`` (one string each); ``pyx_modules`` are the names of
    the package's Cython modules, as paths below ``gpupool/`` (``core/pool``, ...)."""
    problems = []
    with zipfile.ZipFile(path) as wheel:
        names = wheel.namelist()
        for name in _matching(names, GENERATED):
            problems.append(f"wheel: generated source {name}")
        for module in pyx_modules:
            if not _matching(names, [f"gpupool/{module}.*.so"]):
                problems.append(f"wheel: no compiled module for gpupool/{module}.pyx")
        for name in _matching(names, ["*.so"]):
            debug = [s for s in section_names(wheel.read(name)) if s.startswith(".debug")]
            if debug:
                problems.append(f"wheel: {name} carries debug info ({', '.join(debug)})")
        if not _matching(names, ["*.dist-info/licenses/LICENSE"]):
            problems.append("wheel: no LICENSE in its .dist-info/licenses")
        for required in ("gpupool/__init__.py", "gpupool/py.typed", "gpupool/capi.pxd",
                         "gpupool/include/gpupool.h", "gpupool/src/gp_lock.h",
                         "gpupool/src/torch_allocator.cc"):
            if required not in names:
                problems.append(f"wheel: {required} is missing")
    size = Path(path).stat().st_size
    if size > MAX_WHEEL_BYTES:
        problems.append(f"wheel: {size} bytes, more than {MAX_WHEEL_BYTES}")
    return problems


def check_sdist(path, source=SOURCE):
    """Problems of the sdist at ``path``, against the checkout ``source``."""
    with tarfile.open(path) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    problems = [f"sdist: generated or compiled {n}" for n in _matching(names, GENERATED)
                + _matching(names, ["*.so"])]
    for pattern in SDIST_SOURCES:
        for file in sorted(source.glob(pattern)):
            relative = file.relative_to(source).as_posix()
            if relative not in names:
                problems.append(f"sdist: {relative} is missing")
    return problems


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or not argv[0].endswith(".whl") or not argv[1].endswith(".tar.gz"):
        print("usage: python tools/release/check_dist.py WHEEL.whl SDIST.tar.gz", file=sys.stderr)
        return 2
    wheel, sdist = argv
    pyx_modules = [str(p.relative_to(SOURCE / "gpupool").with_suffix(""))
                   for p in sorted(SOURCE.glob("gpupool/**/*.pyx"))]
    problems = check_wheel(wheel, pyx_modules) + check_sdist(sdist)
    for problem in problems:
        print(f"check_dist: {problem}", file=sys.stderr)
    if not problems:
        print(f"check_dist: ok: {Path(wheel).name} ({Path(wheel).stat().st_size} bytes), "
              f"{Path(sdist).name} ({Path(sdist).stat().st_size} bytes)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
