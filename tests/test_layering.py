"""The layering of the package: every import and cimport points down the layer table.

The table is the one in docs/design.md ("Layers"): each row has a rank, a layer and the paths
it holds (a folder ending in "/" holds every module under it; a file names one module). A
module may import or cimport a module of a lower rank, or of its own layer; no import cycle
between modules. Imports inside functions count, and so do a stub's (.pyi) imports. A file
that another includes (`include "x.pxi"`) is part of the includer.

Python files (.py, .pyi) are read with ast; Cython files (.pyx, .pxd, .pxi) with regular
expressions over their text with comments and string contents blanked out (ast cannot parse
Cython). Only the standard library is used.
"""

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "design.md"
PACKAGE = "gpupool"
EXTENSIONS = (".py", ".pyi", ".pyx", ".pxd", ".pxi")
CYTHON = (".pyx", ".pxd", ".pxi")


# ---------------------------------------------------------------------------------------------
# The layer table


@dataclass(frozen=True)
class Layer:
    rank: int
    name: str
    paths: tuple[str, ...]      # "gpupool/core/" (a folder) or "gpupool/errors.py" (a file)


def parse_layer_table(markdown):
    """The layers of the first table under "## Layers" whose header has rank, layer, paths."""
    section = re.search(r"^## Layers\b(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    assert section, 'docs/design.md has no "## Layers" section'
    layers = []
    header = None
    for line in section.group(1).splitlines():
        line = line.strip()
        if not line.startswith("|"):
            if header is not None and layers:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            lowered = [c.lower() for c in cells]
            if "rank" in lowered and "layer" in lowered and "paths" in lowered:
                header = lowered
            continue
        if set("".join(cells)) <= set("-: "):
            continue
        row = dict(zip(header, cells, strict=False))
        paths = tuple(re.findall(r"`([^`]+)`", row["paths"]))
        layers.append(Layer(int(row["rank"]), row["layer"].strip("*` "), paths))
    assert layers, 'the "## Layers" section of docs/design.md has no table with rank, layer, paths'
    return layers


def layer_of(path, layers):
    """The layer holding a file: the row naming the file, else the row of its deepest folder."""
    best, depth = None, -1
    for layer in layers:
        for p in layer.paths:
            if p == path:
                return layer
            if p.endswith("/") and path.startswith(p) and len(p) > depth:
                best, depth = layer, len(p)
    return best


# ---------------------------------------------------------------------------------------------
# Reading imports


@dataclass(frozen=True)
class Import:
    file: str           # the file holding the statement, relative to the repository
    line: int
    text: str           # the statement as written (one line)
    module: str         # the imported module's dotted name, relative forms resolved
    names: tuple[str, ...] = ()   # for `from module import names`


def module_name(path):
    """gpupool/core/pool.pyx -> gpupool.core.pool; gpupool/core/__init__.py -> gpupool.core."""
    parts = list(Path(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(path):
    name = module_name(path)
    return name if Path(path).stem == "__init__" else name.rpartition(".")[0]


def _absolute(path, dots, module):
    """The absolute name of `from <dots><module> import ...` written in `path`."""
    if not dots:
        return module
    base = _package_of(path).split(".")
    if dots > 1:
        base = base[: len(base) - (dots - 1)]
    return ".".join(base + ([module] if module else []))


def _blank(text):
    """The text with comments and string contents replaced by spaces (lengths, lines kept)."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":
            while i < n and text[i] != "\n":
                out[i] = " "
                i += 1
        elif c in "'\"":
            quote = text[i: i + 3] if text[i: i + 3] in ("'''", '"""') else c
            i += len(quote)
            while i < n and text[i: i + len(quote)] != quote:
                if text[i] == "\\":
                    out[i] = " "
                    i += 1
                if i < n and text[i] != "\n":
                    out[i] = " "
                i += 1
                if len(quote) == 1 and i < n and text[i] == "\n":
                    break
            i += len(quote)
        else:
            i += 1
    return "".join(out)


def _logical_lines(blanked):
    """(first line number, joined text) for each logical line: brackets and backslashes join."""
    lines = blanked.split("\n")
    i = 0
    while i < len(lines):
        start, text = i + 1, lines[i]
        depth = text.count("(") + text.count("[") - text.count(")") - text.count("]")
        while (depth > 0 or text.rstrip().endswith("\\")) and i + 1 < len(lines):
            i += 1
            text = text.rstrip().rstrip("\\") + " " + lines[i].strip()
            depth += (lines[i].count("(") + lines[i].count("[")
                      - lines[i].count(")") - lines[i].count("]"))
        yield start, text
        i += 1


_FROM = re.compile(r"^\s*from\s+(\.*)([\w.]*)\s+c?import\s+(.+)$")
_IMPORT = re.compile(r"^\s*c?import\s+(.+)$")
_INCLUDE = re.compile(r"""^\s*include\s+["']([^"']+)["']""")


def _names(listing):
    names = []
    for item in listing.replace("(", " ").replace(")", " ").split(","):
        item = item.split()
        if item:
            names.append(item[0])
    return tuple(names)


def read_cython(path, text):
    """The imports, cimports and includes of a Cython file: (imports, included paths)."""
    imports, includes = [], []
    original = text.split("\n")
    for number, line in _logical_lines(_blank(text)):
        statement = original[number - 1].strip()
        if re.match(r"^\s*include\s", line):
            m = _INCLUDE.match(original[number - 1])
            if m:
                includes.append((number, str(Path(path).parent / m.group(1))))
            continue
        m = _FROM.match(line)
        if m:
            imports.append(Import(path, number, statement,
                                  _absolute(path, len(m.group(1)), m.group(2)),
                                  _names(m.group(3))))
            continue
        m = _IMPORT.match(line)
        if m:
            for module in _names(m.group(1)):
                imports.append(Import(path, number, statement, module))
    return imports, includes


def read_python(path, text):
    """The imports of a Python file or stub, at any depth (functions, TYPE_CHECKING blocks)."""
    imports = []
    lines = text.split("\n")
    for node in ast.walk(ast.parse(text, filename=path)):
        statement = lines[node.lineno - 1].strip() if hasattr(node, "lineno") else ""
        if isinstance(node, ast.Import):
            for alias in node.names:
                imports.append(Import(path, node.lineno, statement, alias.name))
        elif isinstance(node, ast.ImportFrom):
            imports.append(Import(path, node.lineno, statement,
                                  _absolute(path, node.level, node.module or ""),
                                  tuple(a.name for a in node.names)))
    return imports


def read_tree(root=REPO):
    """{path relative to the repository: text} for every module file of the package."""
    files = {}
    for path in sorted((root / PACKAGE).rglob("*")):
        if path.suffix in EXTENSIONS and path.is_file():
            files[path.relative_to(root).as_posix()] = path.read_text(encoding="utf-8")
    return files


# ---------------------------------------------------------------------------------------------
# The check


def _targets(imp, modules):
    """The package's modules an import loads: `from p import m` loads p.m when m is a module."""
    if not (imp.module == PACKAGE or imp.module.startswith(PACKAGE + ".")):
        return []
    found = []
    for name in imp.names:
        if f"{imp.module}.{name}" in modules:
            found.append(f"{imp.module}.{name}")
    if len(found) < len(imp.names) or not imp.names:
        # The module itself (or, for `import a.b.c`, the deepest prefix that is a module).
        parts = imp.module.split(".")
        while len(parts) > 1 and ".".join(parts) not in modules:
            parts.pop()
        found.insert(0, ".".join(parts) if ".".join(parts) in modules else imp.module)
    return found


def check(files, layers):
    """The violations of `files` ({path: text}) against `layers`, as messages, and the graph."""
    modules = {}                     # module name -> its files
    for path in files:
        if not path.endswith(".pxi"):
            modules.setdefault(module_name(path), []).append(path)
    imports, included_by = [], {}
    for path, text in files.items():
        if path.endswith(CYTHON):
            found, includes = read_cython(path, text)
            for _, included in includes:
                included_by[included] = path
        else:
            found = read_python(path, text)
        imports.extend(found)
    for path in files:               # a .pxi nobody includes is a module of its own
        if path.endswith(".pxi") and path not in included_by:
            modules.setdefault(module_name(path), []).append(path)

    def module_file(path):           # the file whose module a file is part of
        seen = set()
        while path in included_by and path not in seen:
            seen.add(path)
            path = included_by[path]
        return path

    problems, edges = [], {}
    for path in files:
        if layer_of(module_file(path), layers) is None:
            problems.append(f"{path}: in no layer of the table in docs/design.md")
    for imp in imports:
        source_file = module_file(imp.file)
        source, source_layer = module_name(source_file), layer_of(source_file, layers)
        for target in _targets(imp, modules):
            if target == source:
                continue
            if target not in modules:
                problems.append(f"{imp.file}:{imp.line}: `{imp.text}` imports {target}, "
                                f"which is no module of the package")
                continue
            target_layer = layer_of(modules[target][0], layers)
            edges.setdefault(source, {}).setdefault(target, f"{imp.file}:{imp.line}")
            if source_layer is None or target_layer is None or target_layer == source_layer:
                continue
            if target_layer.rank >= source_layer.rank:
                way = "upward" if target_layer.rank > source_layer.rank else "sideways"
                problems.append(
                    f"{imp.file}:{imp.line}: `{imp.text}` imports {target}: layer "
                    f"{source_layer.name} (rank {source_layer.rank}) -> layer "
                    f"{target_layer.name} (rank {target_layer.rank}), {way}")
    for cycle in _cycles(edges):
        links = ", ".join(f"{a} -> {b} ({edges[a][b]})" for a, b in
                          zip(cycle, cycle[1:] + cycle[:1], strict=True))
        problems.append(f"import cycle: {' -> '.join(cycle + cycle[:1])}: {links}")
    return problems


def _cycles(edges):
    """One cycle through each strongly connected group of two or more modules (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(set(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    cycles = []
    for group in groups:             # a shortest cycle through the group's first module
        start = min(group)
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            nxt = sorted(w for w in edges.get(path[-1], ()) if w in group)
            if start in nxt:
                cycles.append(path)
                break
            for w in nxt:
                if w not in seen:
                    seen.add(w)
                    paths.append(path + [w])
    return cycles


# ---------------------------------------------------------------------------------------------
# The tests


@pytest.fixture(scope="module")
def layers():
    return parse_layer_table(DESIGN.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tree():
    return read_tree()


def test_table_covers_every_folder(layers):
    ranks = [layer.rank for layer in layers]
    assert len(set(ranks)) == len(ranks), "two layers of docs/design.md share a rank"
    for folder in sorted(p for p in (REPO / PACKAGE).iterdir() if p.is_dir()):
        if folder.name == "__pycache__" or not any(
                f.suffix in EXTENSIONS for f in folder.rglob("*")):
            continue
        rel = folder.relative_to(REPO).as_posix() + "/"
        assert layer_of(rel + "__init__.py", layers), f"{rel} is in no layer of docs/design.md"


def test_imports_point_down(layers, tree):
    problems = check(tree, layers)
    assert not problems, ("imports against the layer table in docs/design.md:\n  "
                          + "\n  ".join(problems))


def test_catches_an_upward_cimport(layers, tree):
    files = dict(tree)
    files["gpupool/records/upward.pxd"] = (
        "# a record that reaches up into the pool\n"
        "from libc.stdint cimport uintptr_t\n"
        "from gpupool.core.pool cimport Pool\n")
    problems = [p for p in check(files, layers) if p.startswith("gpupool/records/upward.pxd")]
    assert problems == [
        "gpupool/records/upward.pxd:3: `from gpupool.core.pool cimport Pool` imports "
        "gpupool.core.pool: layer records (rank 3) -> layer core (rank 6), upward"]


def test_catches_every_form(layers, tree):
    files = dict(tree)
    files["gpupool/driver/forms.pyx"] = '''"""import gpupool.core.pool: a docstring, no import"""
cimport gpupool.records.block
from ..records cimport (sizes,
    streams)
include "forms.pxi"
s = "from gpupool.buffer import dlpack"  # from gpupool.buffer import view
def lazy():
    import gpupool.region.region as r
    from gpupool import errors, snapshot
'''
    files["gpupool/driver/forms.pxi"] = "from gpupool.ipc cimport export\n"
    files["gpupool/driver/lazy.py"] = ("def f():\n    from .. import testing\n"
                                       "    from ..core import defaults\n")
    problems = [re.sub(r"^([^:]+:\d+): .* imports ([\w.]+).*$", r"\1 \2", p)
                for p in check(files, layers) if p.startswith("gpupool/driver/")]
    assert sorted(problems) == [
        "gpupool/driver/forms.pxi:1 gpupool.ipc.export",
        "gpupool/driver/forms.pyx:2 gpupool.records.block",
        "gpupool/driver/forms.pyx:3 gpupool.records.sizes",
        "gpupool/driver/forms.pyx:3 gpupool.records.streams",
        "gpupool/driver/forms.pyx:8 gpupool.region.region",
        "gpupool/driver/forms.pyx:9 gpupool.snapshot",
        "gpupool/driver/lazy.py:2 gpupool.testing",
        "gpupool/driver/lazy.py:3 gpupool.core.defaults",
    ]


def test_catches_a_cycle(layers, tree):
    files = dict(tree)
    files["gpupool/records/ring_a.pxd"] = "from gpupool.records.ring_b cimport B\n"
    files["gpupool/records/ring_b.pxd"] = "from gpupool.records cimport ring_a\n"
    problems = [p for p in check(files, layers) if "ring_a" in p]
    assert problems == [
        "import cycle: gpupool.records.ring_a -> gpupool.records.ring_b -> "
        "gpupool.records.ring_a: gpupool.records.ring_a -> gpupool.records.ring_b "
        "(gpupool/records/ring_a.pxd:1), gpupool.records.ring_b -> gpupool.records.ring_a "
        "(gpupool/records/ring_b.pxd:1)"]
