"""Train a small MLP on scikit-learn's digits with CuPy, every allocation served by gpupool.

What it shows
-------------
A Python autograd engine leaves each training step's temporaries in reference cycles: every result
node keeps a ``_backward`` closure that refers back to the node. Reference counting cannot free
them, so they wait for Python's cyclic collector, and the device memory they hold waits with them.
Under a plain caching pool the memory reserved from the GPU climbs between collections; a
``gc.collect()`` every step keeps it flat, but costs far more than the step itself.

This script trains a two-layer MLP (64 -> 128 -> 10) on the 8x8 handwritten digits that ship inside
scikit-learn (nothing is downloaded), with gradients from the small reverse-mode autograd in
``examples/autograd.py`` (beside this script), and serves CuPy's allocations in one of three ways:

``region``
    gpupool, each training step inside ``with region:``. A block freed during the step goes back
    to the region at once; at exit the region runs a young collection when buffers of the step are
    still alive (here they are, in the cycles) and keeps the blocks for the next step. Reserved
    memory after the first epoch and after the last must be equal.
``no-region``
    gpupool as a plain caching pool; the cycles are left to Python's default collector.
``cupy``
    CuPy's own ``MemoryPool`` with the default collector, for reference.

Each epoch prints the mean loss, the test accuracy and the pool's report; the end prints a table of
test accuracy, peak bytes in use, bytes reserved after the first and the last epoch, and the median
time of a step.

Running it
----------
It needs an NVIDIA GPU, CuPy and scikit-learn (``pip install 'gpupool[examples]'``)::

    python examples/train_digits.py                        # the three modes, 30 epochs each
    python examples/train_digits.py --mode region --quiet  # one mode, only the summary

Exit status: 0 when every check passed; 1 when a mode's test accuracy is below 0.95 or the region
mode's reserved memory was not flat; 2 when the GPU, CuPy, scikit-learn or gpupool is missing.
"""

import gc
import statistics
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass

import _digits
import numpy as np
from _digits import SetupError, load_data, mib, one_line
from autograd import MLP, Tensor, mean, sgd_update, softmax_cross_entropy

with warnings.catch_warnings():
    # Some CuPy installs warn at import (no CUDA path found); require_gpu() reports what matters.
    warnings.simplefilter("ignore")
    try:
        import cupy as cp
    except Exception as exc:  # not installed, or a CUDA install that CuPy cannot load
        cp = None
        CUPY_IMPORT_ERROR = exc
    else:
        CUPY_IMPORT_ERROR = None

MODES = ("region", "no-region", "cupy")
MODE_TITLES = {
    "region": "gpupool, one Region around every step",
    "no-region": "gpupool, no region (default garbage collection)",
    "cupy": "CuPy MemoryPool (default garbage collection)",
}
PROG = "train_digits"


# --- memory back ends ----------------------------------------------------------------------------


class GpupoolMemory:
    """A fresh gpupool Pool serving CuPy; with use_region, one Region entered around every step."""

    peak_sampled = False

    def __init__(self, gpupool, device, use_region):
        self.name = "region" if use_region else "no-region"
        self._gpupool = gpupool
        try:
            self.pool = gpupool.Pool(device=device)
        except gpupool.NoDeviceError as exc:
            raise SetupError(one_line(exc)) from None
        self.allocator = gpupool.cupy.allocator(self.pool)
        self.region = gpupool.Region(pool=self.pool) if use_region else None
        self.step_scope = self.region if use_region else nullcontext()

    def after_step(self):
        pass

    def reserved_bytes(self):
        return self.pool.stats().reserved_bytes

    def peak_in_use_bytes(self):
        return self.pool.stats().peak_in_use_bytes

    def print_status(self):
        self._gpupool.pool_status(pool=self.pool)

    def print_summary(self):
        if self.region is None:
            return
        s = self.region.stats()
        print(
            f"Region: {s.entries} entries, {s.cache_hits} cache hits, {s.cache_misses} cache"
            f" misses, {mib(s.cached_bytes)} MiB cached, {mib(s.live_at_exit_bytes)} MiB live"
            f" at exit, peak in use {mib(s.peak_in_use_bytes)} MiB"
        )

    def close(self):
        # The measured run is over: collect what no-region left in cycles, so that trim() can
        # give everything back and the next mode starts on an empty device.
        gc.collect()
        if self.region is not None:
            self.region.release()
        self.pool.trim()


class CupyMemory:
    """CuPy's own MemoryPool; its peak in use is sampled after every step (a lower bound)."""

    name = "cupy"
    peak_sampled = True

    def __init__(self):
        self.pool = cp.cuda.MemoryPool()
        self.allocator = self.pool.malloc
        self.step_scope = nullcontext()
        self._peak_used = 0

    def after_step(self):
        self._peak_used = max(self._peak_used, self.pool.used_bytes())

    def reserved_bytes(self):
        return self.pool.total_bytes()

    def peak_in_use_bytes(self):
        return self._peak_used

    def print_status(self):
        used, total = self.pool.used_bytes(), self.pool.total_bytes()
        print(f"CuPy memory pool usage: {mib(used)} MiB ({mib(total)} MiB reserved)")

    def print_summary(self):
        pass

    def close(self):
        gc.collect()
        self.pool.free_all_blocks()


def require_gpu():
    """The current CUDA device's id; SetupError when CuPy or a GPU is missing."""
    if cp is None:
        exc = CUPY_IMPORT_ERROR
        if isinstance(exc, ModuleNotFoundError) and exc.name == "cupy":
            raise SetupError(
                "CuPy is not installed (pip install 'gpupool[examples]' on a machine with an"
                " NVIDIA GPU)"
            )
        raise SetupError(f"CuPy cannot be imported: {one_line(exc)}")
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:
        raise SetupError(f"no CUDA GPU found: {_driver_problem() or one_line(exc)}") from None
    if count == 0:
        raise SetupError("no CUDA GPU found: the CUDA runtime reports 0 devices")
    return cp.cuda.Device().id


def _driver_problem():
    """gpupool's one-line account of a missing driver or device, if that is the problem."""
    try:
        import gpupool

        gpupool.get_pool(0)
    except Exception as exc:
        return one_line(exc)
    return None


def make_memory(mode, device):
    if mode == "cupy":
        return CupyMemory()
    try:
        import gpupool.cupy  # the CuPy adapter is a submodule; this binds `gpupool` too
    except ImportError as exc:
        raise SetupError(f"gpupool cannot be imported: {one_line(exc)}") from None
    return GpupoolMemory(gpupool, device, use_region=mode == "region")


# --- training ------------------------------------------------------------------------------------


@dataclass
class RunResult(_digits.Run):
    peak_in_use_bytes: int
    peak_sampled: bool


def train_step(model, x, y, batch, lr):
    """Forward, backward and update on the rows ``batch`` (host indices); the loss as a float.

    On return nothing of the step is referenced from outside: its graph is cyclic garbage.
    """
    rows = cp.asarray(batch)
    loss = mean(softmax_cross_entropy(model(Tensor(x[rows])), y[rows]))
    # Every gradient of the step stays in its graph, waiting in the cycles with the activations.
    loss.backward(keep_grads=True)
    sgd_update(model.parameters(), lr)
    return float(loss.data)


def train_epoch(model, x, y, args, rng, memory):
    """One shuffled pass over (x, y); the loss and the wall time (seconds) of every step."""
    order = rng.permutation(x.shape[0])
    stream = cp.cuda.get_current_stream()
    losses, times = [], []
    for start in range(0, len(order), args.batch_size):
        began = time.perf_counter()
        with memory.step_scope:
            losses.append(train_step(model, x, y, order[start : start + args.batch_size], args.lr))
        stream.synchronize()
        times.append(time.perf_counter() - began)
        memory.after_step()
    return losses, times


def evaluate(model, x, y):
    return float((model.predict(x) == y).mean())


def train(memory, data, args):
    """Train a fresh model with memory serving every allocation; the run's measurements."""
    rng = np.random.RandomState(args.seed)
    step_times, reserved = [], []
    with cp.cuda.using_allocator(memory.allocator):
        model = MLP((data.x_train.shape[1], args.hidden, _digits.N_CLASSES), rng, cp)
        x_train, y_train = cp.asarray(data.x_train), cp.asarray(data.y_train)
        x_test, y_test = cp.asarray(data.x_test), cp.asarray(data.y_test)
        for epoch in range(1, args.epochs + 1):
            losses, times = train_epoch(model, x_train, y_train, args, rng, memory)
            accuracy = evaluate(model, x_test, y_test)
            reserved.append(memory.reserved_bytes())
            step_times.append(times)
            if not args.quiet:
                print(_digits.epoch_line(memory.name, epoch, losses, accuracy))
                memory.print_status()
    timed = step_times[1:] if len(step_times) >= 2 else step_times  # epoch 1 warms up
    return RunResult(
        mode=memory.name,
        accuracy=accuracy,
        peak_in_use_bytes=memory.peak_in_use_bytes(),
        reserved_first_epoch=reserved[0],
        reserved_last_epoch=reserved[-1],
        ms_per_step=1e3 * statistics.median(t for epoch in timed for t in epoch),
        peak_sampled=memory.peak_sampled,
    )


def run_mode(mode, device, data, args):
    memory = make_memory(mode, device)
    print(f"== {mode}: {MODE_TITLES[mode]} ==")
    result = train(memory, data, args)
    memory.print_summary()
    memory.close()
    return result


# --- report --------------------------------------------------------------------------------------


def print_table(results, epochs):
    def peak(r):
        return mib(r.peak_in_use_bytes) + ("*" if r.peak_sampled else " ")  # digits stay aligned

    _digits.print_summary(epochs, results, [
        ("peak in use (MiB)", peak),
        ("reserved after epoch 1 (MiB)", lambda r: mib(r.reserved_first_epoch)),
        (f"reserved after epoch {epochs} (MiB)", lambda r: mib(r.reserved_last_epoch)),
    ])
    if any(r.peak_sampled for r in results):
        print("* CuPy pool: the largest used_bytes() seen after a step, not a true peak.")


def parse_args(argv):
    return _digits.parser(
        "Train an MLP on scikit-learn's digits with CuPy on gpupool (see the module docstring).",
        MODES,
    ).parse_args(argv)


def run(args):
    """Train every mode asked for, print the summary; the failed checks."""
    modes = MODES if args.mode == "all" else (args.mode,)
    device = require_gpu()
    data = load_data()
    results = [run_mode(mode, device, data, args) for mode in modes]
    print_table(results, args.epochs)
    return [f for r in results for f in _digits.run_failures(r, f"after epoch {args.epochs}")]


def main(argv=None):
    args = parse_args(argv)
    return _digits.exit_status(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
