"""What the planner keeps of a signature's steps (gpupool.region.seen): the envelope, and
whether a plan of it reserves more than any step measured needs (Note [Envelopes that no step
needs] in docs/design.md)."""

import os
import sys

from planned_steps import KIB, MIB

import gpupool
from gpupool.region import placement, seen
from gpupool.region import planned as planned_mod
from gpupool.testing import SimulatedDevice


def step(*sizes):
    """Requests allocated one after the other, all live to the step's end."""
    n = len(sizes)
    return placement.Step(sizes, range(n), [2 * n - 1 - k for k in range(n)], [0] * n, 2 * n)


def test_an_envelope_of_sizes_that_move_together_is_a_step_of_its_own():
    s = None
    for scale in (1, 3, 2):
        s = seen.fold(s, step(scale * MIB, scale * 2 * MIB), scale * MIB, 1 << 16)
    assert s.count == 3 and list(s.envelope) == [3 * MIB, 6 * MIB] and s.floor == 9 * MIB
    assert (s.r_max, s.r_min) == (3 * MIB, MIB)
    assert seen.fits(s, step(*s.envelope))


def test_an_envelope_of_sizes_that_vary_each_on_its_own_does_not_fit():
    # 4 + 1 MiB, then 1 + 4 MiB: no step has 8 MiB live, the envelope's step has.
    s = seen.fold(seen.fold(None, step(4 * MIB, MIB), 1, 1 << 16), step(MIB, 4 * MIB), 1, 1 << 16)
    assert s.floor == 5 * MIB and not seen.fits(s, step(*s.envelope))
    # A step no larger anywhere measures nothing (the envelope stays a step's own).
    s = seen.fold(None, step(4 * MIB, MIB), 1, 1 << 16)
    assert seen.fold(s, step(MIB, MIB), 1, 1 << 16).floor == 0


def _alternating(plan, entries=16):
    pool = gpupool.Pool(upstream=SimulatedDevice(virtual_memory=True, page=64 * KIB))
    region = gpupool.Region(pool=pool, plan=plan)
    for e in range(entries):
        with region:
            a = pool.allocate(4 * MIB if e % 2 else MIB)
            b = pool.allocate(MIB if e % 2 else 4 * MIB)
            a.close()
            b.close()
    pool._verify()
    return pool.stats().peak_reserved_bytes // KIB, region.planner and region.planner.counts


def test_a_region_plans_no_envelope_that_no_step_needs():
    # Planned as the envelope, 4 + 4 MiB; the plain region reserves 5 MiB.
    (planned, counts), (plain, _) = _alternating(True), _alternating(False)
    assert planned == plain == 5 * 1024 and counts["envelopes_refused"] >= 1
    # Refused, the signature waits RETRY_EXITS exits before its envelope is checked again
    # (each check sorts the step's events): 7 checks in 16 entries, not one at each exit.
    assert counts["envelopes_refused"] <= 16 // planned_mod.RETRY_EXITS


def test_seed_1830s_sizes_varied_each_on_its_own_cost_no_more_than_the_plain_region():
    # tools/profile/deviations.py's "vary_all" runs: every size scaled on its own each entry.
    # Seed 1830 planned its envelope at 1.75 times the plain region's peak.
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "tools",
                                    "profile"))
    import deviations
    run = deviations.entries(1830)
    assert deviations.reserved(True, run)[1] == deviations.reserved(False, run)[1]
