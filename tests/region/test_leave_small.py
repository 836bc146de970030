"""Small requests that leave a plan (Note [Small requests that leave a plan]): a small request
that a planned entry sends online after serving some at their places goes by best fit, not
below a live small block, which the plan may have put among the later requests' places."""

from planned_steps import KIB, scripted_kib

# Trial 35's loop: request 0, request 1 (held into the next entry), request 0 freed, request 2.
EVENTS = [("a", 0), ("a", 1), ("f", 0), ("a", 2), ("f", 2)]


def test_a_small_request_that_grew_past_its_place_leaves_the_next_place_free():
    # Request 1 grows 1.2x for good from entry 10. It missed its place and went below the
    # live 64 KiB request 0, which the plan had put above request 2's place: request 2 found
    # no room and the pool mapped 2.5 MiB more (5,120 KiB against the plain region's 2,688).
    # By best fit it takes the free bytes above the plan's top.
    steps = [[64 * KIB, 3 * KIB, 2560 * KIB]] * 10 + [[64 * KIB, 3686, 2560 * KIB]] * 20
    planned, _ = scripted_kib(True, steps, EVENTS, held=(1,))
    plain, _ = scripted_kib(False, steps, EVENTS, held=(1,))
    assert planned == plain == 2688
