"""Record steps of a planned region (Region(plan=True)) whose requests come through gpupool's C
API (the table's allocate, RMM's stream-ordered callbacks, PyTorch's two mallocs), on the
simulated device: the record step's plan is made at its request 0 on the allocating thread, as
for Python's requests, an exception of that slow path becomes the entry's error status, and
another thread's events while it runs leave the entry online, never two blocks on one byte."""

import logging
import sys
import threading

import capi_table as capi
import pytest
from conftest import check_invariants
from planned_steps import FREES, MIB, SIZES, TAILS, Checked, Run, run_step, scaled

import gpupool
from gpupool.adapters import torch_entry
from gpupool.adapters.rmm_entry import RmmCallbacks
from gpupool.errors import GpupoolError
from gpupool.region.planned import Planner
from gpupool.testing import SimulatedDevice

pytestmark = pytest.mark.usefixtures("default_pools")

INTERNAL = 100004           # GPUPOOL_ERROR_INTERNAL (include/gpupool_status.h)


class Held:
    """A block of the C API, freed through it when the last reference goes (as a buffer)."""

    def __init__(self, ptr, nbytes, free):
        self.ptr, self.nbytes, self._free = ptr, nbytes, free

    def __del__(self):
        self._free(self.ptr, self.nbytes)


def _capi_free(ptr, nbytes):
    assert capi.call("free", 0, ptr, 0) == 0


def _torch_free(ptr, nbytes):
    torch_entry._torch_free(ptr, nbytes, 0, 0, gil=False)


# Each entry that allocates through the C API: (allocate(pool, nbytes) -> pointer or raises,
# free(ptr, nbytes)). PyTorch's are called without the GIL, as PyTorch does.
ENTRIES = {
    "allocate": (lambda pool, n: capi.allocate(n), _capi_free),
    "rmm": (lambda pool, n: RmmCallbacks(pool).allocate(n, 0), _capi_free),
    "torch": (lambda pool, n: torch_entry._torch_malloc(n, 0, 0, gil=False), _torch_free),
    "torch-raising": (lambda pool, n: torch_entry._torch_malloc_checked(n, 0, 0, gil=False),
                      _torch_free),
}


class Through(Checked):
    """Checked's requests made through one C API entry (every allocation checked for
    overlap with the blocks live, under a lock: threads share it)."""

    def __init__(self, pool, entry):
        super().__init__(pool)
        self._allocate, self._free = ENTRIES[entry]
        self._lock = threading.Lock()

    def allocate(self, key, nbytes, stream=None):
        ptr = self._allocate(self.pool, nbytes)
        assert ptr, f"the C API gave no pointer for {nbytes} B"
        with self._lock:
            self.live[key] = Held(ptr, nbytes, self._free)
            spans = sorted((b.ptr, b.ptr + b.nbytes) for b in self.live.values())
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert end <= start, "two live blocks share bytes"
        return self.live[key]

    def free(self, key):
        with self._lock:
            del self.live[key]


def _pool():
    pool = gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 32, virtual_memory=True),
                        device=0)
    gpupool.set_pool(pool)              # the C API's pool for device 0
    return pool


def _run(pool, entry, **region):
    return Run(pool, Through(pool, entry) if entry else None, **region)


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_record_steps_through_the_c_api_are_planned_and_served_as_pythons(entry):
    found = {}
    for way in (None, entry):           # Python's requests, then the same through the C API
        run = _run(_pool(), way).warm()
        entries = [run.entry(scaled(scale)) for scale in (1.5, 0.8, 0.8, 0.8, 1.5, 2.1, 0.5)]
        offsets = [a - min(run.addrs) for a in run.addrs]     # each device maps elsewhere
        found[way] = (entries, offsets, run.region.stats().record_plans,
                      run.pool.stats().peak_reserved_bytes)
        run.close()
    entries, _, records, _ = found[entry]
    # The record step's request 0 went online, the others were served from its plan.
    assert entries[0] == (len(SIZES) - 1, 0) and records == 2
    assert found[entry] == found[None]  # the same hits, places and peak


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_an_exception_of_the_record_slow_path_is_the_c_apis_error(entry, caplog, monkeypatch):
    run = _run(_pool(), entry).warm()
    in_use = run.pool.stats().in_use_bytes

    def failing(*args):
        raise RuntimeError("planner failure")
    monkeypatch.setattr(Planner, "record_plan", failing)    # (a Planner's attributes are fixed)
    with run.region:
        for key in [k for k in run.mem.live if k[0] == "tail"]:
            run.mem.free(key)
        in_use = run.pool.stats().in_use_bytes
        with caplog.at_level(logging.ERROR, logger="gpupool"):
            if entry == "torch":
                assert torch_entry._torch_malloc(scaled(1.5)[0], 0, 0, gil=False) == 0
            elif entry == "allocate":
                ptr = capi.C.c_void_p()
                assert capi.call("allocate", 0, scaled(1.5)[0], 0, capi.C.byref(ptr)) == \
                    INTERNAL and not ptr.value
            else:
                with pytest.raises(GpupoolError, match="internal error"):
                    ENTRIES[entry][0](run.pool, scaled(1.5)[0])
        assert run.pool.stats().in_use_bytes == in_use      # its block was freed
    check_invariants(run.pool)
    [record] = [r for r in caplog.records if "slow path raised" in r.getMessage()]
    assert record.exc_info[0] is RuntimeError and f"{scaled(1.5)[0]} B" in record.getMessage()
    # The slow paths are the allocation's again: once the structure repeats, the entries are
    # served and a record step is planned as before.
    monkeypatch.undo()
    for _ in range(4):
        run.entry(scaled(0.8))
    assert run.entry(scaled(0.8)) == (len(SIZES), 0)
    assert run.entry(scaled(1.6)) == (len(SIZES) - 1, 0)
    assert run.region.stats().record_plans == 1
    run.close()


def _two_threads(run, pause):
    """Run an entry of scaled(1.5) whose request 0 (a record step) comes through the C API on a
    worker thread; pause(go, done) is installed where that thread waits (go set) while the
    main thread makes request 1 through the C API, then sets done. Returns the entry's
    (hits, misses)."""
    go, done = threading.Event(), threading.Event()
    pause(go, done)
    sizes, failed = scaled(1.5), []

    def request_0():
        try:
            run.mem.allocate(("step", 99, 0), sizes[0])
        except BaseException as e:      # noqa: BLE001 (reported by the main thread)
            failed.append(e)
            go.set()
    before = run.region.stats()
    with run.region:
        for key in [k for k in run.mem.live if k[0] == "tail"]:
            run.mem.free(key)
        worker = threading.Thread(target=request_0)
        worker.start()
        assert go.wait(30)
        run.mem.allocate(("step", 99, 1), sizes[1])     # the process region covers it
        done.set()
        worker.join(30)
        assert not failed, failed
        for k in range(2, len(sizes)):                  # the rest of the step, online
            run.mem.allocate(("step", 99, k), sizes[k])
        run.mem.live.clear()
    check_invariants(run.pool)
    after = run.region.stats()
    return after.plan_hits - before.plan_hits, after.plan_misses - before.plan_misses


def test_another_threads_request_while_the_record_plan_is_made_leaves_the_entry_online(
        monkeypatch):
    run = _run(_pool(), "allocate", scope="process").warm()
    planner, record = run.region.planner, Planner.record_plan

    def pause(go, done):
        def waiting(*args):
            go.set()
            assert done.wait(30)
            return record(*args)
        monkeypatch.setattr(Planner, "record_plan", waiting)
    assert _two_threads(run, pause) == (0, 0)
    # Planned, not installed: the entry went on online; the region plans on.
    assert planner.counts["records"] == 1 and planner.counts["records_dropped"] == 1
    assert run.region.stats().record_plans_dropped == 1     # and the region's stats say so
    monkeypatch.undo()
    for _ in range(4):
        run.entry(scaled(1.0))
    assert run.entry(scaled(1.0)) == (len(SIZES), 0)
    run.spread(0.3)                     # request 0 varied 3.3 times: 2.5 times is a record
    assert run.entry(scaled(2.5)) == (len(SIZES) - 1, 0)
    run.close()


class _Library:
    """A module in sys.modules whose __file__ pauses the thread reading it: the record step's
    slow path reads it (its trace site: Region(trace=True)) before it asks the core for the
    plan's layout."""

    def __init__(self, go, done):
        self._go, self._done = go, done

    @property
    def __file__(self):
        if threading.current_thread() is not threading.main_thread():
            self._go.set()
            assert self._done.wait(30)
        return None


def test_another_threads_request_before_the_record_slow_path_runs_leaves_it_unplanned(
        monkeypatch):
    run = _run(_pool(), "allocate", scope="process", trace=True).warm()

    def pause(go, done):
        monkeypatch.setitem(sys.modules, "numba", _Library(go, done))
    assert _two_threads(run, pause) == (0, 0)
    assert run.region.planner.counts["records"] == 0
    monkeypatch.delitem(sys.modules, "numba")
    for _ in range(4):
        run.entry(scaled(1.0))
    assert run.entry(scaled(1.0)) == (len(SIZES), 0)
    run.close()


@pytest.mark.parametrize("seed", range(3))
def test_two_threads_allocating_through_the_c_api_never_overlap(seed):
    run = _run(_pool(), "allocate", scope="process").warm()
    scales = [1.0, 1.7, 0.6, 2.2, 1.1, 2.6, 0.9, 3.0][seed:] + [1.0, 3.2]
    for e, scale in enumerate(scales):
        sizes, errors = scaled(scale), []

        def other(e=e):
            try:
                for k in range(3):
                    run.mem.allocate(("other", e, k), (k + 1) * MIB)
                    run.mem.free(("other", e, k))
            except BaseException as err:    # noqa: BLE001 (reported by the main thread)
                errors.append(err)
        with run.region:
            worker = threading.Thread(target=other)
            worker.start()
            run_step(run.mem, sizes, FREES, TAILS, 100 + e)
            worker.join(30)
        assert not errors, errors
        check_invariants(run.pool)
    run.close()
