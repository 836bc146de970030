"""A planned region's request that runs out of memory, on the simulated device: the pool runs the
``on_oom`` callbacks and retries it once, online, and the plan takes the request in once (its
cursor moves on by one request), through Python (``Pool.allocate_on``) and through the C API
(``_allocate_failed``). Every allocation is checked for overlap with the blocks live."""

import pytest
from conftest import check_invariants
from planned_steps import SIZES, Checked, Run, scaled
from test_planrecord_capi import ENTRIES, Through

import gpupool
from gpupool.region.planned import Planner
from gpupool.testing import Failures, SimulatedDevice

pytestmark = pytest.mark.usefixtures("default_pools")

# Every call that could give the pool memory fails until the on_oom callback runs: the growth,
# the ladder's (its trims' synchronize too, so that the region's cached memory stays mapped
# where the plan's places are).
FAILING = ("reserve", "map", "synchronize")


class Failing:
    """Requests made through ``mem`` (a Checked, or a Through for the C API) whose request
    ``k`` of the next entry, and every call after it that grows the pool, fail as out of
    memory until the ``on_oom`` callback runs; the callback frees: the failures stop (the
    device has room again). ``asked``: the bytes each callback run was asked for."""

    def __init__(self, sim, mem, k):
        self.sim, self.mem, self.k, self.armed, self.asked = sim, mem, k, False, []
        allocate = mem.allocate

        def failing(key, nbytes, stream=None):
            if self.armed and key[2] == self.k:
                self.armed = False
                sim.inject(Failures(FAILING, nth=1, times=None))
            return allocate(key, nbytes, stream)
        mem.allocate = failing

    def __call__(self, nbytes):
        self.asked.append(nbytes)
        self.sim.inject(None)


def _warm(entry, oom_callback, k, monkeypatch, spread=None):
    """A planned region warmed on SCALES (its plan installed, record steps on), requests made
    through ``entry`` (None: Python), whose next entry's request ``k`` on runs out of memory
    until the callback (a Failing) runs, with ``Run.spread(spread)``'s entries after the
    warming when given. Returns (Run, Failing, the entries' stopped flags from then on: its
    planner's exits are watched through ``monkeypatch``, on the class, since a Planner's
    attributes are fixed)."""
    sim = SimulatedDevice(capacity=1 << 32, virtual_memory=True)
    pool = gpupool.Pool(upstream=sim, device=0)
    gpupool.set_pool(pool)              # the C API's pool for device 0
    mem = Through(pool, entry) if entry else Checked(pool)
    failing = Failing(sim, mem, k)
    run = Run(pool, mem).warm()
    if spread:
        run.spread(spread)
    oom_callback(failing)
    stopped, exited, planner = [], Planner.exited, run.region.planner

    def watched(self, events, hits, misses, grew, stopped_=False, first=0):
        if self is planner:
            stopped.append(stopped_)
        return exited(self, events, hits, misses, grew, stopped_, first)
    monkeypatch.setattr(Planner, "exited", watched)
    failing.armed = True
    return run, failing, stopped


@pytest.mark.parametrize("entry", [None, *sorted(ENTRIES)])
def test_a_request_retried_after_the_callbacks_is_taken_in_by_the_plan_once(
        entry, oom_callback, monkeypatch):
    # A record step (request 0 asks more than any step): its plan is installed at request 0
    # and maps pages for its places past the mapped end. From request 1 on the pool cannot
    # grow until the callback runs: request 2 misses its place, goes online, runs out of
    # memory and is retried after the callback.
    run, failing, stopped = _warm(entry, oom_callback, 1, monkeypatch)
    hits, misses = run.entry(scaled(1.6))
    assert failing.asked == [scaled(1.6)[2]]
    assert run.region.stats().record_plans == 1
    # Requests 1 to 5 were each taken in by the plan once (request 0, the record's, is not
    # placed), and the entry stayed on the plan's step. Taken in again by the retry, request
    # 2 would have been request 3, at another event than the plan's: the rest of the entry
    # online, stopped.
    assert stopped == [False]
    assert hits + misses == len(SIZES) - 1 and hits >= 1
    assert run.entry(scaled(1.6)) == (len(SIZES) - 1, 0)     # the record plan kept
    run.close()


def test_request_0_of_a_record_step_retried_after_the_callbacks_plans_the_step(
        oom_callback, monkeypatch):
    # Through Python, the record step's slow path runs after the retry: request 0 alone taken
    # in, its plan made there and installed, the rest of the entry served from it.
    run, failing, _ = _warm(None, oom_callback, 0, monkeypatch, spread=0.2)
    assert run.entry(scaled(5.0)) == (len(SIZES) - 1, 0)
    assert failing.asked == [scaled(5.0)[0]]
    assert run.region.stats().record_plans == 1
    check_invariants(run.pool)
    run.close()
