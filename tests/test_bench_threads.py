"""The threads harness on CPU (bench/threads.py: its team of threads, its columns on the
simulated device, the C API's columns) and tools/profile/profile_threads.py, which uses it."""

import json
import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench"))

import threads  # noqa: E402


def test_team_runs_every_thread_and_reports_errors():
    seen = []

    def work_for(i):
        def work(ops):
            if i == 2 and ops == 13:
                raise RuntimeError("thread 2 failed")
            seen.append((i, ops))
        return work

    team = threads.Team(3, work_for)
    try:
        team.batch(5)
        assert sorted(seen) == [(0, 5), (1, 5), (2, 5)]
        with pytest.raises(RuntimeError, match="thread 2 failed"):
            team.batch(13)
    finally:
        team.close()


def test_team_gives_up_on_a_stuck_thread(monkeypatch):
    monkeypatch.setattr(threads, "BARRIER_TIMEOUT_S", 0.2)
    team = threads.Team(2, lambda i: (lambda ops: time.sleep(1.0 if i else 0)))
    with pytest.raises(threading.BrokenBarrierError):
        team.batch(1)
    team.close()                       # returns at once: the barrier is broken


def test_threads_script_on_the_simulated_device(tmp_path):
    out_json = tmp_path / "t.json"
    threads.main(["--simulated", "--quick", "--columns", "gp", "--json", str(out_json)])
    result = json.loads(out_json.read_text())
    gp = result["columns"]["gp"]
    assert set(gp["results"]) == {str(n) for n in threads.THREADS}
    assert all(r["ops_per_s"]["median"] > 0 for r in gp["results"].values())
    counters = gp["pool_counters"]
    assert counters["num_allocs"] > counters["cache_misses"] > 0


def test_team_puts_the_threads_loop_spans_on_one_time_line():
    spans = {0: (1_000, 3_000), 1: (2_000, 5_000)}      # 4 us from the first start to the last end
    team = threads.Team(2, lambda i: (lambda ops: spans[i]))
    try:
        team.batch(10)
    finally:
        team.close()
    assert team.loop_rates == [2 * 10 * 1e9 / 4_000]
    # Each thread's own rate: 10 pairs in 2 us and in 3 us.
    assert team.own_rates == [pytest.approx(10 * 1e9 / 2_000 + 10 * 1e9 / 3_000)]


def test_threads_cpu_control_column_scales_its_own_loops(tmp_path):
    out_json = tmp_path / "t.json"
    threads.main(["--simulated", "--quick", "--columns", "cpu", "--json", str(out_json)])
    result = json.loads(out_json.read_text())
    if "cpu" in result["skipped"]:
        pytest.skip(result["skipped"]["cpu"])           # no C compiler here
    results = result["columns"]["cpu"]["results"]
    assert set(results) == {"1", "2", "4", "8"}
    assert all(r["own_ops_per_s"] >= r["loop_ops_per_s"] > 0 for r in results.values())
    assert "each thread's own loop" in threads.report(result)


def test_each_c_api_column_allocates_from_its_own_pool(tmp_path, default_pools):
    out_json = tmp_path / "t.json"
    threads.main(["--simulated", "--quick", "--columns", "gp.capi,gp.capi.pts", "--json",
                  str(out_json)])
    result = json.loads(out_json.read_text())
    if "gp.capi" in result["skipped"]:
        pytest.skip(result["skipped"]["gp.capi"])       # no C compiler here
    for key in ("gp.capi", "gp.capi.pts"):
        column = result["columns"][key]
        assert all(r["loop_ops_per_s"] > 0 for r in column["results"].values())
        # Every pair of the column went through its own pool (warm-up, probe and reps).
        pairs = sum(int(n) * r["ops_per_thread"] * r["reps"] for n, r in column["results"].items())
        assert column["pool_counters"]["num_allocs"] >= pairs
        # Every thread of the four teams (1 + 2 + 4 + 8) made a magazine in the column's pool.
        magazines = column["magazines"]
        assert magazines["threads"] == 15
        assert set(magazines) == {"threads", "sweeps", *threads.MAGAZINE_COUNTS}
        assert 0 < magazines["misses"] <= column["pool_counters"]["num_allocs"]
        assert set(magazines["sweeps"]) == {"others", "want", "handed", "settle"}
        assert magazines["sweeps"]["want"] > 0          # the pool grew for the first requests
    assert "took the shared path, by reason, and those that waited" in threads.report(result)


def test_profile_threads_keeps_idle_threads_magazines_out_of_its_workers_counts(capsys,
                                                                               default_pools):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                    "tools", "profile"))
    try:
        import profile_threads
    finally:
        sys.path.pop(0)
    try:
        threads._loop_helper()
    except threads.Skip as exc:             # no C compiler here: the helper is not built
        pytest.skip(str(exc))
    profile_threads.main(["--simulated", "--threads", "2", "--idle", "3", "--per-thread",
                          "--seconds", "0.1"])
    line, sweeps = capsys.readouterr().out.splitlines()[:2]
    assert line.startswith("2 threads (and 3 idle) on per-thread default streams")
    # One share per worker (the idle threads' magazines are left out), for every count.
    shares = line.split("per thread, % of its pairs: ")[1].split("; ")
    assert [s.rsplit(" ", 2)[0] for s in shares] == list(profile_threads.SHARES.values())
    assert all(float(v) >= 0 for s in shares for v in s.rsplit(" ", 2)[1:])
    # The pool grew for the workers' first requests, so it swept the magazines then.
    counts = dict(kv.split() for kv in sweeps.split(": ")[1].split(", "))
    assert set(counts) == {"others", "want", "handed", "settle"} and int(counts["want"]) > 0
