"""What keeps a GPU example from running, the GPU first: a machine without one says so before
the libraries it lacks, so that nobody installs CuPy or PyTorch there for nothing."""


def no_gpu():
    """Why device 0 cannot be used, in gpupool's words, or None when it can.

    Returns
    -------
    str or None
        ``"there is no GPU (...)"``, the parenthesis holding the first clause of gpupool's
        ``NoDeviceError`` for device 0 (its advice to use the simulated device is left out:
        the examples say what their own command lines offer). None when device 0 answers
        (its default pool is then made: it reserves nothing until used), or when gpupool
        itself cannot be imported (the example says so where it imports gpupool).
    """
    try:
        import gpupool
    except ImportError:
        return None
    try:
        gpupool.get_pool(0)
    except gpupool.NoDeviceError as exc:
        reason = " ".join(str(exc).split()).split("; ")[0].split(". ")[0]
        return f"there is no GPU ({reason})"
    return None


def missing(*libraries):
    """What is missing for an example that needs a GPU and libraries, in one phrase.

    Parameters
    ----------
    *libraries : str or None
        One phrase for each library that is missing, with how to install it (for example
        ``"CuPy is not installed (pip install 'gpupool[cupy]')"``); None for one that is there.

    Returns
    -------
    str or None
        The missing GPU first (:func:`no_gpu`), then each missing library, joined by ``", and
        "``; None when nothing is missing.
    """
    gpu = no_gpu()
    return ", and ".join(phrase for phrase in (gpu, *libraries) if phrase) or None
