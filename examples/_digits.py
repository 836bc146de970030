"""What the digits examples share: the data set, the command line, a run's measurements, the
summary table, the checks and the exit status."""

import argparse
import statistics
import sys
from dataclasses import dataclass

import numpy as np

MIB = 1 << 20
MIN_ACCURACY = 0.95
N_CLASSES = 10


class SetupError(Exception):
    """A prerequisite (GPU, array library, scikit-learn, gpupool, matplotlib for a plot) is
    missing: exit status 2."""


class RunFailed(Exception):
    """A run failed for another reason than a missing prerequisite: exit status 1."""


def one_line(exc):
    """An exception's message on one line (its type's name when it has none)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def mib(nbytes):
    return f"{nbytes / MIB:.3f}"


# --- data ----------------------------------------------------------------------------------------


@dataclass
class Digits:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_data():
    """The digits, split 75/25 (stratified), standardised with the training split's statistics."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise SetupError(
            "scikit-learn is needed for the digits data set: pip install scikit-learn"
        ) from None
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=0, stratify=y
    )
    centre, scale = x_train.mean(axis=0), x_train.std(axis=0)
    scale[scale == 0] = 1.0  # some border pixels are 0 in every training image
    return Digits(
        ((x_train - centre) / scale).astype(np.float32),
        y_train.astype(np.int64),
        ((x_test - centre) / scale).astype(np.float32),
        y_test.astype(np.int64),
    )


# --- command line --------------------------------------------------------------------------------


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parser(description, modes):
    """The options both examples take; ``--mode`` is one of ``modes`` or ``all``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--epochs", type=_positive_int, default=30,
                   help="epochs per mode (default %(default)s; with fewer the test accuracy"
                        " may miss the 0.95 check)")
    p.add_argument("--batch-size", type=_positive_int, default=64,
                   help="training examples per step (default %(default)s)")
    p.add_argument("--hidden", type=_positive_int, default=128,
                   help="hidden layer width (default %(default)s)")
    p.add_argument("--lr", type=float, default=0.1,
                   help="SGD learning rate (default %(default)s)")
    p.add_argument("--mode", choices=(*modes, "all"), default="all",
                   help="how memory is served (the module docstring says each); all"
                        " (default): every mode the device runs, one after another")
    p.add_argument("--quiet", action="store_true", help="no per-epoch lines")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the weights and the shuffling (default %(default)s)")
    return p


# --- a run and its report ------------------------------------------------------------------------


@dataclass
class Run:
    """One mode's measurements (bytes reserved from the GPU after the first and last epoch)."""

    mode: str
    accuracy: float
    reserved_first_epoch: int
    reserved_last_epoch: int
    ms_per_step: float

    @property
    def flat(self):
        return self.reserved_first_epoch == self.reserved_last_epoch


def epoch_line(mode, epoch, losses, accuracy):
    """The per-epoch line: the mode, the epoch, its mean loss and the test accuracy."""
    return (f"[{mode}] epoch {epoch:3d}  loss {statistics.fmean(losses):.4f}"
            f"  test accuracy {accuracy:.4f}")


def print_summary(epochs, results, columns, note=""):
    """Print the summary table of ``results`` (each a :class:`Run`), one row a mode.

    ``columns`` are ``(header, cell)`` pairs, ``cell(result)`` -> str, shown between the test
    accuracy and the ``flat?`` column; ``note`` goes in the title, before the ms/step note.
    """
    header = ("mode", "test acc", *(h for h, _ in columns), "flat?", "ms/step")
    rows = [(r.mode, f"{r.accuracy:.4f}", *(cell(r) for _, cell in columns),
             "yes" if r.flat else "no", f"{r.ms_per_step:.3f}") for r in results]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    warm_up = ", epoch 1 excluded" if epochs >= 2 else ""
    print(f"\nSummary ({epochs} epochs; {note}ms/step is the median time of a step{warm_up})")
    for row in (header, tuple("-" * w for w in widths), *rows):
        cells = [c.rjust(w) for c, w in zip(row, widths, strict=True)]
        print("  ".join([row[0].ljust(widths[0]), *cells[1:]]))


def run_failures(result, last):
    """The checks every mode passes: test accuracy >= MIN_ACCURACY, and in the region mode
    the same bytes reserved after the first epoch and ``last`` (words: "at the end")."""
    failures = []
    if result.accuracy < MIN_ACCURACY:
        failures.append(f"{result.mode}: test accuracy {result.accuracy:.4f} is below"
                        f" {MIN_ACCURACY}")
    if result.mode == "region" and not result.flat:
        failures.append(f"region: reserved memory is not flat ({mib(result.reserved_first_epoch)}"
                        f" MiB after epoch 1, {mib(result.reserved_last_epoch)} MiB {last})")
    return failures


def exit_status(prog, body):
    """Run an example's ``body()``, which returns its failed checks; the exit status.

    0: no check failed; 1: some did (each printed to stderr as ``PROG: check failed: ...``) or
    :class:`RunFailed` was raised; 2: :class:`SetupError` was raised. An exception's message
    goes to stderr as ``PROG: message``.
    """
    try:
        failures = body()
    except SetupError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    for failure in failures:
        print(f"{prog}: check failed: {failure}", file=sys.stderr)
    return 1 if failures else 0
