"""A planned region driven by random runs of repeated and changed steps (other structures,
larger request 0s that make record steps, an entry without events, a worker thread's request,
tails freed outside the region, a planner that raises before or after taking a read, release())
makes the same addresses, stats and counts with the exit's shortcut (recorded.SAME_READS) on and
off. Written in review."""

import threading

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planned_steps import FREES, SIZES, TAILS, Checked, run_step  # noqa: F401

import gpupool
from gpupool.region import recorded
from gpupool.region.planned import Planner
from gpupool.testing import SimulatedDevice

MIB = 1 << 20
KINDS = {
    "s": (SIZES, FREES, TAILS),
    "t": ([n * 7 // 10 // 512 * 512 for n in SIZES], FREES, TAILS),
    "r": ([2 * SIZES[0]] + SIZES[1:], FREES, TAILS),             # request 0 larger
    "o": ([MIB, 2 * MIB, MIB, 3 * MIB], [None, 0, None, 2], {3}),  # another structure
    "e": ([], [], set()),                                         # an entry without events
    "w": (SIZES, FREES, TAILS),                 # and a worker thread's request in the region
}
TIMED = {"planning_ms", "record_ms", "collect_seconds"}


def drive(script, monkeypatch):
    exited, calls = Planner.exited, [0]

    def maybe_raising(planner, *args, **kwargs):
        i = calls[0]
        calls[0] += 1
        if ("before", i) in script["raises"]:
            raise RuntimeError("before")
        out = exited(planner, *args, **kwargs)
        if ("after", i) in script["raises"]:
            raise RuntimeError("after")
        return out

    monkeypatch.setattr(Planner, "exited", maybe_raising)
    pool = gpupool.Pool(upstream=SimulatedDevice(capacity=1 << 32, virtual_memory=True))
    region = gpupool.Region(pool=pool, collect=None, plan=True)
    mem, out = Checked(pool), []
    for e, (kind, outside, release) in enumerate(script["entries"]):
        sizes, frees, tails = KINDS[kind]
        if outside:
            for key in [k for k in mem.live if k[0] == "tail"]:
                mem.free(key)
        try:
            with region:
                addrs = run_step(mem, sizes, frees, tails, e)
                if kind == "w":
                    def work():
                        with region.enter_in_thread():
                            pool.allocate(MIB).close()
                    t = threading.Thread(target=work)
                    t.start()
                    t.join()
        except RuntimeError:
            addrs = None
        if release:
            region.release()
        s = region.stats().as_dict()
        out.append((addrs, {k: v for k, v in s.items()
                            if k not in TIMED and k != "exits_repeated"},
                    {k: v for k, v in region.planner.counts.items()
                     if not k.endswith("_ms") and k != "exits_repeated"}))
    mem.live.clear()
    monkeypatch.setattr(Planner, "exited", exited)
    base = min(a for addrs, _, _ in out for a in (addrs or [])) if any(
        addrs for addrs, _, _ in out) else 0
    return [([a - base for a in addrs] if addrs is not None else None, s, c)
            for addrs, s, c in out]


runs = st.lists(st.tuples(st.sampled_from(sorted(KINDS)), st.integers(1, 7), st.booleans()),
                min_size=1, max_size=6)


def drive_both(script, monkeypatch, spy, long_way):
    """The script driven twice, spy(m) set up each time: as it is, then with long_way(m) (a
    shortcut or memo replaced by the work it saves). ``((run, spy), (run, spy))``, that order."""
    with monkeypatch.context() as m:
        fast = spy(m)
        fast_run = drive(script, m)
    with monkeypatch.context() as m:
        slow = spy(m)
        long_way(m)
        slow_run = drive(script, m)
    return (fast_run, fast), (slow_run, slow)

@st.composite
def scripts(draw):
    entries = []
    for kind, n, outside in draw(runs):
        entries += [(kind, outside, False)] * n
    entries = [(k, o, draw(st.integers(0, 40)) == 0) for k, o, _ in entries]
    raises = set(draw(st.lists(st.tuples(st.sampled_from(["before", "after"]),
                                         st.integers(0, len(entries))), max_size=3)))
    return {"entries": entries, "raises": raises}


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(scripts())
def test_the_shortcut_changes_nothing(monkeypatch, script):
    fast = drive(script, monkeypatch)
    with monkeypatch.context() as m:
        m.setattr(recorded, "SAME_READS", 10 ** 9)
        slow = drive(script, monkeypatch)
    for i, (f, s) in enumerate(zip(fast, slow, strict=True)):
        assert f == s, (i, script)


def test_the_script_takes_the_shortcut(monkeypatch):
    seen = []
    read = recorded.Recorded.read

    def spied(self, events):
        out = read(self, events)
        seen.append(self.repeats)
        return out

    monkeypatch.setattr(recorded.Recorded, "read", spied)
    drive({"entries": [("s", False, False)] * 12 + [("o", True, False)] * 5, "raises": set()},
          monkeypatch)
    assert seen[-1] >= 5
