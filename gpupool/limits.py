"""Memory limits written as bytes, SI or binary units, or a share of the device's memory."""

import numbers
import os
import re

from gpupool.stats import format_bytes

__all__ = ["parse_limit", "resolve_limits"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_FORMS = (
    "bytes (1073741824), '512MiB', '8GB' (kB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024) "
    "or '50%'"
)
# A sign is read, so that "-1" is refused as a limit that is not positive, as -1 is.
_PATTERN = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*([a-z]*|%)\s*$", re.IGNORECASE)
_VARIABLES = {"hard_limit": "GPUPOOL_HARD_LIMIT", "soft_limit": "GPUPOOL_SOFT_LIMIT"}


def parse_limit(value, device_total, source=None):
    """Bytes for a limit given as an int or a string.

    Parameters
    ----------
    value : int, str or None
        ``1073741824``, ``"512MiB"``, ``"8GB"``, ``"1.5 GiB"`` or ``"50%"``; None for no limit.
    device_total : callable
        Returns the device's total memory in bytes; called only for a percentage.
    source : str, optional
        Where the value came from (``"hard_limit"``, ``"GPUPOOL_HARD_LIMIT"``...): an error's
        message starts with ``source=value``.

    Returns
    -------
    int or None

    Raises
    ------
    ValueError
        A malformed string, a negative or zero limit (``-1`` and ``"-1"`` alike), one of 2**64
        bytes or more, or a percentage outside (0, 100].
    TypeError
        Neither an integer (NumPy's too) nor a string (a bool, a float).
    """
    if value is None:
        return None
    where = "" if source is None else f"{source}={value!r}: "
    if isinstance(value, bool):
        raise TypeError(f"{where}a limit must be an int or a string, got {value!r}")
    if isinstance(value, numbers.Integral):        # NumPy's integers too
        nbytes = int(value)
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if unit != "%" and unit not in _UNITS:
            raise ValueError(f"{where}malformed memory limit {value!r}; accepted forms: {_FORMS}")
        number = float(match.group(1))
        if unit == "%":
            if not 0 < number <= 100:
                raise ValueError(f"{where}a percentage limit must be in (0, 100], got {value!r}")
            nbytes = int(device_total() * number / 100)
        else:
            nbytes = int(number * _UNITS[unit])
    else:
        raise TypeError(f"{where}a limit must be an int or a string, got {type(value).__name__}")
    if nbytes <= 0:
        raise ValueError(f"{where}a memory limit must be positive, got {value!r}")
    if nbytes >= 1 << 64:                       # (a size_t holds it)
        raise ValueError(f"{where}a memory limit must be below 2**64 bytes, got {value!r}")
    return nbytes


def _read(name, value, device_total):
    """``(bytes or 0, source)`` of the limit argument ``name``, or of its variable when the
    argument is None."""
    if value is not None:
        return parse_limit(value, device_total, name), f"{name}={value!r}"
    variable = _VARIABLES[name]
    raw = os.environ.get(variable) or None
    return parse_limit(raw, device_total, variable) or 0, f"{variable}={raw!r}"


def resolve_limits(hard_limit, soft_limit, device_total, smallest=1, unit="block"):
    """``(hard, soft)`` in bytes (0 for none), from the arguments or, where an argument is
    None, from ``GPUPOOL_HARD_LIMIT`` / ``GPUPOOL_SOFT_LIMIT``.

    Parameters
    ----------
    hard_limit, soft_limit : int, str or None
        As :func:`parse_limit`'s ``value``.
    device_total : callable
        As :func:`parse_limit`'s.
    smallest : int
        Bytes of the smallest memory the pool reserves (a ``unit``): a hard limit below it
        could hold nothing.
    unit : str
        What the pool reserves, for the message (``"block"``, ``"page"``).

    Raises
    ------
    ValueError, TypeError
        As :func:`parse_limit`, the message naming the argument or the variable and its
        value; a hard limit below ``smallest``; or a soft limit above the hard limit.
    """
    hard, hard_source = _read("hard_limit", hard_limit, device_total)
    soft, soft_source = _read("soft_limit", soft_limit, device_total)
    if hard and hard < smallest:
        raise ValueError(
            f"{hard_source}: the pool reserves memory in {unit}s of at least "
            f"{format_bytes(smallest)}, so a hard limit of {format_bytes(hard)} could hold "
            f"none: make it at least {smallest} B (an int of bytes, or a string such as "
            f"'512MiB' or '8GB')")
    if hard and soft > hard:
        raise ValueError(
            f"the soft limit {soft_source} ({format_bytes(soft)}) is above the hard limit "
            f"{hard_source} ({format_bytes(hard)}): cached blocks would never be released "
            f"before the hard limit stops growth; lower the soft limit to at most the hard one")
    return hard, soft
