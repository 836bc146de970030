"""A planned region's exit plans off its thread (region/background.py): the exit returns once
it has read the layout, ``Planner.place`` runs on the worker thread, and the plan is installed
at the region's next call (its next entry, ``stats()``, ``release()``, ``planner``), which
waits for it. The same plans serve the same entries as when installed at the exit; an
exception, a fork, interpreter shutdown, a region dropped, another thread's call and a capture
with a plan in flight. See Note [Plans off the exit] in docs/design.md."""

import gc
import threading

import pytest
from conftest import check_invariants, fresh_python
from planned_steps import FREES, SIZES, TAILS, Checked, run_step, vpool, vsim  # noqa: F401
from test_planned_capture import UNSAFE, OnStream

import gpupool
from gpupool.region.planned import Planner
from gpupool.testing import SimulatedDevice

ENTRIES = 8
WAIT_S = 60                 # a guard against a hang, never reached when the test passes
# The fields of RegionStats that depend on the work done, not on the wall clock.
TIMED = {"planning_ms", "record_ms", "collect_seconds"}


class Held:
    """Planner.place and Planner.exited spied on: each exit's action, the threads that ran
    place, and place held until the test lets it go (``go()``), so an exit that waited for
    its plan would hang (then fail on WAIT_S)."""

    def __init__(self, monkeypatch):
        self.actions, self.threads, self.placed = [], [], 0
        self.finished = threading.Event()       # set when a place returns
        self._permits = threading.Semaphore(0)
        place, exited = Planner.place, Planner.exited

        def held_place(planner, *args):
            self.threads.append(threading.get_ident())
            assert self._permits.acquire(timeout=WAIT_S), "place was never let go"
            made = place(planner, *args)
            self.placed += 1
            self.finished.set()
            return made

        def spied_exited(planner, *args, **kwargs):
            self.actions.append(exited(planner, *args, **kwargs))
            return self.actions[-1]

        monkeypatch.setattr(Planner, "place", held_place)
        monkeypatch.setattr(Planner, "exited", spied_exited)

    def go(self):
        self._permits.release()


def reference(entries=ENTRIES):
    """Each entry's addresses (``relative``) and the stats of a region, on a pool of its own,
    whose plans are taken right after each exit (``stats()``), as they were installed at the
    exit before the worker existed."""
    pool = gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 32, virtual_memory=True))
    region = gpupool.Region(pool=pool, plan=True, collect=None)
    mem, found = Checked(pool), []
    for e in range(entries):
        with region:
            found.append(run_step(mem, SIZES, FREES, TAILS, e))
        region.stats()
    return relative(found), region.stats().as_dict()


def relative(found):
    """Each entry's addresses less the first entry's first one."""
    return [[ptr - found[0][0] for ptr in addrs] for addrs in found]


def untimed(stats):
    return {k: v for k, v in stats.items() if k not in TIMED}


def test_the_exit_returns_before_its_plan_is_made_on_the_worker_and_the_same_entries_are_served(
        vpool, monkeypatch):
    expected, expected_stats = reference()
    held = Held(monkeypatch)
    region = gpupool.Region(pool=vpool, plan=True, collect=None)
    mem, found = Checked(vpool), []
    for e in range(ENTRIES):
        with region:
            found.append(run_step(mem, SIZES, FREES, TAILS, e))
        check_invariants(vpool)
        if held.actions[-1] == "layout":
            # Here place is held: a plan made on the exit's thread would not have returned.
            assert held.placed < held.actions.count("layout")
            held.go()
    assert "layout" in held.actions
    assert held.threads and threading.get_ident() not in held.threads
    assert relative(found) == expected
    assert untimed(region.stats().as_dict()) == untimed(expected_stats)
    assert held.placed == len(held.threads)


def test_stats_and_the_planner_wait_for_the_plan_in_flight(vpool):
    region = gpupool.Region(pool=vpool, plan=True, collect=None)
    mem = Checked(vpool)
    for e in range(4):          # the fourth exit plans (the second step's signature repeats)
        with region:
            run_step(mem, SIZES, FREES, TAILS, e)
    assert region.stats().plans == 1
    assert len(region.planner.plans) == 1
    with region:
        run_step(mem, SIZES, FREES, TAILS, 4)
    assert region.stats().plan_hits == len(SIZES)


def test_an_exception_making_the_plan_is_raised_at_the_next_call_once(vpool, monkeypatch):
    # Raised where the next call of the region takes the plan, the table left as it was (the
    # exit's failure left it so): the entry it is raised at does not start, the next one does.
    place = Planner.place
    failures = []

    def failing(planner, *args):
        if not failures:
            failures.append(RuntimeError("the plan failed"))
            raise failures[0]
        return place(planner, *args)

    monkeypatch.setattr(Planner, "place", failing)
    region = gpupool.Region(pool=vpool, plan=True, collect=None)
    mem = Checked(vpool)
    for e in range(4):
        with region:
            run_step(mem, SIZES, FREES, TAILS, e)
    with pytest.raises(RuntimeError, match="the plan failed") as raised:
        with region:
            raise AssertionError("entered")
    assert raised.value is failures[0]
    assert region.stats().entries == 4 and region.stats().plans == 0
    for e in range(4, 8):       # planned again from the steps that follow
        with region:
            run_step(mem, SIZES, FREES, TAILS, e)
    assert region.stats().plan_hits > 0
    mem.live.clear()
    assert check_invariants(vpool).in_use_bytes == 0


def test_release_with_a_plan_in_flight_clears_it_and_raises_its_exception(vpool, monkeypatch):
    region = gpupool.Region(pool=vpool, plan=True, collect=None)
    mem = Checked(vpool)
    for e in range(4):
        with region:
            run_step(mem, SIZES, FREES, TAILS, e)
    region.release()            # the plan made, installed, then dropped
    assert region.stats().plans == 1

    def failing(planner, *args):
        raise RuntimeError("the plan failed")

    held = Held(monkeypatch)
    monkeypatch.setattr(Planner, "place", failing)
    with region:                # online, released; its exit plans again
        run_step(mem, SIZES, FREES, TAILS, 4)
    assert held.actions == ["layout"]
    with pytest.raises(RuntimeError, match="the plan failed"):
        region.release()
    monkeypatch.undo()
    with region:                # released all the same: online, nothing raised again
        run_step(mem, SIZES, FREES, TAILS, 5)
    assert region.stats().plan_hits == 0
    mem.live.clear()
    assert check_invariants(vpool).in_use_bytes == 0


def test_another_threads_call_waits_for_the_plan_and_installs_it_once(vpool, monkeypatch):
    expected, expected_stats = reference(5)
    held = Held(monkeypatch)
    region = gpupool.Region(pool=vpool, plan=True, collect=None, scope="process")
    mem, found = Checked(vpool), []
    for e in range(4):
        with region:
            found.append(run_step(mem, SIZES, FREES, TAILS, e))
    assert held.actions[-1] == "layout"
    seen = []
    other = threading.Thread(target=lambda: seen.append(region.stats()))
    other.start()
    held.go()
    other.join(WAIT_S)
    assert not other.is_alive() and seen[0].plans == 1
    with region:
        found.append(run_step(mem, SIZES, FREES, TAILS, 4))
    assert relative(found) == expected
    assert untimed(region.stats().as_dict()) == untimed(expected_stats)


def test_a_region_dropped_with_a_plan_in_flight_leaves_the_pool_whole(vpool, monkeypatch):
    held = Held(monkeypatch)
    region = gpupool.Region(pool=vpool, plan=True, collect=None)
    mem = Checked(vpool)
    for e in range(4):
        with region:
            run_step(mem, SIZES, FREES, TAILS, e)
    assert held.actions[-1] == "layout"
    del region
    gc.collect()
    held.go()                   # the plan is made for a planner no region holds: dropped
    assert held.finished.wait(WAIT_S) and held.placed == 1
    mem.live.clear()
    vpool.trim()
    assert check_invariants(vpool).in_use_bytes == 0


def test_an_entry_under_capture_installs_the_plan_in_flight_with_no_driver_call(vsim, monkeypatch):
    held = Held(monkeypatch)
    pool = gpupool.Pool(upstream=vsim)
    stream = vsim.create_stream()
    mem = OnStream(pool, vsim, stream)
    region = gpupool.Region(pool=pool, plan=True, collect=None)
    for e in range(4):
        with region:
            run_step(mem, SIZES, FREES, TAILS, e)
    assert held.actions[-1] == "layout"
    held.go()
    start = len(vsim.calls)
    vsim.capturing.add(stream)
    try:
        with region:
            run_step(mem, SIZES, FREES, TAILS, 4)
    finally:
        vsim.capturing.discard(stream)
    calls = {name for name, _ in vsim.calls[start:]}
    assert not calls & UNSAFE, calls
    assert region.stats().plan_hits == len(SIZES) and vsim.errors == []


# A plan is held in flight (place sleeps) when the process forks or ends.
IN_FLIGHT = """
import os, sys, threading, time
import gpupool
from gpupool.region.planned import Planner
from gpupool.testing import SimulatedDevice

place, started = Planner.place, threading.Event()
def slow(planner, *args):
    started.set()
    time.sleep(0.5)
    return place(planner, *args)
Planner.place = slow
pool = gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 32, virtual_memory=True))
region = gpupool.Region(pool=pool, plan=True, collect=None)
for e in range(4):
    with region:
        for n in (3 << 20, 1 << 20, 5 << 20):
            buf = pool.allocate(n)
assert started.wait(10)
"""


def test_a_fork_child_never_waits_for_the_plan_in_flight():
    result = fresh_python(IN_FLIGHT + """
pid = os.fork()
if pid == 0:
    # The worker does not exist here: the plan is dropped, not waited for.
    try:
        region.stats()
    except gpupool.GpupoolError:
        pass
    try:
        region.__enter__()
    except gpupool.GpupoolError as exc:
        os._exit(0 if "fork()" in str(exc) else 3)
    os._exit(2)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert region.stats().plans >= 1      # made in the parent, its worker alive
print("ok")
""", "-W", "ignore::DeprecationWarning", timeout=WAIT_S)
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr


def test_the_interpreter_ends_with_a_plan_in_flight():
    result = fresh_python(IN_FLIGHT + """
print("ok")
""", timeout=WAIT_S)
    assert result.returncode == 0 and result.stdout == "ok\n" and result.stderr == "", \
        result.stderr
