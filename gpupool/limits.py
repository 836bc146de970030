"""Memory limits written as bytes, SI or binary units, or a share of the device's memory."""

import os
import re

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
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*|%)\s*$", re.IGNORECASE)


def parse_limit(value, device_total):
    """Bytes for a limit given as an int or a string.

    Parameters
    ----------
    value : int, str or None
        ``1073741824``, ``"512MiB"``, ``"8GB"``, ``"1.5 GiB"`` or ``"50%"``; None for no limit.
    device_total : callable
        Returns the device's total memory in bytes; called only for a percentage.

    Returns
    -------
    int or None

    Raises
    ------
    ValueError
        A malformed string, a negative or zero limit, or a percentage outside (0, 100].
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"a limit must be an int or a string, got {value!r}")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if unit != "%" and unit not in _UNITS:
            raise ValueError(f"malformed memory limit {value!r}; accepted forms: {_FORMS}")
        number = float(match.group(1))
        if unit == "%":
            if not 0 < number <= 100:
                raise ValueError(f"a percentage limit must be in (0, 100], got {value!r}")
            nbytes = int(device_total() * number / 100)
        else:
            nbytes = int(number * _UNITS[unit])
    else:
        raise TypeError(f"a limit must be an int or a string, got {type(value).__name__}")
    if nbytes <= 0:
        raise ValueError(f"a memory limit must be positive, got {value!r}")
    return nbytes


def resolve_limits(hard_limit, soft_limit, device_total):
    """``(hard, soft)`` in bytes (0 for none), from the arguments or, where an argument is
    None, from ``GPUPOOL_HARD_LIMIT`` / ``GPUPOOL_SOFT_LIMIT``."""
    if hard_limit is None:
        hard_limit = os.environ.get("GPUPOOL_HARD_LIMIT") or None
    if soft_limit is None:
        soft_limit = os.environ.get("GPUPOOL_SOFT_LIMIT") or None
    hard = parse_limit(hard_limit, device_total) or 0
    soft = parse_limit(soft_limit, device_total) or 0
    return hard, soft
