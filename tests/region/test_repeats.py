"""A planned region's exits that repeat the exit before are taken short by its planner
(gpupool.region.repeats): random runs of repeated and changed steps (test_planrepeat_random's
scripts) make the same addresses, stats and counts with the shortcut and without, and after
every exit the planner's state is the same. See Note [Exits that repeat] in docs/design.md."""

import pytest
from hypothesis import HealthCheck, given, settings
from planned_steps import KIB, MIB, entered
from test_planrepeat_random import drive_both, scripts

import gpupool
from gpupool.region import planned, repeats
from gpupool.region.planned import Planner
from gpupool.testing import SimulatedDevice

# The planner's state that an exit reads or writes (its memos and shortcut apart).
STATE = ("_firsts", "_recorded", "_fresh", "_exits", "current", "_transition", "_grown",
         "_relayout", "_entries_on", "_strikes", "_past", "_fell_back")


def state(planner):
    """What the planner holds after an exit, as plain values."""
    out = {name: getattr(planner, name) for name in STATE}
    out["counts"] = {k: v for k, v in planner.counts.items() if not k.endswith("_ms")}
    out["seen"] = [(sig, s.count, s.envelope.tolist(), s.low.tolist(), s.r_max, s.r_min,
                    s.floor) for sig, s in planner._seen.items()]
    out["plans"] = [(sig, p.offsets.tolist(), a.tolist(), base)
                    for sig, (p, a, base) in planner._plans.items()]
    out["later"] = list(planner._later.items())
    out["waits"] = list(planner._waits.items())
    recorded = planner._recorded_steps
    out["recorded"] = (recorded.reads, recorded.repeats, recorded.at_start,
                       [a.tolist() for a in recorded.carried], recorded.kept.tolist())
    return out


def relative(exits):
    """The states of ``Exits.seen`` with their addresses as offsets from the lowest (each
    run has a pool of its own)."""
    addrs = [base for _, _, st in exits for *_, base in st["plans"]] + \
        [p for _, _, st in exits for p in st["recorded"][3][1]] + \
        [e[0] for _, _, st in exits for e in st["recorded"][4] if e[0]]
    origin = min(addrs, default=0)
    out = []
    for action, bounds, st in exits:
        st = dict(st)
        st["plans"] = [(*rest, base - origin) for *rest, base in st["plans"]]
        reads, repeats, at_start, (k, ptr, nbytes), events = st["recorded"]
        st["recorded"] = (reads, repeats, at_start, [k, [p - origin for p in ptr], nbytes],
                          [[e[0] - origin if e[0] else 0, *e[1:]] for e in events])
        out.append((action, bounds, st))
    return out


class Exits:
    """Planner.exited spied on: after each exit its action, the bounds the core is given and
    the planner's state; and the exits taken short."""

    def __init__(self, monkeypatch):
        self.seen, self.short = [], 0
        exited, repeated = Planner.exited, repeats.Repeats._repeated

        def spied(planner, *args, **kwargs):
            action = exited(planner, *args, **kwargs)
            self.seen.append((action, planner.bounds(), state(planner)))
            return action

        def counted(planner, *args):
            self.short += 1
            return repeated(planner, *args)

        monkeypatch.setattr(Planner, "exited", spied)
        monkeypatch.setattr(repeats.Repeats, "_repeated", counted)


def both(script, monkeypatch):
    """The script driven with the shortcut and without: (run, exits) each."""
    (fast_run, fast), (slow_run, slow) = drive_both(
        script, monkeypatch, Exits,
        lambda m: m.setattr(repeats.Repeats, "_repeats", lambda *args: None))
    assert slow.short == 0
    return (fast_run, fast), (slow_run, slow)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(scripts())
def test_exits_taken_short_change_nothing(monkeypatch, script):
    (fast_run, fast), (slow_run, slow) = both(script, monkeypatch)
    assert fast_run == slow_run, script
    for i, (f, s) in enumerate(zip(relative(fast.seen), relative(slow.seen), strict=True)):
        assert f == s, (i, script)


def test_a_loop_that_repeats_takes_its_exits_short(monkeypatch):
    (fast_run, fast), (slow_run, _) = both(
        {"entries": [("s", False, False)] * 14 + [("t", False, False)] * 6 +
         [("s", False, False)] * 8, "raises": set()}, monkeypatch)
    assert fast_run == slow_run
    assert fast.short >= 12


def test_a_change_between_exits_ends_the_shortcut():
    # A plan dropped (release: Planner.clear) between two exits of the same inputs: the
    # next exit is made whole, and asks for a plan again.
    pool = gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 32, virtual_memory=True))
    region = gpupool.Region(pool=pool, plan=True, collect=None)

    def entry():
        entered(region, pool, (MIB, 512 * KIB, 2 * MIB))

    for _ in range(12):
        entry()
    planner = region.planner
    assert planner._repeat is not None and planner.current is not None
    installs = planner.counts["installs"]
    region.release()
    assert planner._repeat is None and planner.current is None
    entry()
    assert region.planner.counts["installs"] == installs + 1 and planner.current is not None
    assert planner.bounds()[:2] == (planner.record_over(), planner.first_under())


# A step of two requests and their frees, fed to a planner as the core hands its entries'
# events over: the rows of the first, then None while the entries repeat.
STEP = [(0, 0, 0), (1 << 20, 4096, 0), (2 << 20, 8192, 0), (1 << 20, 0, 0), (2 << 20, 0, 0)]


class _NoShortcut(Planner):
    """A Planner that takes no exit short."""

    def _repeats(self, *args):
        return None


def fed(exits, shortcut=True):
    """A Planner's action, bounds and state after each of ``exits``: (hits, misses, grew,
    stopped, first) of an entry of STEP each, or "record" (the entry's request 0 makes a
    record step's plan: Planner.record); a plan asked for is placed at once. Without
    ``shortcut``, no exit is taken short."""
    planner = Planner() if shortcut else _NoShortcut()
    out = []
    for i, entry in enumerate(exits):
        if entry == "record":
            out.append(planner.record_plan(8192, 1 << 30, [], None) is not None)
            continue
        hits, misses, grew, stopped, first = entry
        action = planner.exited(STEP if i == 0 else None, hits, misses, grew, stopped, first)
        if action == "layout":
            planner.place(base=1 << 30, span=1 << 30, obstacles=[])
        out.append((action, planner.bounds(), state(planner)))
    return out, planner


@pytest.mark.parametrize("exits", [
    # Request 0's bytes that vary within one size class (the events the same).
    [(2, 0, False, False, 4000)] * 6 + [(2, 0, False, False, 4090)] * 4 +
    [(2, 0, False, False, 3000)] * 3,
    # The pool grown by the plan's first entry (not bad) and its second (bad), twice.
    [(0, 0, False, False, 4096)] * 3 + [(2, 0, True, False, 4096)] * 8,
    # Entries that miss: the plan given up, planned again GIVE_UP_EXITS exits later.
    [(0, 0, False, False, 4096)] * 4 + [(0, 2, False, False, 4096)] * 3 +
    [(0, 0, False, False, 4096)] * (planned.GIVE_UP_EXITS + 6),
    # A record step's plan made in an entry (the core's events alike, as fed here).
    [(2, 0, False, False, 4096)] * 4 + [(2, 0, False, False, 2048)] * 5 + ["record"] +
    [(2, 0, False, False, 2048)] * 6,
], ids=["first", "grew", "given-up", "record"])
def test_a_planner_fed_by_hand_decides_the_same_with_and_without_the_shortcut(exits):
    fast, planner = fed(exits)
    slow, _ = fed(exits, shortcut=False)
    assert fast == slow
    assert planner.counts["installs"] >= 1
