"""``--plot`` of the digits examples: the bytes reserved and in use after every step, per mode."""

from _digits import MIB, RunFailed, SetupError, one_line


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display).

    Raises
    ------
    SetupError
        matplotlib is not installed: the example exits 2 before it trains.
    """
    try:
        import matplotlib
    except ImportError:
        raise SetupError(
            "--plot needs matplotlib: pip install matplotlib (or run without --plot)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot

    return matplotlib.pyplot


def save_memory_plot(plt, results, path, title):
    """Write a plot of each result's ``trace`` to ``path`` (its format from the extension).

    Parameters
    ----------
    plt : module
        ``matplotlib.pyplot``, from :func:`pyplot`.
    results : sequence
        One per mode, each with ``mode`` (str) and ``trace``: ``(in use, reserved)`` bytes
        after each step, in order.
    path : str
        The file to write (``.png``, ``.svg``, ``.pdf``, ...).
    title : str

    Raises
    ------
    _digits.RunFailed
        The file cannot be written.
    """
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, result in enumerate(results):
        steps = range(1, len(result.trace) + 1)
        in_use, reserved = zip(*result.trace, strict=True)
        ax.plot(steps, [b / MIB for b in reserved], color=f"C{i}", label=f"{result.mode}: reserved")
        ax.plot(steps, [b / MIB for b in in_use], color=f"C{i}", linestyle="--",
                label=f"{result.mode}: in use")
    ax.set_xlabel("step")
    ax.set_ylabel("MiB after the step")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes, not over lines
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        raise RunFailed(f"cannot write the plot to {path}: {one_line(exc)}") from None
    finally:
        plt.close(fig)
