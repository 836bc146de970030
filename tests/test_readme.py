"""README.md: its two commands, its example for any machine (run, output as its comments say),
and links that work on a package index page too."""

import re
import subprocess
import sys

from conftest import REPO

README = (REPO / "README.md").read_text()


def _code_blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, re.DOTALL)


def test_the_two_commands_come_first():
    first = _code_blocks("bash")[0].splitlines()
    assert README.startswith("# gpupool\n\n```bash\n")
    assert [line.split("  #")[0].rstrip() for line in first] == [
        "pip install -e '.[examples]' && python examples/train_digits.py",
        "pip install -e '.[test]' && python -m pytest -q tests",
    ]


def test_the_example_for_any_machine_prints_what_its_comments_say():
    (block,) = [b for b in _code_blocks("python") if "SimulatedDevice()" in b]
    printed = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                             timeout=120, cwd=REPO)
    assert printed.returncode == 0, printed.stderr
    lines = block.splitlines()
    status = lines.index("gpupool.pool_status(pool=pool)")
    first = re.search(r"# (\d+ \d+):", lines[status - 1]).group(1)
    expected = [first] + [line.removeprefix("# ") for line in lines[status + 1:]]
    assert printed.stdout.splitlines() == expected


def test_links_are_absolute():
    # A package index shows README.md without the repository: relative links break there.
    targets = re.findall(r"\]\(([^)]+)\)", README)
    assert all(t.startswith("https://") for t in targets), targets
