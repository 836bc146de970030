"""What ``dir()`` of a public module lists: its API, not the names it imports."""


def public_dir(names, api, leave_out=()):
    """The sorted listing for ``dir(module)``.

    Parameters
    ----------
    names : dict
        The module's ``globals()``.
    api : iterable of str
        Its public names (its ``__all__``).
    leave_out : iterable of str
        Names of ``api`` not to list (lazy ones whose lookup would import a framework:
        ``help()`` and ``inspect`` read every name ``dir()`` lists).

    Returns
    -------
    list of str
        ``api`` and the module's dunder attributes, less ``leave_out``.
    """
    dunders = (n for n in names if n.startswith("__") and n.endswith("__"))
    return sorted({*api, *dunders} - set(leave_out))
