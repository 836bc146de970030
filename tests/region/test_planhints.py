"""A planned region's walk to a place among blocks that stay (core/planned.pxd's pl_block_at
and its hints): the places are found, at the same addresses, with long-lived blocks between
them, and the hints stay correct when those blocks are freed and their records used again."""

from conftest import check_invariants
from planned_steps import (  # noqa: F401 (fixtures)
    FREES, KIB, MIB, SIZES, TAILS, Checked, run_step, vpool, vsim,
)

import gpupool

STAYS = 24          # long-lived blocks made between the first entry's requests


def first_entry_with_blocks_that_stay(pool, region, mem):
    """The first entry: SIZES' step with STAYS small blocks allocated between its requests
    and kept live after it (they escape the exit), so that the step's memory, and the plan's
    places later, lie among them."""
    with region:
        for k, n in enumerate(SIZES * 4):
            mem.allocate(("step", -1, k), n)
            for j in range(STAYS // (4 * len(SIZES))):
                mem.allocate(("stay", k, j), 64 * KIB)
        for key in [k for k in mem.live if k[0] == "step"]:
            mem.free(key)
    check_invariants(pool)


def planned_entries(pool, region, mem, first, count):
    """Entries first to first + count - 1 of the step; each entry's addresses and (hits,
    misses)."""
    found = []
    for e in range(first, first + count):
        before = region.stats()
        with region:
            addrs = run_step(mem, SIZES, FREES, TAILS, e)
        check_invariants(pool)
        after = region.stats()
        found.append((addrs, (after.plan_hits - before.plan_hits,
                              after.plan_misses - before.plan_misses)))
    return found


def test_places_among_blocks_that_stay_are_served_at_the_same_addresses(vpool):
    region = gpupool.Region(pool=vpool, plan=True, collect=None)
    mem = Checked(vpool)
    first_entry_with_blocks_that_stay(vpool, region, mem)
    found = planned_entries(vpool, region, mem, 0, 10)
    stays = sorted(b.ptr for k, b in mem.live.items() if k[0] == "stay")
    assert len(stays) == STAYS
    assert all(counts == (len(SIZES), 0) for _, counts in found[-4:])
    assert all(addrs == found[-1][0] for addrs, _ in found[-4:])
    # The step's memory lies among the blocks that stay: some place is above one of them.
    assert any(addr > stays[0] for addr in found[-1][0])


def test_blocks_that_stay_freed_and_their_records_used_again_leave_the_places_correct(vpool):
    region = gpupool.Region(pool=vpool, plan=True, collect=None)
    mem = Checked(vpool)
    first_entry_with_blocks_that_stay(vpool, region, mem)
    planned_entries(vpool, region, mem, 0, 8)
    # Every other block that stays goes (its record is retired, or joined into free memory),
    # and the pool makes new blocks outside the region (records used again elsewhere): the
    # installed plan's hints point at records that no longer hold their addresses.
    for i, key in enumerate(sorted(k for k in mem.live if k[0] == "stay")):
        if i % 2:
            mem.free(key)
    for j in range(STAYS):
        mem.allocate(("other", j), 32 * KIB + 512 * j)
    check_invariants(vpool)
    found = planned_entries(vpool, region, mem, 8, 10)
    # Whatever is served is served at its place (the same address every entry) and never
    # over a live block (Checked); the plan serves whole again once placed around them.
    served = [addrs for addrs, (hits, misses) in found if hits == len(SIZES) and not misses]
    assert len(served) >= 3
    assert all(addrs == served[-1] for addrs in served[-3:])
    for key in [k for k in mem.live if k[0] == "other"]:
        mem.free(key)
    found = planned_entries(vpool, region, mem, 18, 6)
    assert found[-1][1] == (len(SIZES), 0)
    mem.live.clear()
    assert check_invariants(vpool).in_use_bytes == 0
