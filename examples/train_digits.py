"""Train a small MLP on scikit-learn's digits with CuPy (or NumPy without a GPU), every
allocation served by gpupool.

What it shows
-------------
A Python autograd engine leaves each training step's temporaries in reference cycles: every result
node keeps a ``_backward`` closure that refers back to the node. Reference counting cannot free
them, so they wait for Python's cyclic collector, and the device memory they hold waits with them.
Under a plain caching pool the memory reserved from the GPU climbs between collections; a
``gc.collect()`` every step keeps it flat, but costs far more than the step itself.

This script trains a two-layer MLP (64 -> 128 -> 10) on the 8x8 handwritten digits that ship inside
scikit-learn (nothing is downloaded), with gradients from the small reverse-mode autograd in
``examples/_autograd.py`` (beside this script), and serves CuPy's allocations in one of three ways:

``region``
    gpupool, each training step inside ``with region:``. A block freed during the step goes back
    to the region at once; at exit the region runs a young collection when buffers of the step are
    still alive (here they are, in the cycles) and keeps the blocks for the next step. Reserved
    memory after the first epoch and after the last must be equal.
``no-region``
    gpupool as a plain caching pool; the cycles are left to Python's default collector.
``cupy``
    CuPy's own ``MemoryPool`` with the default collector, for reference.

Each epoch prints the mean loss, the test accuracy and the pool's report; the region mode then
prints its counters, with the peak bytes in use by one step's buffers; the end prints a table of
test accuracy, the peak bytes in use over the whole run (the model and the data included), bytes
reserved after the first and the last epoch, and the median time of a step. ``--plot PATH``
draws the bytes reserved and in use after every step, per mode; ``--snapshot PATH`` records
each gpupool mode's memory history and writes its memory snapshot in PyTorch's format
(``gpupool.dump_snapshot``; open it at https://pytorch.org/memory_viz).

Without a GPU
-------------
Without a CUDA driver, a device or CuPy, the same MLP trains with NumPy, on the same data with
the same autograd, and every array's memory (parameters, data, each step's temporaries) is a
``DeviceBuffer`` of a gpupool ``Pool`` on ``gpupool.testing.SimulatedDevice``: host memory,
served to NumPy through its memory handler (``examples/_numpy_pool.py``). The first line says
so; the ``region`` and ``no-region`` modes run, with the same per-epoch lines, table and checks.

Running it
----------
Everywhere it needs scikit-learn, for the data set (``pip install 'gpupool[examples]'``); on a GPU
CuPy too (``pip install 'gpupool[examples,cupy]'``); ``--plot`` needs matplotlib::

    python examples/train_digits.py                        # every mode, 30 epochs each
    python examples/train_digits.py --mode region --quiet  # one mode, only the summary
    python examples/train_digits.py --device simulated     # NumPy on the simulated device
    python examples/train_digits.py --plot memory.png      # bytes reserved and in use per step
    python examples/train_digits.py --snapshot digits.pickle  # digits-region.pickle, ...

``--device auto`` (the default) takes the GPU when there is one, else the simulated device;
``--device gpu`` insists on the GPU.

Exit status: 0 when every check passed; 1 when a mode's test accuracy is below 0.95 or the region
mode's reserved memory was not flat; 2 when something the run needs is missing: a GPU or CuPy
with ``--device gpu`` (or for the ``cupy`` mode), scikit-learn, gpupool, matplotlib for
``--plot``.
"""

import gc
import os
import statistics
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass

import _digits
import _gpu
import _numpy_pool
import _plot
import numpy as np
from _digits import SetupError, load_data, mib, one_line
from _autograd import MLP, Tensor, mean, sgd_update, softmax_cross_entropy

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
DEVICES = ("auto", "gpu", "simulated")
SIMULATED_CAPACITY = 1 << 30  # bytes of host memory the simulated device holds
SNAPSHOT_ENTRIES = 20_000  # --snapshot: the last events kept (about 2 MB of pickle)
PROG = "train_digits"
UPSTREAM_VARIABLE = "GPUPOOL_UPSTREAM"  # the GPU pools' upstream; the simulated device is its own


# --- where the arrays live -----------------------------------------------------------------------


class Gpu:
    """CuPy arrays on the current CUDA device; SetupError when CuPy or a GPU is missing."""

    name = "GPU"
    modes = MODES

    def __init__(self):
        self.device = require_gpu()
        self.xp = cp

    def new_pool(self, gpupool):
        try:
            return gpupool.Pool(device=self.device)
        except gpupool.NoDeviceError as exc:
            raise SetupError(one_line(exc)) from None

    def serving(self, gpupool, pool):
        """A context in which CuPy allocates from ``pool``."""
        return cp.cuda.using_allocator(gpupool.cupy.allocator(pool))

    def asarray(self, host_array):
        return cp.asarray(host_array)

    def synchronize(self):
        cp.cuda.get_current_stream().synchronize()


class Simulated:
    """NumPy arrays in host memory from a pool on ``gpupool.testing.SimulatedDevice``."""

    name = "simulated device"
    modes = ("region", "no-region")
    xp = np

    def new_pool(self, gpupool):
        return gpupool.Pool(upstream=gpupool.testing.SimulatedDevice(SIMULATED_CAPACITY))

    def serving(self, gpupool, pool):
        """A context in which NumPy allocates from ``pool``."""
        return _numpy_pool.using_pool(pool)

    def asarray(self, host_array):
        return np.array(host_array)  # a copy, made in the pool's memory

    def synchronize(self):
        pass  # NumPy has finished when it returns


def choose_device(device, mode):
    """The Gpu or Simulated back end for ``--device`` and ``--mode``; says so in one line when
    it is simulated.

    ``auto`` takes the GPU when CuPy and a GPU are there; ``gpu``, and a mode that only runs on
    the GPU (``cupy``), raise SetupError otherwise, before anything is printed.
    """
    gpu_only = mode != "all" and mode not in Simulated.modes
    others = f"--mode is one of {', '.join(Simulated.modes)} or all"
    if gpu_only and device == "simulated":
        raise SetupError(f"the {mode} mode needs a GPU and CuPy; on the simulated device "
                         f"{others}")
    reason = "as asked (--device simulated)"
    if device != "simulated":
        try:
            return Gpu()
        except SetupError as exc:
            reason = str(exc)
            if gpu_only:
                raise SetupError(f"the {mode} mode needs a GPU and CuPy: {reason}; without "
                                 f"them {others} (gpupool's simulated device)") from exc
            if device == "gpu":
                raise SetupError(f"--device gpu needs an NVIDIA GPU and CuPy, but {reason}; run "
                                 "with --device auto or --device simulated to train on "
                                 "gpupool's simulated device instead") from exc
            reason = f"because {reason}"
    print(f"{PROG}: training with NumPy on gpupool's simulated device (host memory), {reason}",
          flush=True)
    if os.environ.get(UPSTREAM_VARIABLE):
        print(f"{PROG}: {UPSTREAM_VARIABLE}={os.environ[UPSTREAM_VARIABLE]!r} is ignored: the "
              f"simulated device is the pool's upstream", flush=True)
    return Simulated()


# --- memory back ends ----------------------------------------------------------------------------


class Memory:
    """What every back end records: bytes in use and reserved after every step."""

    peak_sampled = False

    def __init__(self):
        self.trace = []  # (in use, reserved) bytes after each step

    def after_step(self):
        self.trace.append((self.in_use_bytes(), self.reserved_bytes()))


class GpupoolMemory(Memory):
    """A fresh gpupool Pool serving the array library; with use_region, one Region entered around
    every step."""

    def __init__(self, gpupool, backend, use_region):
        super().__init__()
        self.name = "region" if use_region else "no-region"
        self._gpupool = gpupool
        self._backend = backend
        self.pool = backend.new_pool(gpupool)
        self.region = gpupool.Region(pool=self.pool) if use_region else None
        self.step_scope = self.region if use_region else nullcontext()

    def allocating(self):
        return self._backend.serving(self._gpupool, self.pool)

    def in_use_bytes(self):
        return self.pool.stats().in_use_bytes

    def reserved_bytes(self):
        return self.pool.stats().reserved_bytes

    def peak_in_use_bytes(self):
        return self.pool.stats().peak_in_use_bytes

    def print_status(self):
        self._gpupool.pool_status(pool=self.pool)

    def record_history(self):
        self._gpupool.record_memory_history(max_entries=SNAPSHOT_ENTRIES)

    def dump_snapshot(self, path):
        """Write the pool's memory snapshot (PyTorch's format) and stop recording."""
        self._gpupool.dump_snapshot(path, self.pool)
        self._gpupool.record_memory_history(None)

    def print_summary(self):
        if self.region is None:
            return
        s = self.region.stats()
        print(
            f"Region: {s.entries} entries, {s.cache_hits} cache hits, {s.cache_misses} cache"
            f" misses, {mib(s.cached_bytes)} MiB cached, {mib(s.live_at_exit_bytes)} MiB live"
            f" at exit, peak in use by a step's buffers {mib(s.peak_in_use_bytes)} MiB"
        )

    def close(self):
        # The measured run is over: collect what no-region left in cycles, so that trim() can
        # give everything back and the next mode starts on an empty device.
        gc.collect()
        if self.region is not None:
            self.region.release()
        self.pool.trim()


class CupyMemory(Memory):
    """CuPy's own MemoryPool; its peak in use is sampled after every step (a lower bound)."""

    name = "cupy"
    peak_sampled = True

    def __init__(self):
        super().__init__()
        self.pool = cp.cuda.MemoryPool()
        self.step_scope = nullcontext()

    def allocating(self):
        return cp.cuda.using_allocator(self.pool.malloc)

    def in_use_bytes(self):
        return self.pool.used_bytes()

    def reserved_bytes(self):
        return self.pool.total_bytes()

    def peak_in_use_bytes(self):
        return max((in_use for in_use, _ in self.trace), default=0)

    def print_status(self):
        used, total = self.pool.used_bytes(), self.pool.total_bytes()
        print(f"CuPy memory pool usage: {mib(used)} MiB ({mib(total)} MiB reserved)")

    def print_summary(self):
        pass

    def close(self):
        gc.collect()
        self.pool.free_all_blocks()


def require_gpu():
    """The current CUDA device's id; SetupError when CuPy or a GPU is missing (the GPU named
    first)."""
    if cp is None:
        exc = CUPY_IMPORT_ERROR
        if isinstance(exc, ModuleNotFoundError) and exc.name == "cupy":
            library = "CuPy is not installed (pip install 'gpupool[cupy]')"
        else:
            library = f"CuPy cannot be imported: {one_line(exc)}"
        raise SetupError(_gpu.missing(library))
    try:
        count, error = cp.cuda.runtime.getDeviceCount(), "the CUDA runtime reports 0 devices"
    except Exception as exc:
        count, error = 0, one_line(exc)
    if count == 0:
        raise SetupError(_gpu.missing() or f"CuPy finds no CUDA GPU: {error}")
    return cp.cuda.Device().id


def make_memory(mode, backend):
    if mode == "cupy":
        return CupyMemory()
    try:
        import gpupool.cupy  # the CuPy adapter is a submodule; this binds `gpupool` too
    except ImportError as exc:
        raise SetupError(f"gpupool cannot be imported: {one_line(exc)}") from None
    return GpupoolMemory(gpupool, backend, use_region=mode == "region")


# --- training ------------------------------------------------------------------------------------


@dataclass
class RunResult(_digits.Run):
    peak_in_use_bytes: int
    peak_sampled: bool
    trace: list  # (in use, reserved) bytes after each step


def train_step(model, x, y, batch, lr, backend):
    """Forward, backward and update on the rows ``batch`` (host indices); the loss as a float.

    On return nothing of the step is referenced from outside: its graph is cyclic garbage.
    """
    rows = backend.asarray(batch)
    loss = mean(softmax_cross_entropy(model(Tensor(x[rows])), y[rows]))
    # Every gradient of the step stays in its graph, waiting in the cycles with the activations.
    loss.backward(keep_grads=True)
    sgd_update(model.parameters(), lr)
    return float(loss.data)


def train_epoch(model, x, y, args, rng, memory, backend):
    """One shuffled pass over (x, y); the loss and the wall time (seconds) of every step."""
    order = rng.permutation(x.shape[0])
    losses, times = [], []
    for start in range(0, len(order), args.batch_size):
        began = time.perf_counter()
        with memory.step_scope:
            batch = order[start : start + args.batch_size]
            losses.append(train_step(model, x, y, batch, args.lr, backend))
        backend.synchronize()
        times.append(time.perf_counter() - began)
        memory.after_step()
    return losses, times


def evaluate(model, x, y):
    return float((model.predict(x) == y).mean())


def train(memory, data, args, backend):
    """Train a fresh model with memory serving every allocation; the run's measurements."""
    rng = np.random.RandomState(args.seed)
    step_times, reserved = [], []
    with memory.allocating():
        model = MLP((data.x_train.shape[1], args.hidden, _digits.N_CLASSES), rng, backend.xp)
        x_train, y_train = backend.asarray(data.x_train), backend.asarray(data.y_train)
        x_test, y_test = backend.asarray(data.x_test), backend.asarray(data.y_test)
        for epoch in range(1, args.epochs + 1):
            losses, times = train_epoch(model, x_train, y_train, args, rng, memory, backend)
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
        trace=memory.trace,
    )


def run_mode(mode, backend, data, args, snapshot=None):
    """Train one mode; ``snapshot``: where to write its memory snapshot (gpupool modes)."""
    memory = make_memory(mode, backend)
    snapshot = snapshot if isinstance(memory, GpupoolMemory) else None
    if snapshot:
        memory.record_history()
    print(f"== {mode}: {MODE_TITLES[mode]} ==")
    result = train(memory, data, args, backend)
    memory.print_summary()
    if snapshot:
        memory.dump_snapshot(snapshot)
        print(f"Memory snapshot for PyTorch's visualizer (https://pytorch.org/memory_viz):"
              f" {snapshot}")
    memory.close()
    return result


def snapshot_path(path, mode, several):
    """Where --snapshot writes a mode's snapshot: path, with the mode before its extension
    when several modes run."""
    if not several:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}-{mode}{ext or '.pickle'}"


# --- report --------------------------------------------------------------------------------------


def print_table(results, epochs):
    def peak(r):
        return mib(r.peak_in_use_bytes) + ("*" if r.peak_sampled else " ")  # digits stay aligned

    _digits.print_summary(epochs, results, [
        ("peak in use, whole run (MiB)", peak),
        ("reserved after epoch 1 (MiB)", lambda r: mib(r.reserved_first_epoch)),
        (f"reserved after epoch {epochs} (MiB)", lambda r: mib(r.reserved_last_epoch)),
    ])
    if any(r.peak_sampled for r in results):
        print("* CuPy pool: the largest used_bytes() seen after a step, not a true peak.")


def parse_args(argv):
    p = _digits.parser(
        "Train an MLP on scikit-learn's digits with CuPy on gpupool, or with NumPy on gpupool's"
        " simulated device without a GPU (see the module docstring).",
        MODES,
    )
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="gpu: CuPy on the GPU; simulated: NumPy on gpupool's simulated device;"
                        " auto (default): the GPU when there is one")
    p.add_argument("--plot", metavar="PATH",
                   help="write a plot of the bytes reserved and in use after every step")
    p.add_argument("--snapshot", metavar="PATH",
                   help="record each gpupool mode's memory history and write its memory snapshot"
                        " (PyTorch's format; with several modes, PATH gets the mode's name)")
    return p.parse_args(argv)


def run(args):
    """Train every mode asked for, print the summary; the failed checks."""
    pyplot = _plot.pyplot() if args.plot else None  # missing matplotlib: stop before training
    backend = choose_device(args.device, args.mode)
    modes = backend.modes if args.mode == "all" else (args.mode,)
    data = load_data()
    results = [run_mode(mode, backend, data, args,
                        args.snapshot and snapshot_path(args.snapshot, mode, len(modes) > 1))
               for mode in modes]
    print_table(results, args.epochs)
    if pyplot is not None:
        _plot.save_memory_plot(pyplot, results, args.plot,
                               f"{PROG} on the {backend.name}, {args.epochs} epochs")
        print(f"Plot of the bytes reserved and in use after every step: {args.plot}")
    return [f for r in results for f in _digits.run_failures(r, f"after epoch {args.epochs}")]


def main(argv=None):
    args = parse_args(argv)
    return _digits.exit_status(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
