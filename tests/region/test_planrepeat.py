"""A step that repeats costs a planned region's exit no step work (gpupool.region.recorded):
the core hands over no events when an exit's are the same as the last exit's (PL_READ), and
once three reads in a row are the same the planner returns the step it made last. What the
planner makes is the same either way: the same plans, addresses and counts as when every exit
makes its step. See Note [Step time of planned regions] in docs/design.md."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from planned_steps import FREES, SIZES, TAILS, Run, scaled, vpool, vsim  # noqa: F401

import gpupool
from gpupool.region import recorded
from gpupool.region.planned import Planner
from gpupool.testing import SimulatedDevice

# Scales of SIZES per entry: runs of repeats, a change of sizes, and back.
SCALES = [1.0] * 8 + [0.7] * 6 + [1.0] * 6 + [0.9, 1.0, 0.9, 1.0] + [1.0] * 5
TIMED = {"planning_ms", "record_ms", "collect_seconds"}


class Reads:
    """Recorded.read spied on: whether each read was given events (False: None, the same as
    the last), and the calls of steps.complete it made."""

    def __init__(self, monkeypatch):
        self.given, self.completed = [], 0
        read, complete = recorded.Recorded.read, recorded._steps.complete

        def spied_read(self_, events):
            self.given.append(events is not None)
            return read(self_, events)

        def spied_complete(events):
            self.completed += 1
            return complete(events)

        monkeypatch.setattr(recorded.Recorded, "read", spied_read)
        monkeypatch.setattr(recorded._steps, "complete", spied_complete)


def run(scales=SCALES):
    """Entries of SIZES scaled, on a pool of their own: each entry's addresses, the region's
    stats (the timed fields left out) and its planner's counts."""
    pool = gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 32, virtual_memory=True))
    r = Run(pool)
    addrs = []
    for scale in scales:
        r.entry(scaled(scale))
        addrs.append(list(r.addrs))
    stats = {k: v for k, v in r.region.stats().as_dict().items() if k not in TIMED}
    counts = {k: v for k, v in r.region.planner.counts.items() if not k.endswith("_ms")}
    r.close()
    return addrs, stats, counts


def test_exits_that_repeat_make_no_step(monkeypatch):
    reads = Reads(monkeypatch)
    addrs, stats, counts = run([1.0] * 16)
    # The plan serves the entries after the first few at the same places (the online way
    # may too): the core compares the events and hands over none once they repeat.
    assert stats["plan_hits"] > 0 and stats["plan_misses"] == 0
    assert addrs[-1] == addrs[-2] == addrs[-8]
    assert reads.given[0] and not any(reads.given[-8:])
    # Three reads in a row the same (two given none): the step is the last one's,
    # steps.complete is not called.
    short = [k >= 1 and not any(reads.given[k - 1:k + 1]) for k in range(len(reads.given))]
    assert sum(short) >= 6
    assert reads.completed == len(reads.given) - sum(short)
    assert counts["exits_repeated"] == stats["exits_repeated"] == sum(short)


def test_the_same_plans_addresses_and_counts_as_making_every_step(monkeypatch):
    reads = Reads(monkeypatch)
    fast = run()
    given, completed = list(reads.given), reads.completed
    assert completed < len(given)       # the runs of repeats took the short way
    monkeypatch.setattr(recorded, "SAME_READS", 10 ** 9)
    slow = run()
    assert reads.completed - completed == len(SCALES)
    assert fast[0] == slow[0]
    assert fast[1]["exits_repeated"] > 0 and slow[1]["exits_repeated"] == 0
    for made in fast, slow:
        del made[1]["exits_repeated"], made[2]["exits_repeated"]
    assert fast[1] == slow[1]
    assert fast[2] == slow[2]


def test_an_exit_whose_planning_raised_hands_over_its_next_events(vpool, monkeypatch):
    # The planner did not take the read it raised in: the next read must carry its events,
    # even when the core finds them the same.
    r = Run(vpool)
    for _ in range(6):
        r.entry(SIZES)
    exited = Planner.exited
    given = []

    def failing(planner, events, *args, **kwargs):
        given.append(events is not None)
        if len(given) == 1:
            raise RuntimeError("planning failed")
        return exited(planner, events, *args, **kwargs)

    monkeypatch.setattr(Planner, "exited", failing)
    try:
        r.entry(SIZES)
    except RuntimeError:
        pass
    else:
        raise AssertionError("the planner's error was not raised")
    r.entry(SIZES)
    r.entry(SIZES)
    assert given == [False, True, False]
    r.close()



def test_an_exit_whose_events_begin_the_last_one_s_is_not_the_same(vpool, monkeypatch):
    # The core matches an entry's events with the last read's as they come (pt_log): an
    # entry whose events are the last's first ones, and one that goes on past the last's,
    # are each handed over, not taken for a repeat.
    reads = Reads(monkeypatch)
    r = Run(vpool)
    for _ in range(8):
        r.entry(SIZES)
    assert not reads.given[-1]
    # The same requests at the same places, but 2 and 4 stay live past the exit (tails):
    # the entry's events end before the last entry's frees of them.
    addrs = r.addrs
    r.entry(SIZES, tails={2, 4, 5})
    assert r.addrs == addrs and reads.given[-1]
    for _ in range(6):
        r.entry(SIZES, tails={2, 4, 5})
    assert not reads.given[-1]
    # The same as those, and then the frees of 2 and 4.
    addrs = r.addrs
    r.entry(SIZES)
    assert r.addrs == addrs and reads.given[-1]
    r.close()

# Recorded on its own: windows of one entry each (a marker, the last entry's tail freed, two
# requests, one of them freed), of three kinds, in any order, with repeats.
P1, P2, P3 = 1 << 20, 8 << 20, 16 << 20
WINDOWS = {
    "a": [[0, 0, 0], [P2, 0, 0], [P1, 1 << 20, 7], [P2, 2 << 20, 7], [P1, 0, 0]],
    "b": [[0, 0, 0], [P2, 0, 0], [P1, 3 << 20, 7], [P2, 2 << 20, 7], [P1, 0, 0]],
    "c": [[P3, 0, 0], [0, 0, 0], [P2, 0, 0], [P3, 1 << 20, 9], [P2, 4 << 20, 7]],
}


def made(read):
    step, sig = read
    if step is None:
        return None
    return ([a.tolist() for a in (step.nbytes, step.alloc, step.free, step.stream)],
            step.length, sig)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(sorted(WINDOWS)), min_size=1, max_size=14).flatmap(
    lambda kinds: st.just(kinds + [kinds[-1]] * 5)))
def test_a_read_of_the_same_events_makes_what_their_reading_makes(kinds):
    short, whole = recorded.Recorded(), recorded.Recorded()
    last = None
    for kind in kinds:
        rows = np.array(WINDOWS[kind], np.int64)
        got = made(short.read(None if kind == last else rows))
        want = made(whole.read(rows))
        assert got == want
        for a, b in zip(short.carried, whole.carried, strict=True):
            assert a.tolist() == b.tolist()
        assert short.at_start == whole.at_start
        last = kind
    assert short.reads == whole.reads == len(kinds)
    assert whole.repeats == 0 and short.repeats >= 4       # the five repeats at the end
