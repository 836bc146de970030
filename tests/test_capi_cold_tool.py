"""tools/profile/capi_cold.py and the C replay it times (``bench/_capi_loop.c``'s ``replay``):
its argument checks, and that a replay through the C function is the workload of
long_replay.py's C API replay: the same peaks and planned region's counters, every block
given back, the events' checks before any call."""

import os
import sys

import numpy as np
import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tools", "profile"))

import alloc_trace  # noqa: E402
import capi_cold  # noqa: E402
import fragmentation  # noqa: E402
import long_replay  # noqa: E402

import gpupool  # noqa: E402

pytestmark = pytest.mark.usefixtures("default_pools")


@pytest.fixture(scope="module")
def c():
    try:
        return capi_cold.helper()
    except RuntimeError as exc:                     # no compiler: nothing to run
        pytest.skip(f"the C loop did not build: {exc}")


def trace_named(name, steps):
    (path,) = [p for p in alloc_trace.find(fragmentation.REAL_DIR)
               if os.path.basename(p) == f"{name}.npz"]
    return alloc_trace.first_steps(alloc_trace.load(path), steps)


@pytest.mark.parametrize("argv, said", [
    (["vit", "--pollute", "1GiB"], "--pollute: not a byte count"),
    (["vit", "--pollute", "-5"], "--pollute: not a byte count"),
    (["vit", "--repeats", "0"], "--repeats must be 1 or more"),
    (["vit", "--pollute", "0", "1MiB", "0"], "--pollute names each size once"),
    (["vit", "--steps", "5", "--from-step", "6"], "--from-step must be from 1 to --steps (5)"),
    (["vit", "--from-step", "0"], "got 0"),
    (["vit", "--steps", "31"], "got 31"),
    (["nonesuch"], "no recorded trace 'nonesuch'")])
def test_bad_arguments_exit_2_saying_what_is_accepted(argv, said, capsys):
    with pytest.raises(SystemExit) as stop:
        capi_cold.main(argv)
    assert stop.value.code == 2 and said in capsys.readouterr().err


def test_help_says_what_it_measures(capsys):
    with pytest.raises(SystemExit) as stop:
        capi_cold.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert stop.value.code == 0
    assert "C API" in out and "Region(scope=\"process\")" in out and "--pollute" in out


def test_byte_counts_take_kib_and_mib():
    assert [capi_cold.byte_count(t) for t in ("0", "4096", "64KiB", "8mib")] == \
        [0, 4096, 64 << 10, 8 << 20]


@pytest.mark.parametrize("way", capi_cold.WAYS)
def test_a_c_replay_is_long_replays_workload_and_gives_every_block_back(c, way):
    trace = trace_named("gpt2-ckpt", 9)             # planned from step 8 on (a record)
    got = capi_cold.replay(c, trace, way, pollute=4096, from_step=5)
    expected = capi_cold.reference_peaks(trace)
    assert got.peak_reserved == expected[way]
    # The timed steps' events, each a call: the trace's are all of live ids.
    timed = slice(trace.meta["step_starts"][4], None)
    ops = trace.op[timed]
    assert (got.allocates + got.firsts, got.frees) == \
        (np.count_nonzero(ops == 0), np.count_nonzero(ops == 1))
    assert got.allocate_ns > 0 and got.free_ns > 0 and got.clock_ns > 0
    assert got.firsts == 5 and got.first_ns > 0     # steps 5-9's request 0s, apart
    stats = got.pool_stats                          # the C API's calls reached its pool
    assert stats.in_use_bytes == 0 and stats.num_allocs == stats.num_frees == trace.num_allocs
    assert got.magazines == 1                       # the replaying thread's
    assert 0 < got.allocate_median and 0 < got.free_median and got.upstream_calls >= 0
    if way == "planned":
        (*_, planned), = capi_cold.on_fresh_thread(
            lambda: list(long_replay.long_replay(trace, 0, plan=True, capi=True)))
        names = ("plans", "plan_hits", "plan_misses", "record_plans")
        assert [getattr(got.stats, n) for n in names] == [getattr(planned, n) for n in names]
        assert got.stats.plan_hits > 0


def test_the_replay_refuses_a_trace_of_several_streams(c):
    with pytest.raises(ValueError, match="one stream"):
        capi_cold.replay(c, alloc_trace.synthetic(), "pool")
    with pytest.raises(ValueError, match="way must be one of"):
        capi_cold.replay(c, trace_named("gpt2-ckpt", 1), "nonesuch")


@pytest.fixture
def sim0():
    pool = gpupool.Pool(upstream=gpupool.testing.SimulatedDevice(capacity=1 << 30), device=0)
    gpupool.set_pool(pool, 0)
    return pool


def events(*rows):
    return [np.array(col, dtype=np.int64) for col in zip(*rows)]


def test_the_c_function_skips_what_long_replay_skips(c, sim0):
    # An allocation of a live id and a free of an id not live are skipped, not called.
    op, ids, nbytes = events((0, 0, 512), (0, 0, 512), (1, 1, 512), (1, 0, 512), (1, 0, 512))
    ptrs = np.zeros(2, dtype=np.int64)
    alloc_ns, free_ns, allocates, frees, clock_ns = c.replay(op, ids, nbytes, ptrs,
                                                             bytearray(1 << 16))
    assert (allocates, frees) == (1, 1) and not ptrs.any()
    stats = sim0.stats()
    assert (stats.num_allocs, stats.num_frees, stats.in_use_bytes) == (1, 1, 0)


def test_the_c_function_times_each_call_it_makes(c, sim0):
    op, ids, nbytes = events((0, 0, 512), (0, 0, 512), (0, 1, 1024), (1, 0, 512), (1, 1, 1024))
    times = np.full(5, 7, dtype=np.int64)
    alloc_ns, free_ns, *_ = c.replay(op, ids, nbytes, np.zeros(2, dtype=np.int64), None, times)
    assert times[1] == -1 and (np.delete(times, 1) > 0).all()     # the skipped event: -1
    assert (times[0] + times[2], times[3] + times[4]) == (alloc_ns, free_ns)


def test_the_c_function_keeps_pointers_across_calls(c, sim0):
    ptrs = np.zeros(1, dtype=np.int64)
    c.replay(*events((0, 0, 4096)), ptrs)
    assert ptrs[0] != 0 and sim0.stats().in_use_bytes == 4096
    c.replay(*events((1, 0, 4096)), ptrs)
    assert ptrs[0] == 0 and sim0.stats().in_use_bytes == 0


@pytest.mark.parametrize("rows, ptrs, error, said", [
    ([(2, 0, 512)], 1, ValueError, "event 0: op 2"),
    ([(0, 0, 512), (0, 1, 512)], 1, ValueError, "event 1: id 1 outside the 1 slots"),
    ([(0, -1, 512)], 1, ValueError, "id -1"),
    ([(0, 0, 0)], 1, ValueError, "an allocation of 0 bytes")])
def test_the_c_function_checks_the_events_before_any_call(c, sim0, rows, ptrs, error, said):
    with pytest.raises(error, match=said):
        c.replay(*events(*rows), np.zeros(ptrs, dtype=np.int64))
    assert sim0.stats().num_allocs == 0


def test_the_c_function_checks_its_arrays(c, sim0):
    op, ids, nbytes = events((0, 0, 512))
    ptrs = np.zeros(1, dtype=np.int64)
    with pytest.raises(TypeError, match="op must be a 1-D contiguous int64"):
        c.replay(op.astype(np.int32), ids, nbytes, ptrs)
    with pytest.raises(ValueError, match="same length"):
        c.replay(op, ids, np.append(nbytes, 1), ptrs)
    with pytest.raises(TypeError, match="ptrs must be"):
        c.replay(op, ids, nbytes, ptrs.reshape(1, 1))
    with pytest.raises((BufferError, ValueError), match="read-only"):
        c.replay(op, ids, nbytes, np.frombuffer(bytes(8), dtype=np.int64))
    with pytest.raises(BufferError, match="not writable"):
        c.replay(op, ids, nbytes, ptrs, b"read-only")
    with pytest.raises(ValueError, match="same length"):
        c.replay(op, ids, nbytes, ptrs, None, np.zeros(2, dtype=np.int64))
    with pytest.raises(TypeError, match="times must be"):
        c.replay(op, ids, nbytes, ptrs, None, np.zeros(1, dtype=np.float64))
    assert sim0.stats().num_allocs == 0


def test_a_refused_call_raises_naming_the_event(c, sim0):
    ptrs = np.array([0x1234], dtype=np.int64)               # not a block of the pool
    with pytest.raises(RuntimeError, match=r"event 0 \(free of id 0\): gpupool error"):
        c.replay(*events((1, 0, 512)), ptrs)


def test_fewer_steps_than_the_default_first_timed_one_time_the_last():
    args, trace = capi_cold.options(["gpt2-ckpt", "--steps", "3"])
    assert args.from_step == 3 and len(trace.meta["step_starts"]) == 3
    assert capi_cold.options(["gpt2-ckpt"])[0].from_step == 4
