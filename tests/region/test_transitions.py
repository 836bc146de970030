"""A planned region whose entries each keep a buffer past the exit, the oldest dropped (a window
of kept outputs): the blocks left live lie elsewhere at every entry, so each entry needs a
transition plan of its own, made anew. TRANSITIONS_MAX of them in a row give the signature up
for GIVE_UP_EXITS exits (region/transitions.py, Note [Transitions without end])."""

import pytest
from conftest import check_invariants
from planned_steps import MIB, vpool, vsim  # noqa: F401 (fixtures)

import gpupool
from gpupool.region import planned
from gpupool.region.transitions import TRANSITIONS_MAX
from gpupool.testing import SimulatedDevice

ENTRIES = 100


def _window(pool, region, kept_max):
    """ENTRIES entries of 4, 1 and 3 MiB requests (the first two freed in the entry), the last
    kept past the exit, the oldest of more than ``kept_max`` kept closed. Returns the buffers
    still kept."""
    kept = []
    for _ in range(ENTRIES):
        with region:
            x = pool.allocate(4 * MIB)
            y = pool.allocate(MIB)
            x.close()
            kept.append(pool.allocate(3 * MIB))
            y.close()
        if len(kept) > kept_max:
            kept.pop(0).close()
    return kept


@pytest.mark.parametrize("kept_max", [4, 8])
def test_a_window_of_kept_buffers_is_not_planned_again_at_every_entry(vpool, kept_max):
    region = gpupool.Region(pool=vpool, plan=True)
    kept = _window(vpool, region, kept_max)
    stats = region.stats()
    # Before, 8 kept: a transition each entry, 186 plans in 100 entries. Now: the plans of the
    # signature, TRANSITIONS_MAX transitions, then GIVE_UP_EXITS exits online, and again.
    rounds = ENTRIES // (TRANSITIONS_MAX + planned.GIVE_UP_EXITS) + 1
    assert 1 <= stats.plans_given_up <= rounds
    assert stats.plans <= rounds * (TRANSITIONS_MAX + 4)
    assert stats.plan_hits > 0
    # The memory a plain region takes on the same entries.
    pool = gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 32, virtual_memory=True))
    plain = _window(pool, gpupool.Region(pool=pool), kept_max)
    assert vpool.stats().peak_reserved_bytes <= pool.stats().peak_reserved_bytes
    for buf in kept + plain:
        buf.close()
    check_invariants(vpool)
    check_invariants(pool)


def test_a_loop_whose_tails_lie_at_their_places_keeps_its_plan(vpool):
    # Buffers kept into the next entry only (as gradients are), at their planned places: the
    # steady plan serves every entry from the second on, no transition, nothing given up.
    region = gpupool.Region(pool=vpool, plan=True)
    kept = []
    for _ in range(ENTRIES):
        with region:
            for buf in kept:
                buf.close()
            x = vpool.allocate(4 * MIB)
            y = vpool.allocate(MIB)
            x.close()
            kept = [vpool.allocate(3 * MIB)]
            y.close()
    stats = region.stats()
    assert stats.plans_given_up == 0 and stats.plans <= 4
    assert stats.plan_misses == 0 and stats.plan_hits >= 3 * (ENTRIES - 5)
    kept[0].close()
    check_invariants(vpool)
