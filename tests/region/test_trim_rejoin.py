"""A trim joins the pool's free blocks again once their streams' work is done (sg_rejoin in
core/giveback.pxd). Joining is not transitive: a region's free block takes in the pool's, and
another region's free block may border that same pool block, but two regions' blocks stay
apart. Taken in address order, each block either joins the run below it or starts its own;
taken run starts first (as before), such a block was left out of the free lists
(`_verify()`: "3 free and 1 parked blocks, lists hold 2 and 1"). Found by
tests/region/test_lane.py's sweeping thread; this is the single-threaded run that showed it."""

import random

import gpupool
from gpupool.testing import SimulatedDevice

MIB = 1 << 20


def test_trims_among_three_planned_regions_keep_every_free_block_listed():
    rng = random.Random(3)
    for _ in range(6):
        pool = gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 32, virtual_memory=True))
        regions = [gpupool.Region(pool=pool, collect=None, plan=True) for _ in range(3)]
        sizes = [[(k + i // 8) % 3 * MIB + MIB for i in range(40)] for k in range(3)]
        for _ in range(25):
            for k in range(3):
                with regions[k]:
                    for n in sizes[k]:
                        pool.allocate(n).close()
                        if rng.random() < 0.05:
                            pool.trim()
                            assert pool._verify() == []
                        rng.random()
                if rng.random() < 0.3:
                    pool.trim()
                    assert pool._verify() == []
