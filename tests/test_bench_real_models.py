"""bench/real_models.py on CPU: its report (each allocator's peak in use, the floor, each run's
excess over it), its default columns, the planned column's skip where Region takes no plan,
and its dry run. (Its GPU numbers come from the GPU machine.)"""

import os
import sys

import pytest

import gpupool

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench"))

import _run_line  # noqa: E402
import real_models  # noqa: E402
from _common import MiB  # noqa: E402


def _model_run(peak, reserved, in_use, ms=10.0):
    record = {"per_step": {"used_after": [peak] * 4, "peak": [peak] * 4, "ms": [ms] * 4,
                           "loss": [1.0] * 4},
              "peak_bytes": peak, "allocator_peak_reserved": reserved,
              "allocator_peak_in_use": in_use}
    record["summary"] = real_models.summarize(record)
    return record


def test_real_models_report_has_each_allocators_peak_in_use_and_the_floor():
    out = {"models": ["gpt2"], "steps": 4, "columns": ["torch.exp", "gp.vmm"],
           "runs": {"gpt2": {"torch.exp": _model_run(1000 * MiB, 900 * MiB, 880 * MiB),
                             "gp.vmm": _model_run(990 * MiB, 890 * MiB, 880 * MiB)}}}
    text = real_models.report(out)
    assert "own peak in use" in text
    # 880 MiB in use at once + 100 MiB outside the allocator: 0.980 of the anchor's peak.
    assert "floor: 880 MiB in use at once + 100 outside torch.exp's allocator = 980 MiB = " \
           "0.980 of its peak: the aim 0.95 is below it" in text
    assert "gp.vmm           peak / torch.exp = 0.990 (target <= 1, aim 0.95): met" in text
    out["runs"]["gpt2"]["torch.exp"] = _model_run(1000 * MiB, 900 * MiB, 800 * MiB)
    assert "= 0.900 of its peak: the aim 0.95 is within reach" in real_models.report(out)


def test_real_models_prints_each_runs_excess_over_the_floor():
    out = {"models": ["gpt2-ckpt"], "steps": 4,
           "columns": ["torch", "torch.exp", "rmm.async", "gp.vmm", "gp.vmm.plan"],
           "runs": {"gpt2-ckpt": {
               "torch": _model_run(1100 * MiB, 1000 * MiB, 880 * MiB),
               "torch.exp": _model_run(1000 * MiB, 900 * MiB, 880 * MiB),
               "rmm.async": _model_run(1030 * MiB, None, None),
               "gp.vmm": _model_run(1010 * MiB, 900 * MiB, 870 * MiB),
               "gp.vmm.plan": {"skipped": "gpupool.Region takes no plan argument"}}}}
    text = real_models.report(out)
    # The floor: torch.exp's 880 MiB in use + 100 MiB outside its allocator.
    assert "floor 980 MiB: torch.exp's peak in use + outside its allocator" in text
    rows = {}
    for line in text.splitlines():          # the table's rows come before the column list
        if line.split() and line.split()[0] in out["columns"]:
            rows.setdefault(line.split()[0], line.split())
    assert rows["rmm.async"][1:5] == ["1,030", "1.030", "+50", "1.051"]
    assert rows["torch"][3:5] == ["+120", "1.122"] and rows["gp.vmm"][3:5] == ["+30", "1.031"]
    assert "gpupool.Region takes no plan argument" in " ".join(rows["gp.vmm.plan"])
    # Without the anchor the floor comes from torch's run, and the aim is not judged.
    del out["runs"]["gpt2-ckpt"]["torch.exp"]
    text = real_models.report(out)
    assert "floor 980 MiB: torch's peak in use + outside its allocator" in text
    assert "outside torch's allocator = 980 MiB = 0.891 of its peak\n" in text   # no aim
    out["runs"]["gpt2-ckpt"] = {"rmm.async": _model_run(1030 * MiB, None, None)}
    assert "no floor: no run with its allocator's peaks" in real_models.report(out)


def test_real_models_rmm_async_and_the_planned_region_are_default_columns():
    assert {"rmm.async", "gp.vmm.plan", "torch.exp"} <= set(real_models.DEFAULT_COLUMNS)
    assert real_models.COLUMNS["gp.vmm.plan"][1:] == ({"GPUPOOL_UPSTREAM": "vmm"}, "gpupool",
                                                      {"scope": "process", "plan": True})


class _RegionWithoutPlan:
    def __init__(self, pool=None, scope="thread"):
        self.pool, self.scope = pool, scope


class _RegionWithPlan(_RegionWithoutPlan):
    def __init__(self, pool=None, scope="thread", plan=False):
        super().__init__(pool, scope)
        self.plan = plan


def test_real_models_skips_the_planned_column_where_region_takes_no_plan(monkeypatch):
    monkeypatch.setattr(real_models, "_rmm_missing", lambda: "no rmm here")
    columns = ["torch", "rmm.async", "gp.vmm", "gp.vmm.plan"]
    monkeypatch.setattr(gpupool, "Region", _RegionWithoutPlan)
    reasons = real_models.skip_reasons(columns)
    assert reasons["rmm.async"] == "no rmm here" and set(reasons) == {"rmm.async", "gp.vmm.plan"}
    assert reasons["gp.vmm.plan"].startswith("gpupool.Region takes no plan argument")
    monkeypatch.setattr(gpupool, "Region", _RegionWithPlan)
    assert real_models.skip_reasons(columns) == {"rmm.async": "no rmm here"}
    assert real_models.skip_reasons(["torch", "gp.vmm"]) == {}


def test_real_models_dry_run_lists_the_new_workloads_runs_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(real_models, "_rmm_missing", lambda: None)
    monkeypatch.setattr(gpupool, "Region", _RegionWithoutPlan)
    models = "gpt2-ckpt,llama-ckpt,gpt2-generate"
    assert real_models.main(["--dry-run", "--models", models, "--steps", "24", "--columns",
                             "torch,rmm.async,gp.vmm.plan", "--trace-dir", "T"]) == 0
    text = capsys.readouterr().out
    assert "24 steps per run" in text and text.rstrip().endswith("\n9 processes")
    assert "llama-ckpt     rmm.async        runs" in text
    assert "gpt2-generate  gp.vmm.plan      skipped: gpupool.Region takes no plan" in text
    assert "gpt2-ckpt      trace      on torch -> T/gpt2-ckpt.npz" in text
    with pytest.raises(SystemExit) as exc:
        real_models.main(["--models", "gpt2-ckpt,nope", "--dry-run"])
    assert exc.value.code == 2 and "models must be among" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        real_models.main(["--help"])
    assert exc.value.code == 0 and "gpt2-generate" in capsys.readouterr().out


def test_real_models_repeats_interleave_the_columns_and_take_the_median_ms(monkeypatch, capsys):
    order = []

    def fake_child(model, column, steps, trace_path, cudnn_benchmark):
        order.append(column)
        k = order.count(column)
        ms = {"torch.exp": [300.0, 320.0, 310.0], "gp.vmm": [305.0, 500.0, 306.0]}[column]
        peak = (1000 + 10 * k) * MiB if column == "gp.vmm" else 1000 * MiB
        return {"per_step": {"used_after": [peak] * 4, "peak": [peak] * 4,
                             "ms": [ms[k - 1]] * 4, "loss": [1.0] * 4},
                "peak_bytes": peak, "allocator_peak_reserved": peak - 10 * MiB,
                "allocator_peak_in_use": 900 * MiB, "seconds": 1.0}

    monkeypatch.setattr(real_models, "run_child", fake_child)
    monkeypatch.setattr(real_models._common, "cuda_torch_or_skip", lambda *a: None)
    monkeypatch.setattr(real_models, "report", lambda out: "")
    out = {}
    monkeypatch.setattr(real_models._common, "finish",
                        lambda result, start, report, path: out.update(result) or 0)
    assert real_models.main(["--models", "gpt2-ckpt", "--columns", "torch.exp,gp.vmm",
                             "--repeat", "3", "--steps", "4"]) == 0
    assert order == ["torch.exp", "gp.vmm"] * 3                   # ABABAB
    runs = out["runs"]["gpt2-ckpt"]
    assert list(runs) == ["torch.exp", "gp.vmm"]
    assert runs["gp.vmm"]["summary"]["ms"] == 306.0               # the median, not the mean
    assert runs["gp.vmm"]["summary"]["ms_runs"] == [305.0, 500.0, 306.0]
    assert runs["gp.vmm"]["summary"]["peak"] == 1030 * MiB        # the worst run's memory
    assert len(runs["gp.vmm"]["repeats"]) == 3
    assert runs["torch.exp"]["summary"]["ms"] == 310.0
    assert "--repeat must be >= 1, not 0" in _error(["--repeat", "0", "--dry-run"], capsys)
    assert real_models.main(["--dry-run", "--models", "gpt2-ckpt", "--columns",
                             "torch.exp,gp.vmm", "--repeat", "3"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("\n6 processes")


def _error(argv, capsys):
    with pytest.raises(SystemExit):
        real_models.main(argv)
    return capsys.readouterr().err


def test_a_planned_runs_line_ends_with_its_planning_and_each_steps_exit():
    record = _model_run(1000 * MiB, 900 * MiB, 880 * MiB)
    assert _run_line.planning(record) == ""              # no region: nothing
    record["per_step"]["exit_ms"] = [0.4, 1.2, 33.6, 20.2]
    record["region"] = {"plans": 3, "planning_ms": 61.0, "record_plans": 1, "record_ms": 15.2}
    assert _run_line.planning(record) == (
        ", 3 plans in 61 ms, 1 at request 0 in 15 ms, exits 0, 1, 34, 20 ms")


def test_simulated_help_says_the_script_skips_and_why(capsys):
    # The flag is every script's (run_all.py passes it); this one has no simulated run.
    with pytest.raises(SystemExit):
        real_models.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--simulated print a skip line and exit 0: it trains PyTorch models on the GPU" \
        in text and "SimulatedDevice" not in text


def test_a_runs_line_ends_with_the_median_phases_of_its_steady_steps(monkeypatch):
    calls, now = [], iter([100.010, 100.025])
    monkeypatch.setattr(_run_line.time, "perf_counter", lambda: next(now))
    clock = _run_line.PhaseClock(calls.append)
    clock("forward")
    clock("backward")
    assert calls == ["forward", "backward"]                 # the sampler still samples
    assert clock.split(100.0, 100.055) == pytest.approx([10.0, 15.0, 30.0])
    assert clock.split(1.0, 1.5) == [500.0, 0.0, 0.0]       # no phase reached: all forward
    record = _model_run(1000 * MiB, 900 * MiB, 880 * MiB)
    assert _run_line.phases(record, 3) == ""
    record["per_step"]["phase_ms"] = [[900.0, 900.0, 900.0]] * 3 + [
        [10.0, 20.0, 30.0], [12.0, 24.0, 36.0], [11.0, 90.0, 33.0]]
    assert _run_line.phases(record, 3) == ", phases 11.0 / 24.0 / 33.0 ms"
    record["per_step"]["cpu_ms"] = [500.0] * 3 + [70.0, 80.0, 60.0]
    assert _run_line.phases(record, 3) == ", phases 11.0 / 24.0 / 33.0 ms, CPU 70.0 ms"


def test_repeated_runs_judge_step_time_by_each_steps_least_ms():
    # Step 3 of run 1 and step 4 of run 2 were slowed (a shared machine): each step's least
    # time among the runs leaves both out; the median of the runs' medians does not.
    def run(ms):
        record = _model_run(1000 * MiB, 900 * MiB, 880 * MiB)
        record["per_step"]["ms"] = [900.0, 900.0, 900.0] + ms
        record["summary"] = real_models.summarize(record)
        return record

    exp = real_models.combine([run([100.0, 100.0, 100.0]), run([120.0, 120.0, 120.0])])
    plan = real_models.combine([run([101.0, 150.0, 103.0]), run([130.0, 102.0, 170.0])])
    assert exp["summary"]["ms_least"] == pytest.approx(100.0)
    assert plan["summary"]["ms_least"] == pytest.approx(102.0)     # mean of 101, 102, 103
    assert plan["summary"]["ms"] == pytest.approx((103.0 + 130.0) / 2)
    out = {"models": ["llama-ckpt"], "runs": {"llama-ckpt": {"torch.exp": exp,
                                                              "gp.vmm.plan": plan}}}
    assert ("  llama-ckpt   gp.vmm.plan      each step's least ms / torch.exp's = 1.020 over "
            "2 runs (target <= 1.02): met") in real_models.targets_text(out)
    plan = real_models.combine([run([101.0, 150.0, 104.0]), run([130.0, 102.0, 170.0])])
    out["runs"]["llama-ckpt"]["gp.vmm.plan"] = plan
    assert any(line.endswith("= 1.023 over 2 runs (target <= 1.02): MISSED")
               for line in real_models.targets_text(out))
    single = real_models.combine([run([100.0, 100.0, 100.0])])
    assert "ms_least" not in single["summary"]                   # one run: no such ruler


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_steps_below_one_are_refused(steps, capsys):
    with pytest.raises(SystemExit) as exit_:
        real_models.main(["--dry-run", "--steps", steps])
    assert exit_.value.code == 2
    assert f"--steps must be >= 1, not {steps}" in capsys.readouterr().err


def test_a_dry_run_says_when_this_machine_would_skip_every_run(monkeypatch, capsys):
    monkeypatch.setattr(real_models._common, "cuda_torch", lambda: (None, "no torch here"))
    assert real_models.main(["--dry-run", "--models", "gpt2"]) == 0
    out, err = capsys.readouterr()
    assert out.rstrip().endswith("processes")
    assert err.strip() == "real_models --dry-run: this machine would skip every run: no torch here"


def test_json_help_says_it_is_written_after_every_run(capsys):
    with pytest.raises(SystemExit):
        real_models.main(["--help"])
    assert '"partial": true until the last' in " ".join(capsys.readouterr().out.split())
