"""Why a planned region plans: ``tools/profile/long_replay.py``'s replay of a recorded trace (a
region entered at each step start on the expandable simulated device), each plan the planner
makes labelled with its cause and counted per pass.

A plan is one of three kinds, each with a cause:

- *steady*, made by ``Planner.place`` for the signature an exit asked a layout for. The exit's
  trigger: ``new signature`` (seen twice, never installed before), ``switch`` (a signature
  installed before, after another's), ``grown`` (the step asks more than the plan covers,
  ``_grown``), ``relayout`` (the plan served its last entry badly), ``fresh`` (the entry after
  a record step), ``after transition`` (the entry after a transition plan's). Why the kept
  plan did not do: ``none kept`` (never made, or dropped: given up, no room, least recently
  used), ``other base`` (made where the range began elsewhere), ``larger step`` (the step asks
  more than its places), ``obstacles meet it`` (``_meets``: blocks that stay lie in its way).
- *transition*, made by ``place`` after the steady plan: ``install`` (a signature other than
  the one installed), ``grown``, ``fresh``, or ``carried off places`` (the same signature
  again, the last entry's blocks not at the steady plan's places, ``_in_place`` false).
- *record*, at a record step's request 0.
- *repair*, the kept plan of a step that grew, its requests that did not grow pinned
  (``Planner._repaired``), labelled with the steady plan's cause; ``refused`` when it needed
  more bytes than the kept plan and the step was placed whole. Or a transition repaired from
  its steady plan (``Planner._transition_repaired``), labelled with the transition's cause;
  ``refused`` when it fell back or reached above the plan placed whole (placed too).

A layout that makes no plan (the kept plan, the carried blocks at its places) is counted as
``kept, in place``; one whose plan does not fit as ``no room``; a plan not made again because
one was made before from the same inputs (``Planner._placed``) as ``reused, `` and its label.
The last rows: the plans made (not those reused) and their milliseconds (this machine's, one
run), and their work (``placement.Plan.work``, the same on any machine), then the repairs
used. Run from the repository root::

    PYTHONPATH=$PWD python tools/profile/plan_reasons.py TRACE [--passes P]
"""

import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tools", "profile"))

import long_replay  # noqa: E402

from gpupool.region import planned  # noqa: E402


class Reasons:
    """The planner's methods wrapped while installed; ``counts`` a Counter of the labels of
    the plans made (and of the layouts that made none) since the last :meth:`take`."""

    def __init__(self):
        self.counts = collections.Counter()
        self._undo = []
        self._installed = set()     # signatures installed so far
        self._trigger = None        # the last exit's reason to ask for a layout
        self._label = None          # what the plan made now is, for _made
        self._reused = False        # place() reused a plan made before (Planner._placed)
        self._repair = collections.Counter()    # the labels of the last transition's repair

    def take(self):
        """The counts since the last call, and start again."""
        counts, self.counts = self.counts, collections.Counter()
        return counts

    def install(self):
        P = planned.Planner
        for name in ("exited", "place", "_steady", "_transition_plan", "record_plan", "_made",
                     "_placed", "_repaired", "_transition_repaired"):
            original = getattr(P, name, None)
            if original is None:
                continue
            self._undo.append((name, original))
            setattr(P, name, getattr(self, "_" + name.lstrip("_"))(original))

    def remove(self):
        for name, original in reversed(self._undo):
            setattr(planned.Planner, name, original)
        self._undo.clear()

    def _exited(self, original):
        def exited(planner, *args, **kwargs):
            current, transition = planner.current, planner._transition
            action = original(planner, *args, **kwargs)
            if action == "layout":
                sig = planner._wanted[0]
                self._trigger = (
                    ("switch" if sig in self._installed else "new signature")
                    if sig != current else "grown" if planner._grown else
                    "relayout" if planner._relayout else "fresh" if planner._fresh else
                    "after transition" if transition else "other")
            return action
        return exited

    def _place(self, original):
        def place(planner, base, span, obstacles):
            plans, sig, self._reused = planner.counts["plans"], planner._wanted[0], False
            placed = original(planner, base, span, obstacles)
            if placed is None:
                self.counts["no room (" + self._trigger + ")"] += 1
            else:
                self._installed.add(sig)
                if planner.counts["plans"] == plans and not self._reused:
                    self.counts["kept, in place (" + self._trigger + ")"] += 1
            return placed
        return place

    def _steady(self, original):
        def steady(planner, sig, step, base, obstacles, span):
            kept = planner._plans.get(sig)
            why = ("none kept" if kept is None else "other base" if kept[2] != base else
                   "larger step" if (step.nbytes > kept[0].step.nbytes).any() else
                   "obstacles meet it" if planned._meets(kept[0], obstacles) else "")
            self._label = f"steady: {self._trigger}, {why}"
            return original(planner, sig, step, base, obstacles, span)
        return steady

    def _transition_plan(self, original):
        def transition_plan(planner, *args):
            why = ("carried off places" if planner.current == planner._wanted[0] and
                   self._trigger in ("after transition", "relayout", "other") else
                   "install" if self._trigger in ("new signature", "switch") else
                   self._trigger)
            self._label, refused = "transition: " + why, planner.counts["repairs_refused"]
            self._repair = collections.Counter()
            made = original(planner, *args)
            if planner.counts["repairs_refused"] > refused:
                for label, n in self._repair.items():   # the repair's, made or reused
                    self.counts[label] -= n
                    self.counts[label + ", refused"] += n
            return made
        return transition_plan

    def _transition_repaired(self, original):
        def transition_repaired(planner, *args):
            whole, before = self._label, self.counts.copy()
            self._label = "repair (" + whole + ")"
            made = original(planner, *args)
            self._repair, self._label = self.counts - before, whole
            return made
        return transition_repaired

    def _record_plan(self, original):
        def record(planner, *args):
            self._label = "record at request 0"
            return original(planner, *args)
        return record

    def _repaired(self, original):
        def repaired(planner, *args):
            steady, refused = self._label, planner.counts["repairs_refused"]
            self._label, before = "repair (" + steady.removeprefix("steady: ") + ")", \
                self.counts.copy()
            made = original(planner, *args)
            if planner.counts["repairs_refused"] > refused:
                for label in self.counts - before:      # the repair's, made or reused
                    self.counts[label] -= 1
                    self.counts[label + ", refused"] += 1
            self._label = steady
            return made
        return repaired

    def _placed(self, original):
        def placed(planner, *args, **kwargs):
            reused = planner.counts["reused"]
            made = original(planner, *args, **kwargs)
            if planner.counts["reused"] > reused:
                self.counts["reused, " + self._label] += 1
                self._reused = True
            return made
        return placed

    def _made(self, original):
        def made(planner, *args, **kwargs):
            self.counts[self._label] += 1
            return original(planner, *args, **kwargs)
        return made


def reasons(trace, passes):
    """Per pass of the replay: (Counter of the plans' labels, planner stats())."""
    r, out = Reasons(), []
    r.install()
    try:
        for k, _, _, _, stats in long_replay.long_replay(trace, passes, plan=True):
            out.append((r.take(), stats))
    finally:
        r.remove()
    return out


def main(argv=None):
    p = long_replay.trace_options(long_replay.parser(__doc__), passes=3)
    args, trace = long_replay.parse(p, argv)
    rows = reasons(trace, args.passes)
    labels = sorted(set().union(*(c for c, _ in rows)))
    width = max(len(s) for s in labels + ["plans (planning ms)"])
    print(f"{trace.name}: plans by reason, per pass")
    print(f"{'':{width}} " + " ".join(f"{'pass ' + str(k):>8}" for k in range(len(rows)))
          + "    all")
    for label in labels:
        print(f"{label:{width}} " + " ".join(f"{c[label]:8d}" for c, _ in rows)
              + f" {sum(c[label] for c, _ in rows):6d}")
    last = None
    made = []
    for _, stats in rows:
        made.append((stats.plans - (last.plans if last else 0),
                     stats.planning_ms - (last.planning_ms if last else 0.0),
                     (stats.planning_work - (last.planning_work if last else 0)) / 1e6))
        last = stats
    print(f"{'plans (planning ms)':{width}} " + " ".join(f"{n:3d} ({ms:4.0f})" for n, ms, _ in made)
          + f" {last.plans:3d} ({last.planning_ms:.0f})")
    print(f"{'work (M units)':{width}} " + " ".join(f"{w:8.1f}" for _, _, w in made)
          + f" {last.planning_work / 1e6:6.1f}")
    repairs = [s.plans_repaired for _, s in rows]
    print(f"{'repairs used':{width}} " + " ".join(
        f"{b - a:8d}" for a, b in zip([0] + repairs, repairs)) + f" {repairs[-1]:6d}")
    return 0


if __name__ == "__main__":
    long_replay.run(main)
