"""Blocks that regions give back join the pool's free neighbours (Note [Blocks given back
join]): random nested entries of several regions (one with a cap on its cache), their
exits, ``release()`` and drops. After each outermost exit no parked or held block is left
(the exit puts them back) and every buffer of the run is freed inside its entry, so two
neighbouring free blocks that the pool caches are a join that was missed."""

import gc
import random

import pytest
from conftest import check_invariants

import gpupool
from gpupool.snapshot import memory_snapshot
from gpupool.testing import SimulatedDevice

KIB = 1024


def _unjoined(pool):
    """Neighbouring free blocks of one segment that no region caches: (offset, offset)."""
    pairs = []
    for seg in memory_snapshot(pool)["segments"]:
        blocks = seg["blocks"]
        for a, b in zip(blocks, blocks[1:]):
            if a["state"] == b["state"] == "inactive" and a["region"] is None and \
                    b["region"] is None:
                pairs.append((a["address"] - seg["address"], b["address"] - seg["address"]))
    return pairs


def _entry(rng, pool, regions, entered=()):
    """One entry of a random region not in ``entered``, its requests freed in a random
    order, maybe an entry of another region nested inside it."""
    region = rng.choice(regions)
    if region in entered:
        return
    with region:
        bufs = [pool.allocate(rng.choice([4, 64, 200, 1024, 3000]) * KIB)
                for _ in range(rng.randint(1, 6))]
        if len(entered) < 2 and rng.random() < 0.5:
            _entry(rng, pool, regions, (*entered, region))
        rng.shuffle(bufs)
        for buf in bufs:
            buf.close()


@pytest.mark.parametrize("seed", range(6))
def test_blocks_given_back_by_regions_leave_no_free_neighbours_apart(seed):
    rng = random.Random(seed)
    pool = gpupool.Pool(upstream=SimulatedDevice(virtual_memory=True, page=64 * KIB))
    regions = [gpupool.Region(pool=pool, collect=None) for _ in range(3)] + \
        [gpupool.Region(pool=pool, collect=None, max_cached_bytes=512 * KIB)]
    for _ in range(60):
        _entry(rng, pool, regions)
        assert _unjoined(pool) == []
        check_invariants(pool)
        if rng.random() < 0.15:
            rng.choice(regions).release()
            assert _unjoined(pool) == []
        if rng.random() < 0.05:
            k = rng.randrange(len(regions))
            regions[k] = gpupool.Region(pool=pool, collect=None)    # the old one dropped
            gc.collect()
            assert _unjoined(pool) == []
    check_invariants(pool)
