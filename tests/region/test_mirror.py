"""Plans mirrored (gpupool.region.mirror, Note [Plans mirrored]): the same peak and no two
requests that live at once sharing bytes, the largest places at the top; and on the
simulated device a step whose later request grows past its place costs a planned region what
it costs a plain one."""

import numpy as np
from hypothesis import given, settings
from planned_steps import MIB, reserved_kib
from test_placement import clashes, steps

from gpupool.region import placement
from gpupool.region.mirror import mirrored


@settings(max_examples=60, deadline=None)
@given(steps())
def test_a_mirrored_plan_keeps_its_peak_and_its_requests_apart(step):
    plan = placement.plan(step)
    flipped = mirrored(plan)
    assert flipped.nbytes == -(-plan.nbytes // placement.ALIGN) * placement.ALIGN
    assert clashes(flipped) == []
    planned = step.planned
    assert (flipped.offsets[planned] >= 0).all() and (flipped.offsets[~planned] == -1).all()
    assert (flipped.offsets[planned] % placement.ALIGN == 0).all()
    # Each place as far from the top as it lay from the base.
    np.testing.assert_array_equal(flipped.nbytes - flipped.offsets[planned] -
                                  step.nbytes[planned], plan.offsets[planned])


def test_a_later_request_larger_than_its_place_grows_the_range_by_the_difference():
    # Steps of 1 MiB then 3 MiB, both live at once, then one entry asking 4 MiB for the second
    # (helper-84's search). Unmirrored, the plan put the 3 MiB place at the base and the 1 MiB
    # one above it: the 4 MiB request went online and the pool mapped 4 MiB more (8,192 KiB
    # against the plain region's 5,120). Mirrored, the 3 MiB place lies at the top and the
    # pool maps the difference, as the online way does.
    entries = [[MIB, 3 * MIB]] * 5 + [[MIB, 4 * MIB]] + [[MIB, 3 * MIB]] * 5
    assert reserved_kib(True, entries) == reserved_kib(False, entries) == (5120, 5120)
