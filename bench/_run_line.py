"""What ``bench/real_models.py`` prints after a run's memory and ms/step: a planned region's
plans and each step's exit, and where the step's time went (its phases)."""

import statistics
import time


class PhaseClock:
    """The moments a step reaches its phases' ends (``_models.step``'s ``on_phase``: after the
    forward, after the backward), read with :meth:`split` against the step's start and the
    moment its loss was read (which waits for the GPU). Host time: a phase's kernels may still
    run on the GPU when it ends, and the wait for them falls in the last part."""

    def __init__(self, on_phase):
        self._on_phase, self._marks = on_phase, {}

    def __call__(self, name):
        self._marks[name] = time.perf_counter()
        self._on_phase(name)

    def split(self, start, end):
        """[forward, backward, optimizer and the wait for the GPU] of the step, ms; a phase not
        reached (inference has no backward) counts 0."""
        forward = self._marks.get("forward", end)
        backward = self._marks.get("backward", forward)
        self._marks.clear()
        return [(forward - start) * 1e3, (backward - forward) * 1e3, (end - backward) * 1e3]


def planning(record):
    """A planned run's plans and planning time, as the run's line ends with them."""
    region = record.get("region") or {}
    if not region.get("plans"):
        return ""
    exits = record.get("per_step", {}).get("exit_ms") or [0.0]
    return (f", {region['plans']} plans in {region.get('planning_ms', 0.0):.0f} ms, "
            f"{region.get('record_plans', 0)} at request 0 in "
            f"{region.get('record_ms', 0.0):.0f} ms, exits "
            f"{', '.join(f'{x:.0f}' for x in exits)} ms")


def phases(record, steady_from):
    """The run's median forward / backward / rest (optimizer, the wait for the GPU) ms over
    the steps from ``steady_from`` on, and its median CPU time a step (the process's threads,
    ``time.process_time``: host work without the waits), as the run's line ends with them;
    "" where the run has no phases recorded."""
    split = record.get("per_step", {}).get("phase_ms")
    if not split:
        return ""
    steady = split[steady_from:] or split
    cpu = record["per_step"].get("cpu_ms")
    return (", phases " + " / ".join(f"{statistics.median(p[k] for p in steady):.1f}"
                                     for k in range(3)) + " ms"
            + (f", CPU {statistics.median(cpu[steady_from:] or cpu):.1f} ms" if cpu else ""))
