"""bench/alloc_latency.py's planned-region column and the targets it judges (CPU)."""

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench")
sys.path.insert(0, BENCH)

import alloc_latency  # noqa: E402


def _out(**medians):
    return {"columns": {key.replace("_", "."): {"results": {"256": {"median": ns}}}
                        for key, ns in medians.items()}}


@pytest.mark.parametrize("plan, ok", [(100.0, True), (101.0, False)])
def test_the_planned_column_is_judged_against_the_pool(plan, ok):
    checks = alloc_latency.targets(_out(gp=100.0, gp_plan=plan), [256])
    planned = [c for c in checks if c["target"].startswith("planned")]
    assert [(c["value"], c["ok"]) for c in planned] == [(plan / 100.0, ok)]


def test_no_planned_target_without_its_column():
    checks = alloc_latency.targets(_out(gp=100.0), [256])
    assert [c["target"] for c in checks] == ["gpupool cached allocate+free <= 250 ns"]


def test_the_planned_column_runs_on_the_simulated_device(tmp_path):
    path = tmp_path / "a.json"
    subprocess.run([sys.executable, os.path.join(BENCH, "alloc_latency.py"), "--simulated",
                    "--quick", "--columns", "gp,gp.plan", "--json", str(path)], check=True,
                   capture_output=True, timeout=300)
    cells = json.loads(path.read_text())["columns"]["gp.plan"]["results"]
    assert cells and all(cell["median"] > 0 for cell in cells.values())


def test_columns_named_twice_or_none_are_refused(capsys):
    for spec, said in (("gp,gp", "named twice"), ("", "unknown columns")):
        with pytest.raises(SystemExit) as e:
            alloc_latency.main(["--simulated", "--columns", spec])
        assert e.value.code == 2 and said in capsys.readouterr().err


def test_without_a_gpu_the_skip_names_the_simulated_run(monkeypatch, capsys):
    monkeypatch.setattr(alloc_latency._peers, "make_context",
                        lambda simulated, frameworks: (None, "no GPU (none here)"))
    with pytest.raises(SystemExit) as e:
        alloc_latency.main(["--columns", "gp"])
    assert e.value.code == 0
    assert "alloc_latency.py --simulated runs its gpupool columns" in capsys.readouterr().out
