"""bench/fragmentation.py on CPU: the pool's peak reserved bytes on replayed traces (synthetic
and the recorded training runs), against PyTorch's recorded expandable segments, with a
region per step, with a pool of its own for small requests, and with a planned region."""

import math
import os
import sys

import gpupool

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench"))

import alloc_trace  # noqa: E402
import fragmentation  # noqa: E402
from _common import MiB  # noqa: E402


def test_fragmentation_stays_down_on_traces_the_policy_was_not_tuned_on():
    out = fragmentation.run(gpupool)
    rows = out["results"]
    assert out["synthetic_plain"]["count"] == 18
    assert all(r[kind] >= r["peak_live"] for r in rows.values() for kind in ("plain", "vmm"))
    # Before large blocks were cut and joined the synthetic mean was 1.336x; with cutting
    # and size classes 1.257x (bench/RESULTS.md's history); best fit with 512-byte rounding: 1.216x.
    assert out["synthetic_plain"]["mean"] < 1.25
    assert out["synthetic_vmm"]["mean"] <= out["synthetic_plain"]["mean"]
    text = fragmentation.report(out)
    assert "peak reserved bytes" in text
    # PyTorch's numbers are recorded ones (real_models.py on the H200), printed apart, with
    # their machine and date, never as a column of what this run measured.
    measured, recorded = text.split("recorded, not measured by this run")
    assert measured.startswith("measured by this run") and "PyTorch" not in measured
    for name, mib in fragmentation.EXPANDABLE_MIB.items():
        (row,) = [line.split() for line in recorded.splitlines() if line.startswith(name + " ")]
        assert row[1:5] == [f"{mib:,}", "H200", fragmentation.EXPANDABLE_DATES[name],
                            "real_models.py"]
        assert out["recorded"][name]["pytorch_expandable_mib"] == mib


def test_expandable_segments_reserve_less_than_pytorchs_on_the_real_training_runs():
    out = fragmentation.run(gpupool)
    for name in ("resnet50", "gpt2", "gpt2-varlen", "vit", "bert-varlen"):
        anchor_mib = fragmentation.EXPANDABLE_MIB[name]
        row = out["results"][name]
        # PyTorch's expandable segments reserved anchor_mib on the H200 for the same run.
        assert row["vmm"] <= anchor_mib * MiB, (name, row["vmm"] / MiB)
        assert row["vmm"] < 1.025 * row["peak_live"]
        # A region per step reserves exactly what the pool's policy does without magazines
        # (a region's requests pass them by; its own cold cached pages move to its growth).
        assert row["vmm_region"] == row["vmm_nomag"], (name, row["vmm_region"] / MiB)
        if name != "bert-varlen":
            assert row["vmm_region"] <= row["vmm"]   # and costs nothing
    # BERT: the magazines' held blocks placed the pool 6 MiB lower (8,896 against 8,902 MiB;
    # on the other four they cost 10-32 MiB).
    bert = out["results"]["bert-varlen"]
    assert bert["vmm_region"] - bert["vmm"] <= 6 * MiB
    # ViT-B/16: 5,234 MiB before small requests went against live small blocks (so_take_small),
    # 5,140 since (the H200: 5,140 too), 5,094 since cold free pages move to growth
    # (sg_reclaim); PyTorch's 5,110.
    assert out["results"]["vit"]["vmm"] <= 5100 * MiB


def test_small_requests_in_a_pool_of_their_own_cost_memory():
    # Serving requests up to 1 MiB from a pool of their own, as PyTorch does, landed on
    # PyTorch's own number on ViT-B/16 before cold pages moved to growth (sg_reclaim), and
    # cost ResNet-50 (many small blocks) more than it saved; it now costs both.
    rows = fragmentation.run(gpupool)["results"]
    assert rows["resnet50"]["vmm_split"] > rows["resnet50"]["vmm"]
    assert rows["vit"]["vmm_split"] > rows["vit"]["vmm"]
    assert all(r["vmm_split"] >= r["peak_live"] for r in rows.values() if "vmm_split" in r)


def test_a_planned_region_never_costs_memory_on_the_real_runs():
    for trace in [alloc_trace.load(p) for p in alloc_trace.find(fragmentation.REAL_DIR)]:
        stats = {}
        online = fragmentation.peak_reserved(gpupool, trace, "vmm", region=True)
        planned = fragmentation.peak_reserved(gpupool, trace, "vmm", region=True, plan=True,
                                              out=stats)
        # The contract's bound for varying shapes is 1%; the five runs reserve the same.
        assert planned <= online, (trace.name, planned / MiB, online / MiB)
        tried = stats["plan_hits"] + stats["plan_misses"]
        if trace.name in ("resnet50", "vit"):
            # Fixed shapes: planned from the fifth entry on, most requests at their place.
            assert stats["plans"] >= 1 and stats["plan_hits"] > 0.9 * tried
        if trace.name == "gpt2":
            # The size order's plan around the blocks that stay needed 150 MiB more than the
            # pool maps; the online way's order fits (Note [Plans in the online way's order]).
            assert stats["plans_not_fitting"] == 0 and stats["plan_hits"] > 0.9 * tried
        if trace.name.endswith("varlen"):
            # No sizes repeat, the structure does: planned from the envelope, served there.
            assert stats["plans"] >= 1 and stats["plan_hits"] > 0.9 * tried


def test_the_wall_clock_cap_decides_nothing_on_the_real_runs():
    # Plans are bounded by their work (Note [Planning budget in work]): every plan of the
    # real runs finishes within the default work budget, and lifting the wall-clock cap
    # changes nothing the replay reports, on any machine and under any load.
    for trace in [alloc_trace.load(p) for p in alloc_trace.find(fragmentation.REAL_DIR)]:
        capped, unbounded = {}, {}
        peak = fragmentation.peak_reserved(gpupool, trace, "vmm", region=True, plan=True,
                                           out=capped)
        free = fragmentation.peak_reserved(gpupool, trace, "vmm", region=True,
                                           plan={"budget_ms": math.inf}, out=unbounded)
        assert peak == free, (trace.name, peak / MiB, free / MiB)
        assert capped["plans_past_work"] == capped["plans_past_time"] == 0, trace.name
        for key in ("plans", "plan_hits", "plan_misses", "record_plans", "plans_not_fitting",
                    "plans_given_up", "planning_work", "plans_past_requests"):
            assert capped[key] == unbounded[key], (trace.name, key)


def test_plans_keep_the_lower_of_two_orders_on_the_checkpointing_runs():
    # The record plans set these runs' peaks: their predicted steps are placed around the
    # blocks the online era scattered (Llama: 4,279 MiB of parameters and optimizer state over
    # 5,825 MiB), whose holes the order by size x lifetime fills better than by size alone
    # (Note [Plans in two orders]). Each plan runs both and keeps the lower.
    found = {}
    for trace in [alloc_trace.load(p) for p in alloc_trace.find(fragmentation.REAL_DIR)]:
        if trace.name in ("gpt2-ckpt", "llama-ckpt"):
            stats = {}
            both = fragmentation.peak_reserved(gpupool, trace, "vmm", region=True, plan=True,
                                               out=stats)
            size = fragmentation.peak_reserved(gpupool, trace, "vmm", region=True,
                                               plan={"strategies": ("size",)})
            assert stats["plans_past_work"] == 0, trace.name
            found[trace.name] = (both / MiB, size / MiB, stats["record_plans"])
    assert found == {"gpt2-ckpt": (11664, 11758, 2), "llama-ckpt": (12346, 12786, 3)}
