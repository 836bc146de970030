"""bench/run_all.py's spread of repeated runs and the plots of its summary (bench/plots.py)."""

import os
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench"))

import run_all  # noqa: E402


def test_spread_of_two_runs():
    one = {"columns": {"gp": {"results": {"256": {"median": 100.0, "min": 1}}}},
           "results": {"4": {"ops_per_s": {"median": 10.0}}}, "env": {"median": "x"}}
    two = {"columns": {"gp": {"results": {"256": {"median": 125.0}}}},
           "results": {"4": {"ops_per_s": {"median": 10.0}}}}
    rows = run_all.spread([one, two])
    assert rows == [{"row": "gp 256 B", "medians": [100.0, 125.0], "spread": 0.25},
                    {"row": "4 threads", "medians": [10.0, 10.0], "spread": 0.0}]
    assert "worst 25.0%" in run_all.spread_table("x", rows)


def test_plots_of_a_run_all_summary(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import plots

    summary = {"scripts": {
        "alloc_latency": {"results": {"skipped": {}, "columns": {"gp": {"results": {
            "256": {"median": 150.0}, "4096": {"median": 160.0}}}}}},
        "threads": {"results": {"threads": [1, 2], "columns": {"gp": {"results": {
            "1": {"ops_per_s": {"median": 3e6}}, "2": {"ops_per_s": {"median": 2.9e6}}}}}}},
        "trace_replay": {"results": {"skipped": "no GPU"}},
    }}
    written, missing = plots.write_all(summary, str(tmp_path))
    assert sorted(os.path.basename(p) for p in written) == ["alloc_latency.png", "threads.png"]
    assert all(os.path.getsize(p) > 1000 for p in written)
    assert missing == ["trace_replay: no results"]
    monkeypatch.setattr(plots, "_pyplot", lambda: None)
    assert plots.write_all(summary, str(tmp_path)) == ([], ["matplotlib is not installed: "
                                                            "no plots"])


def test_plots_of_a_simulated_run_say_so_in_their_titles(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import plots

    plt = plots._pyplot()
    axes = []

    def subplots(*args, **kwargs):
        fig, ax = plt.subplots(*args, **kwargs)
        axes.append(ax)
        return fig, ax

    monkeypatch.setattr(plots, "_pyplot", lambda: types.SimpleNamespace(
        subplots=subplots, close=plt.close))
    column = {"gp": {"results": {"256": {"median": 150.0}}}}
    for simulated in (True, False):
        summary = {"scripts": {"alloc_latency": {"results": {"simulated": simulated,
                                                             "columns": column}}}}
        plots.write_all(summary, str(tmp_path))
    assert [ax.get_title() for ax in axes] == [
        "Cached allocate + free, legacy default stream (simulated device, not a GPU)",
        "Cached allocate + free, legacy default stream"]
