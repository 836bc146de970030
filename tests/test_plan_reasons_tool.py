"""tools/profile/plan_reasons.py on a recorded trace: every plan the planner makes has one
label, so a pass's labels of plans made add up to its plans, the record plans' to its
record plans, those reused to its plans reused, the repairs used to its plans repaired, and
the planner's methods are its own again after."""

import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tools", "profile"))

import alloc_trace  # noqa: E402
import fragmentation  # noqa: E402
import plan_reasons  # noqa: E402

from gpupool.region import planned, tails  # noqa: E402

WRAPPED = ("exited", "place", "_steady", "_transition_plan", "record_plan", "_made", "_placed",
           "_repaired", "_transition_repaired")


def test_each_plan_made_has_one_label_per_pass_and_the_spies_are_removed_after(capsys,
                                                                              monkeypatch):
    # The rule that takes the blocks left live as freed at the entry's start is off, so that
    # the replay makes transitions to label (with it, gpt2-ckpt's makes none in passes 0 and 1).
    monkeypatch.setattr(tails, "freed_first", lambda events, ptr: False)
    (trace,) = [t for t in map(alloc_trace.load, alloc_trace.find(fragmentation.REAL_DIR))
                if t.name == "gpt2-ckpt"]
    originals = [getattr(planned.Planner, name) for name in WRAPPED]
    rows = plan_reasons.reasons(trace, passes=2)
    assert [getattr(planned.Planner, name) for name in WRAPPED] == originals
    assert len(rows) == 3
    plans = records = reused = repaired = 0
    for counts, stats in rows:
        made = sum(n for label, n in counts.items()
                   if not label.startswith(("reused", "kept", "no room")))
        assert made == stats.plans - plans
        assert counts["record at request 0"] == stats.record_plans - records
        assert sum(n for label, n in counts.items() if label.startswith("reused")) == \
            stats.plans_reused - reused
        assert sum(n for label, n in counts.items() if "repair (" in label and
                   not label.endswith("refused")) == stats.plans_repaired - repaired
        plans, records, reused = stats.plans, stats.record_plans, stats.plans_reused
        repaired = stats.plans_repaired
    assert any(label.startswith("transition: ") for label in rows[1][0])
    assert rows[0][0]["repair (grown, larger step)"] == 1       # the recorded step 11's
    assert plan_reasons.main(["gpt2-ckpt", "--passes", "0"]) == 0
    assert "record at request 0" in capsys.readouterr().out
