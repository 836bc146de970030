"""The options of a planned region's planner (``gpupool.region.planned.Planner``) and
``Region``'s flags, checked: a clear exception naming the option, its value and what it
accepts. Pure Python and NumPy."""

import functools
import inspect
import numbers
import operator

import numpy as np

from gpupool.errors import did_you_mean
from gpupool.region import placement

__all__ = ["check", "option", "option_names", "planner_of"]

_BOOLS = (bool, np.bool_)        # what a flag or a bool option takes: NumPy's bool too


@functools.cache
def option_names(planner):
    """``planner``'s parameters, the keys ``Region(plan={...})`` accepts, in order."""
    return tuple(inspect.signature(planner).parameters)


def planner_of(plan, planner, region_name, **flags):
    """``Region``'s ``plan`` argument made into its planner: ``planner(**plan)`` for a dict,
    ``planner()`` for True, None for False (NumPy's bools too); each of ``flags``
    (``skip_first``, ``debug``, ``trace``) checked a bool (NumPy's too), and ``region_name``
    (its ``name``) a str or None.

    Raises
    ------
    TypeError
        A flag not a bool, the name not a str or None, ``plan`` not a bool or dict, or a key
        of ``plan`` that is not one of ``planner``'s parameters (those accepted named, and
        the closest to a misspelt key).
    """
    for name, value in flags.items():
        if not isinstance(value, _BOOLS):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if region_name is not None and not isinstance(region_name, str):
        raise TypeError(f"name must be a str or None, got {region_name!r}")
    if not isinstance(plan, (*_BOOLS, dict)):
        raise TypeError(f"plan must be a bool or a dict of Planner options, got {plan!r}")
    keys = option_names(planner)
    if isinstance(plan, dict) and not set(plan) <= set(keys):
        unknown = [k for k in plan if k not in keys]
        hint = next(filter(None, (did_you_mean(k, keys) for k in unknown)), "")
        raise TypeError(f"Region(plan=...): unknown option {', '.join(map(repr, unknown))}; "
                        f"the accepted keys are {', '.join(keys)}{hint}")
    return planner(**plan) if isinstance(plan, dict) else planner() if plan else None


_NUMBERS = {
    "max_plans": (numbers.Integral, int, "an integer >= 1", lambda v: v >= 1),
    "max_plan_requests": (numbers.Integral, int, "an integer >= 1", lambda v: v >= 1),
    "budget_work": (numbers.Integral, int, "an integer >= 1", lambda v: v >= 1),
    "budget_ms": (numbers.Real, float, "a number of milliseconds > 0", lambda v: v > 0),
    "min_hit_rate": (numbers.Real, float, "a number from 0 to 1", lambda v: 0 <= v <= 1),
}


def check(name, value):
    """The ``Planner`` option ``name`` (a parameter of its constructor; its docstring says
    what each accepts) checked: ``value`` as the planner keeps it (int, float, bool, or a
    tuple for ``strategies``).

    Raises
    ------
    TypeError
        A value of another type.
    ValueError
        A value out of its range (NaN included), or ``strategies`` empty, naming a strategy
        twice or one not in ``placement.STRATEGIES`` (and the closest one, when one is near).
    """
    if name in _NUMBERS:
        kind, keep, accepted, within = _NUMBERS[name]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise TypeError(f"{name} must be {accepted}, got {value!r}")
        if not within(value):
            raise ValueError(f"{name} must be {accepted}, got {value!r}")
        return keep(value)
    if name != "strategies":
        if not isinstance(value, _BOOLS):
            raise TypeError(f"{name} must be a bool, got {value!r}")
        return bool(value)
    given, strategies = value, tuple(value) if isinstance(value, list) else value
    if not isinstance(strategies, tuple) or not all(isinstance(k, str) for k in strategies):
        raise TypeError(f"strategies must be a tuple (or list) of str, got {given!r}")
    unknown = [k for k in strategies if k not in placement.STRATEGIES]
    twice = sorted({k for k in strategies if strategies.count(k) > 1})
    if not strategies or unknown or twice:
        why = (f": {unknown[0]!r} is not one{did_you_mean(unknown[0], placement.STRATEGIES)}"
               if unknown else
               f": {twice[0]!r} is named twice" if twice else "")
        raise ValueError(f"strategies must be a non-empty tuple (or list) of distinct names "
                         f"among {sorted(placement.STRATEGIES)}, got {given!r}{why}")
    return strategies


def option(name):
    """The ``Planner`` option ``name`` (its constructor's parameter) as a property of its
    planner, checked when assigned as when the planner is made (:func:`check`: a clear
    TypeError or ValueError naming it), so an option changed on a live region's planner
    (``region.planner.min_hit_rate = 0.8``) is as safe as one given to
    ``Region(plan={...})``. Read through ``operator.attrgetter`` (no Python frame: the
    planner reads some at every exit)."""
    slot = "_" + name

    def assign(planner, value):
        setattr(planner, slot, check(name, value))
    return property(operator.attrgetter(slot), assign, doc=f"The planner's {name} option.")
