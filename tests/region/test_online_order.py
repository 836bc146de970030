"""Plans in the online way's order (placement.STRATEGIES["start"], Note [Plans in the online
way's order]): where no greedy order places lower, a plan keeps the online way's layout, not
mirrored; around a record step's request 0 it finds the layout the size order misses."""

import numpy as np
from planned_steps import KIB, scripted_kib

from gpupool.region import placement, planned


def test_a_step_no_greedy_order_packs_lower_keeps_the_online_ways_layout():
    # Two requests live at once, 3.7 MiB then 2.3 MiB. Every order packs them at the floor;
    # the plan is the online way's: the later request above the earlier.
    step = placement.Step([3854954, 2447677], [0, 1], [2, 3], [0, 0], 4)
    made = planned.Planner()._made(step, np.zeros((0, 2), np.int64))
    assert made.method == "start"
    assert made.offsets.tolist() == [0, placement.Step([3854954], [0], [1], [0], 2).nbytes[0]]


def test_a_request_that_grows_for_good_costs_what_it_costs_a_plain_region():
    # Trial 33's sweep, its seed 69: request 3 grows 1.5x from entry 12 on. The size order,
    # mirrored, put request 2 (the largest) above request 3, so the grown request went on top
    # of it: 9,792 KiB against the plain region's 7,360, where it grew in place at the top.
    events = [("a", 0), ("a", 1), ("f", 1), ("f", 0), ("a", 2), ("a", 3), ("f", 2), ("f", 3),
              ("a", 4), ("a", 5), ("f", 4), ("f", 5)]
    sizes = [977, 14508, 3854954, 2447677, 1144784, 105645]
    grown = sizes[:3] + [3671515] + sizes[4:]
    entries = [sizes] * 12 + [grown] * 12
    assert scripted_kib(True, entries, events)[0] <= scripted_kib(False, entries, events)[0] \
        == 7360


def test_a_record_step_barely_past_the_most_maps_what_a_plain_region_does():
    # Trial 32's finding 2: a step 0.1% larger than any before is a record step; the size
    # order put request 2 right above request 0's block, so request 4 (allocated once 0 and 1
    # are freed) found no hole under it: 8,960 KiB against 6,464. In allocation order it
    # takes request 0's and 1's bytes.
    events = [("a", 0), ("a", 1), ("a", 2), ("f", 0), ("a", 3), ("f", 3), ("f", 1), ("a", 4),
              ("f", 2), ("f", 4)]
    kib = [2630, 523, 3243, 901, 3030]
    entries = [[int(n * KIB * scale) for n in kib]
               for scale in [1.0] + [0.8] * 8 + [1.001] + [0.8] * 4]
    assert scripted_kib(True, entries, events)[0] == scripted_kib(False, entries, events)[0] \
        == 6464
