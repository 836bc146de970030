"""README.md as a new user meets it: its first screen (what gpupool is, then the commands: a
fresh environment, the install and the main job, the tests), the commands themselves (those
.ci/run and setup.cfg agree with; the main job's extra installs all the main job needs, and no
more), every Python block run as pasted (the GPU ones, which import CuPy, PyTorch, Numba or
RMM, marked ``gpu``), what a paste of the IPC block shows, and links that work on a package
index page."""

import configparser
import re
import shlex
import subprocess
import sys
from importlib import metadata

import pytest
from conftest import REPO

README = (REPO / "README.md").read_text()
FIRST_SCREEN_LINES = 24        # a terminal's or a repository page's first screen
FRAMEWORKS = ("cupy", "torch", "numba", "rmm")     # a block importing one needs a GPU


def _code_blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, re.DOTALL)


def _commands():
    """The commands of README's first block, without their comments: the environment, the
    install and the main job, the tests."""
    return [line.split("  #")[0].rstrip() for line in _code_blocks("bash")[0].splitlines()]


def _extra(command):
    """The extra a ``pip install -e '.[extra]' && ...`` command installs."""
    return re.match(r"pip install -e '\.\[(\w+)\]' && ", command).group(1)


def _setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg


def _setup_cfg_list(section, key):
    return [line.strip() for line in _setup_cfg()[section][key].splitlines()
            if line.strip() and not line.strip().startswith("#")]


# The first screen and the commands -----------------------------------------------------------

def _first_screen():
    return "\n".join(README.splitlines()[:FIRST_SCREEN_LINES])


def test_the_first_screen_says_what_gpupool_is_then_what_the_commands_need_then_them():
    title, rest = README.split("\n\n", 1)
    assert title == "# gpupool"
    what, needs, block = rest.split("\n\n", 2)
    assert what.startswith("gpupool is a caching GPU memory allocator for Python")
    assert len(what.splitlines()) <= 8
    # What the commands need comes before them: Python, its headers and venv, a compiler,
    # whether CUDA headers or a GPU must be there.
    for needed in ("Python >= 3.10", "python3-dev", "python3-venv", "C++17 compiler", "no GPU",
                   "no CUDA toolkit", "CUDA 13 headers"):
        assert needed in needs, needed
    assert block.startswith("```bash\n")        # then the commands: the first code block
    assert _code_blocks("bash")[0] in _first_screen()


def test_the_first_sentence_names_only_what_gpupool_supports():
    sentence = README.split("\n\n")[1].split(". ")[0]
    # An adapter for each framework named as allocating from the pool
    allocating = sentence.split(" allocate from")[0]
    for name, adapter in (("CuPy", "cupy"), ("Numba", "numba"), ("PyTorch", "torch"),
                          ("RMM", "rmm")):
        assert name in allocating and (REPO / "gpupool" / f"{adapter}.py").exists(), name
    # JAX has none: it only reads gpupool's buffers (DLPack, the CUDA Array Interface).
    assert not (REPO / "gpupool" / "jax.py").exists() and "JAX" not in allocating
    assert "JAX too, which keeps its own allocator" in sentence


def test_python_version_named_is_the_packages():
    oldest = _setup_cfg()["options"]["python_requires"].removeprefix(">=")
    assert f"Python >= {oldest} " in _first_screen()


def test_the_commands_start_with_a_fresh_environment_in_the_block():
    """In the block, not in prose only: a user copying the block installs into the
    environment it makes (ignored by git), not into whatever Python is active."""
    assert _commands() == [
        "python3 -m venv .venv && . .venv/bin/activate",
        "pip install -e '.[examples]' && python examples/train_digits.py",
        "pip install -r tests/requirements.txt && python -m pytest -q tests",
    ]


def test_the_test_command_builds_nothing_and_its_tools_are_the_test_extra():
    # It installs requirements by name only: no local project, so nothing is built again.
    install = _commands()[2].split(" && ")[0]
    assert install == "pip install -r tests/requirements.txt"
    listed = [line.strip() for line in (REPO / "tests" / "requirements.txt").read_text()
              .splitlines() if line.strip() and not line.startswith("#")]
    assert not any(r.startswith((".", "-e", "/", "gpupool")) for r in listed), listed
    assert listed == _setup_cfg_list("options.extras_require", "test")
    # the sdist carries it, with the tests
    assert "recursive-include tests *.py *.cc *.txt" in (REPO / "MANIFEST.in").read_text()


def test_the_test_tools_upgrade_a_venvs_setuptools_to_one_that_builds_editable_wheels():
    """A venv of Python 3.11 comes with setuptools 65.5, which builds an editable wheel only
    with the wheel package (which a venv lacks); from 70.1 on setuptools builds it alone, so
    the test command must upgrade it. See Note [Test tools' setuptools] in docs/design.md."""
    from packaging.requirements import Requirement

    (setuptools,) = [Requirement(r) for r in _setup_cfg_list("options.extras_require", "test")
                     if Requirement(r).name == "setuptools"]
    assert not setuptools.specifier.contains("65.5.0")
    assert not setuptools.specifier.contains("70.0.0")
    assert setuptools.specifier.contains("70.1.0")


def test_ci_runs_the_readme_commands_as_written():
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    venv, install, test = _commands()
    # A fresh environment (its own folder), gpupool installed as the install command installs
    # it, then the test command verbatim.
    made = next(i for i, line in enumerate(ci) if line.startswith("python3 -m venv "))
    assert made < ci.index(install.split(" && ")[0]) < ci.index(test)
    # The environment the README makes is no file of the project's.
    assert venv.split(" && ")[0] == "python3 -m venv .venv"
    assert "/.venv/" in (REPO / ".gitignore").read_text().splitlines()
    assert not any("pip install" in line and ("[test]" in line or "-e ." in line) for line in ci)
    # pytest's own configuration agrees on where the tests are
    assert 'testpaths = ["tests"]' in (REPO / "pyproject.toml").read_text()


def test_every_extra_the_readme_names_exists():
    extras = set(_setup_cfg()["options.extras_require"])
    named = set(re.findall(r"pip install -e '\.\[([\w,]+)\]'", README))
    assert {e for group in named for e in group.split(",")} <= extras
    # The main job's extra leaves CuPy to the cupy extra: no GPU package on a machine without
    # a GPU.
    assert not any("cupy" in r for r in _setup_cfg_list("options.extras_require", "examples"))


def _canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed_closure(requirements):
    """The canonical names of the installed distributions ``requirements`` pull in."""
    from packaging.requirements import Requirement

    seen, todo = set(), list(requirements)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if _canonical(req.name) in seen:
            continue
        seen.add(_canonical(req.name))
        try:
            todo += metadata.distribution(req.name).requires or []
        except metadata.PackageNotFoundError:
            continue
    return seen


# Run a script with the given top-level modules refused, as if not installed.
WITHOUT_MODULES = """
import os, runpy, sys
refused = set(sys.argv[1].split(","))

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in refused:
            raise ModuleNotFoundError(f"No module named {name!r} (not installed)", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
script = sys.argv[2]
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
"""


def test_the_main_job_needs_only_what_its_extra_installs():
    pytest.importorskip("sklearn", reason="the main job's extra is not installed here")
    command = _commands()[1]
    extra = _extra(command)
    distributions = _installed_closure(
        _setup_cfg_list("options", "install_requires")
        + _setup_cfg_list("options.extras_require", extra))
    # Every module of another installed distribution is refused (the standard library's and
    # the examples' own belong to none).
    refused = {module for module, dists in metadata.packages_distributions().items()
               if not any(_canonical(d) in distributions | {"gpupool"} for d in dists)}
    refused -= {"gpupool"}
    python, script, *args = shlex.split(command.split(" && ")[1])
    assert python == "python"
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_MODULES, ",".join(sorted(refused | {"cupy", "matplotlib"})),
         script, *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    # Exit status 0: trained to >= 0.95 with the region's reserved memory flat.
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


# Every Python block --------------------------------------------------------------------------

def _python_blocks():
    """``(section heading, block)`` of every Python block, in order."""
    found = []
    for match in re.finditer(r"```python\n(.*?)```", README, re.DOTALL):
        headings = re.findall(r"^## (.+)$", README[:match.start()], re.MULTILINE)
        found.append((headings[-1] if headings else "top", match.group(1)))
    return found


def _needs(block):
    """The frameworks a block imports (``import torch``, ``import gpupool.numba``...)."""
    return [m for m in FRAMEWORKS
            if re.search(rf"^\s*(?:import|from)\s+(?:gpupool\.)?{m}\b", block, re.MULTILINE)]


def _block_params():
    params = []
    for i, (heading, block) in enumerate(_python_blocks()):
        needs = _needs(block)
        slug = re.sub(r"\W+", "-", heading.lower()).strip("-")
        params.append(pytest.param(block, needs, id=f"{i}-{slug}",
                                   marks=[pytest.mark.gpu] if needs else []))
    return params


def _interactive_errors(block):
    """The lines at which the interactive prompt, fed the block line by line as a paste feeds
    it, raises SyntaxError (``codeop``: a compound statement ends only at a blank line)."""
    import codeop

    errors, pending = [], []
    for number, line in enumerate(block.splitlines() + [""], 1):
        pending.append(line)
        try:
            done = codeop.compile_command("\n".join(pending), "<stdin>", "single")
        except SyntaxError:
            errors.append(number)
            pending = []
            continue
        if done is not None:
            pending = []
    return errors


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_every_python_block_pastes_into_the_interactive_prompt(index):
    heading, block = _python_blocks()[index]
    assert _interactive_errors(block) == [], heading


def test_the_paste_check_finds_a_statement_after_a_loop_without_a_blank_line():
    assert _interactive_errors("for i in range(2):\n    pass\nprint(i)\n") == [3]


def test_the_first_example_runs_on_any_machine():
    heading, first = _python_blocks()[0]
    assert _needs(first) == [] and "SimulatedDevice()" in first, heading


@pytest.mark.parametrize("block, needs", _block_params())
def test_every_python_block_runs_as_pasted(block, needs, tmp_path):
    for module in needs:
        pytest.importorskip(module)
    # A script of its own (not -c): a block that starts processes with 'spawn' needs a file.
    script = tmp_path / "readme_block.py"
    script.write_text(block)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{block}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


@pytest.mark.parametrize("flags, child_error", [
    (["-i"], "AttributeError: Can't get attribute 'consumer'"),     # the interactive prompt
    (["-"], "FileNotFoundError"),                                   # python -
])
def test_the_ipc_block_fails_as_the_readme_says_when_pasted(flags, child_error):
    """The IPC block needs a file (the spawn start method imports it in the consumer): the
    README says so, and what a paste into the interactive prompt (``-i``: standard input read
    line by line, as a paste is) or into ``python -`` shows: the consumer's error, then the
    producer's wait ending in an error."""
    (block,) = [b for _, b in _python_blocks() if "ipc_handle()" in b]
    intro = README[:README.index(block)].rsplit("```python", 1)[0].strip().rsplit("\n\n", 1)[-1]
    said = " ".join(intro.split())
    assert "Save this block as a file" in said and "`spawn`" in said
    assert "pasted into the interactive prompt or into `python -`" in said
    assert f"`{child_error}`" in said
    wait = "done.get(timeout=60)"
    assert wait in block and wait in said
    # The consumer dies at once; a shorter wait keeps the test quick.
    proc = subprocess.run([sys.executable, *flags], cwd=REPO, capture_output=True, text=True,
                          input=block.replace(wait, "done.get(timeout=5)"), timeout=120)
    assert child_error in proc.stderr and "Empty" in proc.stderr, proc.stderr
    assert proc.returncode != 0 or flags == ["-i"]       # the prompt goes on after an error


def test_the_example_for_any_machine_prints_what_its_comments_say():
    (block,) = [b for b in _code_blocks("python") if "SimulatedDevice()" in b
                and "gpupool.pool_status(pool=pool)" in b]
    printed = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                             timeout=120, cwd=REPO)
    assert printed.returncode == 0, printed.stderr
    lines = block.splitlines()
    status = lines.index("gpupool.pool_status(pool=pool)")
    first = re.search(r"# (\d+ \d+):", lines[status - 1]).group(1)
    expected = [first] + [line.removeprefix("# ") for line in lines[status + 1:]]
    assert printed.stdout.splitlines() == expected


def test_the_planned_region_example_prints_what_the_readme_says_it_prints():
    (block,) = [b for b in _code_blocks("python") if "plan={" in b]
    printed = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                             timeout=120, cwd=REPO)
    assert printed.returncode == 0, printed.stderr
    said = re.search(r"```\n\nIt prints `([^`]+)`", README[README.index(block):]).group(1)
    assert printed.stdout.strip() == said


def test_links_are_absolute():
    # A package index shows README.md without the repository: relative links break there.
    targets = re.findall(r"\]\(([^)]+)\)", README)
    assert all(t.startswith("https://") for t in targets), targets
