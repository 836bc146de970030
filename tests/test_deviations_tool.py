"""tools/profile/deviations.py: runs drawn the same from the same seed, each a valid program
(every free of a live buffer), and its summary's counts adding up to the runs."""

import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, os.path.join(ROOT, "tools", "profile"))

import deviations  # noqa: E402


def test_a_seed_draws_the_same_valid_run():
    for seed in range(40):
        run = deviations.entries(seed)
        assert run == deviations.entries(seed) and 6 <= len(run) <= 40
        live = set()
        for ops in run:
            for op in ops:
                if op[0] == "a":
                    assert op[1] not in live and op[2] >= 1
                    live.add(op[1])
                else:
                    live.remove(op[1])          # KeyError: a free of no live buffer


def test_the_summary_counts_every_run(capsys):
    assert deviations.main(["--runs", "12", "--seed", "3", "--worst", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    counts = re.search(r"below 0.99 in (\d+), within 1% in (\d+), above 1.01 in (\d+)", out[0])
    assert counts and sum(map(int, counts.groups())) == 12
    by_mode = re.fullmatch(r"  above 1.01 by mode: (.*)", out[1])
    pairs = re.findall(r"(\w+) (\d+) of (\d+)", by_mode.group(1))
    assert [m for m, _, _ in pairs] == list(deviations.MODES)
    assert sum(int(a) for _, a, _ in pairs) == int(counts.group(3))
    assert sum(int(n) for _, _, n in pairs) == 12
    assert len(out) == 4 and all(line.startswith("  seed ") for line in out[2:])


def test_show_prints_each_entry_and_both_peaks(capsys):
    assert deviations.main(["--show", "291"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(deviations.entries(291)) + 1
    peaks = re.fullmatch(r"peak reserved KiB: planned ([\d,]+), plain ([\d,]+)", out[-1])
    assert peaks and all(int(g.replace(",", "")) > 0 for g in peaks.groups())
