"""The smaller benchmark scripts on the simulated device (bench/ipc.py, bench/sleep_cycle.py,
bench/creep.py) and the RMM resource harness (bench/rmm_resource.py) over a fake RMM."""

import json
import os
import sys

import pytest

import gpupool

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench"))

import creep  # noqa: E402
import ipc  # noqa: E402
import rmm_resource  # noqa: E402
import sleep_cycle  # noqa: E402
from _common import MiB  # noqa: E402
from _peers import Context  # noqa: E402


def test_ipc_script_on_the_simulated_device(tmp_path):
    out_json = tmp_path / "ipc.json"
    ipc.main(["--simulated", "--quick", "--json", str(out_json)])
    result = json.loads(out_json.read_text())
    assert set(result["rows"]) == {"driver", "vmm"}
    for row in result["rows"].values():
        assert set(row) == set(ipc.COLUMNS) and all(t["median"] > 0 for t in row.values())


def test_sleep_wake_script_on_the_simulated_device(tmp_path):
    out_json = tmp_path / "sleep_cycle.json"
    assert sleep_cycle.main(["--simulated", "--quick", "--json", str(out_json)]) == 0
    out = json.loads(out_json.read_text())
    assert out["simulated"] and out["targets"] == {} and out["reduced_from"] is None
    assert out["nbytes"] == sleep_cycle.SIM_NBYTES and set(out["rows"]) == set(sleep_cycle.ROWS)
    assert all(len(r["samples"]) == out["reps"] == 2 for r in out["rows"].values())
    assert set(out["first"]) == {"sleep offload", "wake offload"}
    assert out["pool"]["asleep_bytes"] == 0 and out["pool"]["in_use_bytes"] == out["nbytes"]
    assert out["pool"]["pinned_bytes"] == out["nbytes"]       # kept for the next sleep
    assert "not GPU numbers" in sleep_cycle.report(out)


def test_sleep_wake_judges_its_targets_against_the_plain_copy():
    samples = {row: [1.0] for row in sleep_cycle.ROWS}
    samples.update({"sleep offload": [1.2], "wake offload": [1.3], "sleep": [0.04],
                    "wake": [0.06]})
    rows, targets = sleep_cycle.summarize({}, samples, 10 << 30, simulated=False)
    assert rows["sleep offload"]["vs_plain"] == pytest.approx(1 / 1.2)
    assert list(targets.values()) == [True, False, True, False]
    assert "sleep offload >= 80% of copy D2H" in targets
    # Half of the free device memory less 1 GiB, in ten pieces of whole 2 MiB pages.
    assert sleep_cycle.fit(10 << 30, 15 << 30, 1 << 40) == 7160 * MiB
    assert sleep_cycle.fit(10 << 30, 1 << 40, 1 << 40) == 10 << 30


def test_creep_script_on_the_simulated_device(tmp_path):
    out_json = tmp_path / "creep.json"
    assert creep.main(["--simulated", "--json", str(out_json)]) == 0
    out = json.loads(out_json.read_text())
    assert out["simulated"] and set(out["columns"]) == {"driver", "vmm"}
    assert out["columns"]["driver"] <= 2 * out["peak_in_use"]
    assert out["columns"]["vmm"] <= out["peak_in_use"] + (2 << 20)


# The RMM resource harness ------------------------------------------------------------------

def fake_rmm():
    """RMM's resources and DeviceBuffer as the harness calls them, counting allocations."""
    import types

    counts = {"alloc": 0, "free": 0}

    class Resource:
        def __init__(self, *args, **kwargs):
            pass

    class DeviceBuffer:
        def __init__(self, *, size, mr):
            counts["alloc"] += 1

        def __del__(self):
            counts["free"] += 1

    mr = types.SimpleNamespace(PoolMemoryResource=Resource, CudaMemoryResource=Resource,
                               CudaAsyncMemoryResource=Resource)
    return types.SimpleNamespace(DeviceBuffer=DeviceBuffer, mr=mr), counts


@pytest.mark.parametrize("argv, reason", [(["--simulated"], "no simulated run"),
                                          ([], "pip install 'gpupool[rmm]'")])
def test_rmm_resource_skips_without_rmm_or_a_gpu(monkeypatch, capsys, argv, reason):
    monkeypatch.setitem(sys.modules, "rmm", None)
    with pytest.raises(SystemExit) as done:
        rmm_resource.main(argv)
    assert done.value.code == 0
    assert reason in capsys.readouterr().out


def test_rmm_resource_times_rmm_resources_and_judges_the_target(sim):
    rmm, counts = fake_rmm()
    columns = [c for c in rmm_resource.COLUMNS if c.key != "gp"]   # gp needs a GPU
    out = rmm_resource.run(columns, Context(gpupool, sim=sim), rmm, quick=True)
    assert list(out["columns"]) == ["rmm.pool", "rmm.async"] and not out["errors"]
    assert counts["alloc"] == counts["free"] > 0
    pool_ns = out["columns"]["rmm.pool"]["results"][str(MiB)]["median"]
    out["columns"]["gp"] = {"label": "gp", "results": {str(MiB): {"median": 2 * pool_ns}}}
    out["targets"] = rmm_resource.targets(out)
    assert [(t["size"], t["ok"]) for t in out["targets"]] == [(MiB, False)]
    printed = rmm_resource.report(out)
    assert "[MISS] gpupool resource <= RMM pool resource: 1 MiB: 2.00x" in printed


def test_results_name_the_gpupool_build_they_imported():
    # An A/B run (tools/gpu/gpu-check.sh's ab step) tells its two builds apart by this.
    import _common

    where = _common.environment(device=None)["gpupool_from"]
    assert os.path.samefile(where, os.path.dirname(os.path.dirname(gpupool.__file__)))


@pytest.mark.parametrize("args", [[], ["no-such-rev-anywhere"]])
def test_ab_base_refuses_a_missing_or_unknown_revision(args):
    import subprocess

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tools",
                          "gpu", "ab-base.sh")
    proc = subprocess.run(["bash", script, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert ("usage" if not args else "names no commit") in proc.stderr
