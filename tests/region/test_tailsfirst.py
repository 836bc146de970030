"""The blocks the last entry left live are taken as freed before the next entry's first
allocation when the last entry freed those of the entry before it first, whatever the request
numbers of either (``gpupool.region.tails``): a transition of another structure's entry then
needs no plan of its own (Note [Tails freed at the start] in docs/design.md)."""

import os
import sys

import numpy as np
import pytest
from conftest import check_invariants
from planned_steps import (  # noqa: F401 (fixtures)
    MIB,
    SIZE_ORDERS,
    Checked,
    recorded,
    run_structures,
    vpool,
    vsim,
)

import gpupool
from gpupool.region import placement, tails
from gpupool.region.planned import Planner

BASE = 1 << 30
# Request 3 is the tail (freed at the next entry's event 2); the step starts with two frees.
STEP = placement.Step([MIB, MIB, MIB, MIB], [2, 3, 5, 6], [4, 7, 8, 10], [0, 0, 0, 0], 8)


def rows(*events):
    return np.array(events, np.int64).reshape(-1, 3)


def test_freed_first_asks_for_every_block_freed_before_the_first_allocation():
    # An entry before (blocks 10, 11 left live), then one freeing both, then allocating.
    before = [(0, 0, 0), (10, MIB, 0), (11, MIB, 0)]
    assert tails.freed_first(rows(*before, (0, 0, 0), (10, 0, 0), (11, 0, 0), (12, MIB, 0)),
                             [10, 11])
    # Block 11 freed after the first allocation: not first.
    assert not tails.freed_first(
        rows(*before, (0, 0, 0), (10, 0, 0), (12, MIB, 0), (11, 0, 0)), [10, 11])
    # Nothing carried is no evidence; no marker, no entry.
    assert not tails.freed_first(rows(*before, (0, 0, 0), (12, MIB, 0)), [])
    assert not tails.freed_first(rows((10, MIB, 0), (10, 0, 0)), [10])
    # An entry that frees them and allocates nothing yet.
    assert tails.freed_first(rows(*before, (0, 0, 0), (11, 0, 0), (10, 0, 0)), [10, 11])


def test_left_live_at_the_start_ends_every_block_at_the_first_allocation():
    # Request 0 of the entry before is no tail of STEP's, request 3 is.
    carried = (np.array([0, 3]), np.array([BASE, BASE + MIB]), np.array([MIB, MIB]))
    _, _, end, tail = tails.left_live(STEP, carried, BASE, at_start=False)
    assert list(tail) == [False, True] and list(end) == [tails.FOREVER, 2]
    _, _, end, _ = tails.left_live(STEP, carried, BASE, at_start=True)
    assert list(end) == [2, 2]
    # More blocks than the step's frees before its first allocation: the rule does not hold.
    three = tuple(np.concatenate([a, a[:1]]) for a in carried)
    _, _, end, _ = tails.left_live(STEP, three, BASE, at_start=True)
    assert list(end) == [tails.FOREVER, 2, tails.FOREVER]


@pytest.mark.parametrize("at_start", [False, True])
def test_a_block_of_another_structure_freed_first_needs_no_transition(at_start):
    planner = Planner()
    planner._wanted = (b"sig", STEP)
    steady, _ = planner.place(base=BASE, span=8 * MIB, obstacles=[])
    # The entry before was of another structure: its request 0's block lies on request 0's
    # steady place (no tail of STEP's), installed after another signature.
    planner._recorded_steps.carried = (np.array([0]), np.array([BASE + steady.offsets[0]]), np.array([MIB]))
    planner._recorded_steps.at_start = at_start
    planner._wanted, planner.current = (b"sig", STEP), b"other"
    plan, _ = planner.place(base=BASE, span=8 * MIB, obstacles=[])
    assert planner._transition is not at_start
    assert (plan is steady) is at_start
    assert planner.counts["plans"] == 2 - at_start


def run_entry(mem, sizes, frees, tail, entry, late=False):
    """One entry: the tails of the entry before freed first (when ``late``, the block kept
    since entry 0 freed first instead, the tails after the first allocation), then ``sizes``
    allocated in order, request ``frees[k]`` freed after allocation k, every request but
    ``tail`` freed at the end."""
    old = [k for k in mem.live if k[0] == "tail"]
    for key in [("keep",)] if late else old:
        mem.free(key)
    for k, n in enumerate(sizes):
        mem.allocate(("tail" if k == tail else "step", entry, k), n)
        for key in old if late and k == 0 else ():
            mem.free(key)
        if frees[k] is not None and ("step", entry, frees[k]) in mem.live:
            mem.free(("step", entry, frees[k]))
    for key in [k for k in mem.live if k[0] == "step"]:
        mem.free(key)


# Two structures whose tails are different requests: A's request 4 (2 MiB), B's request 1
# (3 MiB), each entry's tail freed by the next entry before it allocates.
A = ([2 * MIB, 2 * MIB, MIB, 4 * MIB, 2 * MIB], [None, 0, None, 2, None], 4)
B = ([2 * MIB, 3 * MIB, MIB, MIB, 2 * MIB, MIB], [None, None, 0, 2, 3, None], 1)
ORDER = [A, B] * 8


def replay(pool, late=()):
    region = gpupool.Region(pool=pool, collect=None, plan={"strategies": SIZE_ORDERS})
    mem, out = Checked(pool), []
    for e, (sizes, frees, tail) in enumerate(ORDER):
        before = region.stats()
        with region:
            if e == 0 and late:
                mem.allocate(("keep",), 2 * MIB)
            run_entry(mem, sizes, frees, tail, e, late=e in late)
        check_invariants(pool)
        after = region.stats()
        out.append((after.plans - before.plans, after.plan_hits - before.plan_hits,
                    after.plan_misses - before.plan_misses))
    return region, out


def test_structures_that_free_their_tails_first_switch_without_transitions(vpool):
    region, out = replay(vpool)
    counts = region.planner.counts
    # Each exit installs the other structure's steady plan (the entry before's blocks are of
    # the other structure): at once, no transition planned or reused, every entry served
    # whole from the first install on.
    assert counts["installs"] == len(ORDER) - 4
    assert counts["plans"] == sum(p for p, _, _ in out) == 2 and counts["reused"] == 0
    assert [h for _, h, _ in out[5:]] == [len(s) for s, _, _ in ORDER[5:]]
    assert counts["misses"] == 0


def test_a_block_not_freed_first_after_all_is_a_miss_not_an_overlap(vpool):
    # Entry 12 (A, after B) frees another block first and B's tail after its first
    # allocation: the plan installed at once assumed the tail freed first. Request 0's place
    # on the tail's bytes is refused (a miss, served the online way), and the tail's free at
    # another event sends the rest online; no two live blocks share bytes (Checked). The
    # entries after it are served whole again.
    region, out = replay(vpool, late={12})
    assert out[12] == (0, 0, 2)
    assert out[14:] == [(0, len(s), 0) for s, _, _ in ORDER[14:]]


def test_llama_ckpts_replay_makes_no_transition_and_serves_no_worse(monkeypatch):
    """The recorded llama-ckpt trace (30 steps) replayed under a planned region on the
    simulated device (tools/profile/long_replay.py): every step frees the last one's gradients
    first, so each install of another structure's plan is its steady plan at once; with the
    rule off, transitions are planned. Fewer plans and less work, no fewer hits, no more misses,
    no higher peak."""
    trace, long_replay = recorded(monkeypatch, "llama-ckpt")
    made = []
    original = Planner._transition_plan
    monkeypatch.setattr(Planner, "_transition_plan",
                        lambda *args: made.append(1) or original(*args))
    (_, _, peak, _, stats), = long_replay.long_replay(trace, 0, plan=True)
    transitions, made[:] = len(made), []
    monkeypatch.setattr(tails, "freed_first", lambda events, ptr: False)
    (_, _, off_peak, _, off), = long_replay.long_replay(trace, 0, plan=True)
    assert transitions == 0 and len(made) >= 5
    assert stats.plans < off.plans and stats.planning_work < off.planning_work
    assert stats.plan_hits >= off.plan_hits and stats.plan_misses <= off.plan_misses
    assert peak <= off_peak


# Seed 1414 of tools/profile/deviations.py (KiB; planned_steps.run_structures): structure A
# holds its 1 KiB request 0 into the next entry, always one of structure B, which frees it
# first thing.
SEED_1414 = {
    "A": ([1, 696, 4, 755, 3080], "a0 a1 a2 f1 a3 a4 f4 f2 f3", [0]),
    "B": ([99, 27, 412], "a0 f0 a1 a2 f1 f2", []),
}


def test_a_request_the_other_structure_frees_first_has_a_place():
    # A's request 0 is freed at event 0 of B's entry, before B allocates: A's step records it
    # as a tail, and its plan places it clear of the rest. Escaped (unplanned), it went the
    # online way onto request 2's place, request 2 onto request 4's, and request 4 grew the
    # pool: 6,272 KiB against the plain region's 4,544.
    order = "AB" * 9 + "A"
    planned, stats = run_structures(SEED_1414, order, True)
    assert planned == run_structures(SEED_1414, order, False)[0] == 4544
    assert stats.plan_misses == 0 and stats.plan_hits > 0


def test_a_freed_span_is_cut_out_of_the_obstacles_with_its_own_end():
    # A record step's request 0 (1,000 B asked, 1,024 with the pool's rounding) inside the
    # first run of obstacles, freed at event 3: the run's bytes around it stay throughout.
    none = (np.zeros(0, np.int64),) * 3
    rows = tails.fixed_rows(STEP, none, BASE, [(0, 4096), (8192, 4096)], False,
                            freed=(1024, 1000, 3))
    assert sorted(map(tuple, rows.tolist())) == [
        (0, 1024, 0, tails.FOREVER), (1024, 1024, 0, 3), (2048, 2048, 0, tails.FOREVER),
        (8192, 4096, 0, tails.FOREVER)]
    assert tails.fixed_rows(STEP, none, BASE, [(0, 4096)], False).tolist() == [
        [0, 4096, 0, tails.FOREVER]]



def test_blocks_left_after_an_entry_that_left_none_are_freed_at_the_start():
    # Seed 1082 of tools/profile/deviations.py: structure A holds two blocks (2.7 MiB and
    # 807 B) into the next entry; structure B frees them first thing and holds nothing. At an
    # exit of A after B, the plan made for B's step placed its 7.7 and 7.9 MiB requests
    # around A's blocks as staying throughout (the entry before A left nothing, so nothing
    # showed them freed first), above 2.7 MiB: 22,592 KiB against the plain region's 16,128.
    # B's step begins with two frees, which can only be of blocks carried into it.
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "tools",
                                    "profile"))
    import deviations
    run = deviations.entries(1082)
    assert deviations.reserved(True, run)[1] == deviations.reserved(False, run)[1] == 16128 << 10


# Seed 1437 of tools/profile/deviations.py (KiB, rounded up; planned_steps.run_structures):
# two structures, each holding some requests into the next entry.
SEED_1437 = {
    "A": ([1, 129, 857, 2, 452, 89, 3, 40, 7, 566, 1, 1343, 21, 864, 2, 592, 34, 16, 1, 3, 61,
           8, 5028],
          "a0 a1 a2 a3 f2 a4 a5 a6 a7 a8 f7 f3 a9 f4 f9 a10 a11 a12 a13 a14 f13 a15 a16 a17 "
          "a18 a19 a20 a21 a22 f6 f15 f22 f14 f19 f10 f21 f12", [0, 1, 5, 8, 11, 16, 17, 18, 20]),
    "B": ([5, 24, 1950, 417, 11, 2924, 24, 2540], "a0 f0 a1 a2 a3 a4 a5 a6 f4 a7 f2 f6 f1 f3",
          [5, 7]),
}


def test_a_transition_left_at_the_start_is_laid_out_again():
    # B's transition is made at entry 5's exit (A's), around A's held blocks; entry 6, a B
    # after an A, leaves B's plan at its start (served online, its held blocks elsewhere).
    # Kept, the transition served entry 7 around blocks long freed: 5 of its 8 requests
    # missed and the pool grew to 10,432 KiB. Laid out again around entry 6's blocks, it
    # serves entry 7 whole, at the plain region's peak.
    planned, stats = run_structures(SEED_1437, "AABBBABB", True)
    assert planned == run_structures(SEED_1437, "AABBBABB", False)[0] == 7936
    assert stats.plan_hits == 8 and stats.plan_misses == 1
