"""What the digits examples share: the data set, the setup error and number formatting."""

from dataclasses import dataclass

import numpy as np

MIB = 1 << 20


class SetupError(Exception):
    """A prerequisite (GPU, array library, scikit-learn, gpupool) is missing: exit status 2."""


def one_line(exc):
    """An exception's message on one line (its type's name when it has none)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def mib(nbytes):
    return f"{nbytes / MIB:.3f}"


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
