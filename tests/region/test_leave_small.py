"""Small requests that leave a plan (Note [Small requests that leave a plan]): a small request
that a planned entry sends online after serving some at their places goes by best fit, not
below a live small block, which the plan may have put among the later requests' places."""

import gpupool
from gpupool.testing import SimulatedDevice

KIB = 1024


def _peak_kib(plan, steps):
    """Trial 35's loop: request 0, request 1 (held into the next entry), request 0 freed,
    request 2; peak reserved KiB on the expandable simulated device (64 KiB pages)."""
    pool = gpupool.Pool(upstream=SimulatedDevice(virtual_memory=True, page=64 * KIB))
    region, held = gpupool.Region(pool=pool, plan=plan), []
    for sizes in steps:
        with region:
            for buf in held:
                buf.close()
            first, second = pool.allocate(sizes[0]), pool.allocate(sizes[1])
            first.close()
            pool.allocate(sizes[2]).close()
            held = [second]
    for buf in held:
        buf.close()
    pool._verify()
    return pool.stats().peak_reserved_bytes // KIB


def test_a_small_request_that_grew_past_its_place_leaves_the_next_place_free():
    # Request 1 grows 1.2x for good from entry 10. It missed its place and went below the
    # live 64 KiB request 0, which the plan had put above request 2's place: request 2 found
    # no room and the pool mapped 2.5 MiB more (5,120 KiB against the plain region's 2,688).
    # By best fit it takes the free bytes above the plan's top.
    steps = [[64 * KIB, 3 * KIB, 2560 * KIB]] * 10 + [[64 * KIB, 3686, 2560 * KIB]] * 20
    assert _peak_kib(True, steps) == _peak_kib(False, steps) == 2688
