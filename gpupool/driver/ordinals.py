"""Device ordinals, checked before anything calls the driver (``Pool``, ``SimulatedDevice``)."""

import operator

__all__ = ["check_ordinal"]

_ORDINAL_MAX = 2**31 - 1        # CUdevice is a C int


def check_ordinal(device, what="device"):
    """``device`` as an int ordinal, refused before any driver call when impossible.

    Parameters
    ----------
    device : int
        A device ordinal: an int (or any integer with ``__index__``), 0 <= device < 2**31.
    what : str
        The argument's name, for messages.

    Returns
    -------
    int

    Raises
    ------
    TypeError
        A bool, a float, a str or anything else that is not an integer.
    ValueError
        A negative ordinal, or one beyond a C int. (A device that does not exist is found by
        the driver: ``NoDeviceError``.)
    """
    if isinstance(device, bool) or not hasattr(type(device), "__index__"):
        raise TypeError(f"{what} must be an int device ordinal (0, 1, ...), got {device!r}")
    ordinal = operator.index(device)
    if not 0 <= ordinal <= _ORDINAL_MAX:
        raise ValueError(f"{what} must be a non-negative device ordinal, got {ordinal}")
    return ordinal
