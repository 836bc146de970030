"""Train the MLP of train_digits.py in PyTorch, every CUDA allocation served by gpupool.

What it shows
-------------
``gpupool.torch.use()`` makes gpupool PyTorch's CUDA allocator: every tensor's memory is a
gpupool block, so a ``gpupool.Region`` around a training step hands the step the same blocks
every time. This script trains the two-layer MLP of ``train_digits.py`` (64 -> 128 -> 10, ReLU,
softmax cross entropy, plain SGD) on the 8x8 digits that ship inside scikit-learn, in three
modes, each in a fresh process (``use()`` must come before PyTorch's first CUDA allocation):

``region``
    gpupool through ``use()``, each step inside ``with region:``; the region is made with
    ``scope="process"`` because PyTorch runs backward on a thread of its own.
``no-region``
    gpupool through ``use()``, no region: a plain caching pool.
``torch``
    PyTorch's own caching allocator, for reference.

PyTorch's autograd graph lives in C++ and leaves no reference cycles, unlike the Python tape of
``train_digits.py``: reserved memory should be flat in every mode. What the table shows is that
PyTorch runs unchanged on gpupool: the losses equal those under PyTorch's allocator step for step
(same seed, deterministic algorithms), and the bytes reserved after the first epoch and after
the last are equal.

Each epoch prints the mean loss, the test accuracy and the bytes reserved (gpupool:
``gpupool.torch.memory_stats()``; PyTorch: ``torch.cuda.memory_reserved()``); the end prints a
table: test accuracy, the last step's loss, the largest difference from the ``torch`` mode's
loss at the same step, bytes reserved after the first step, after the first epoch and after
the last, and the median time of a step.

Running it
----------
It needs an NVIDIA GPU, a CUDA build of PyTorch and scikit-learn::

    python examples/train_digits_torch.py                        # the three modes, 30 epochs
    python examples/train_digits_torch.py --mode region --quiet  # one mode, only the summary
    python examples/train_digits_torch.py --compile reduce-overhead --cudnn-benchmark

``--compile default`` trains the model through ``torch.compile``, ``--compile reduce-overhead``
through ``torch.compile(mode="reduce-overhead")``, whose CUDA graphs take their memory from
gpupool private pools (``torch.compiler.cudagraph_mark_step_begin()`` starts each step; the
test accuracy is measured on the eager model, which shares the weights);
``--cudnn-benchmark`` sets ``torch.backends.cudnn.benchmark``. Every mode runs with the same
settings, so the losses still compare step for step.

Exit status: 0 when every check passed; 1 when a mode's test accuracy is below 0.95, the region
mode's reserved memory was not flat, or a gpupool mode's loss differs from the ``torch`` mode's
by more than 1e-6; 2 when the GPU, PyTorch, scikit-learn or gpupool is missing.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

# Deterministic cuBLAS (with torch.use_deterministic_algorithms), set before PyTorch starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import _digits  # noqa: E402
import _gpu  # noqa: E402
import numpy as np  # noqa: E402
from _digits import RunFailed, SetupError, load_data, mib, one_line  # noqa: E402

MODES = ("region", "no-region", "torch")
MODE_TITLES = {
    "region": "gpupool.torch.use(), one Region around every step",
    "no-region": "gpupool.torch.use(), no region",
    "torch": "PyTorch's caching allocator",
}
MAX_LOSS_DIFFERENCE = 1e-6
COMPILE_MODES = ("none", "default", "reduce-overhead")
PROG = "train_digits_torch"


@dataclass
class TorchRun(_digits.Run):
    """A mode's measurements, the loss of every step and the bytes reserved after the first."""

    losses: list
    reserved_first_step: int


def require_torch_gpu():
    """Check that PyTorch sees a GPU and that gpupool imports; SetupError otherwise, naming a
    missing GPU first."""
    try:
        import torch
    except ImportError as exc:
        library = f"PyTorch cannot be imported: {one_line(exc)} (pip install 'gpupool[torch]')"
    else:
        built = torch.backends.cuda.is_built()
        library = None if built else f"PyTorch {torch.__version__} was built without CUDA"
    if library is not None or not torch.cuda.is_available():
        missing = _gpu.missing(library) or "torch.cuda.is_available() is False"
        raise SetupError(f"this example needs an NVIDIA GPU and a CUDA build of PyTorch, but "
                         f"{missing}")
    try:
        import gpupool.torch  # noqa: F401
    except ImportError as exc:
        raise SetupError(f"gpupool cannot be imported: {one_line(exc)}") from None


# --- one mode, in a child process ------------------------------------------------------------


def train(mode, args):
    """Train a fresh model in this process with mode's allocator; the run's measurements."""
    import torch

    import gpupool
    import gpupool.torch

    if mode != "torch":
        gpupool.torch.use()                 # before PyTorch's first CUDA allocation
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    data = load_data()
    device = torch.device("cuda", 0)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(data.x_train.shape[1], args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, _digits.N_CLASSES),
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    forward = model if args.compile == "none" else torch.compile(
        model, mode=None if args.compile == "default" else args.compile)
    graphs = args.compile == "reduce-overhead"
    x_train, y_train, x_test, y_test = (
        torch.from_numpy(a).to(device)
        for a in (data.x_train, data.y_train, data.x_test, data.y_test))
    if mode == "torch":
        reserved_bytes = torch.cuda.memory_reserved
        step_scope = nullcontext()
    else:
        def reserved_bytes():
            return gpupool.torch.memory_stats()["reserved_bytes.all.current"]
        step_scope = gpupool.Region(scope="process") if mode == "region" else nullcontext()

    rng = np.random.RandomState(args.seed)
    losses, times, reserved = [], [], {}
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(x_train.shape[0])
        epoch_losses = []
        for start in range(0, len(order), args.batch_size):
            began = time.perf_counter()
            with step_scope:
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                rows = torch.from_numpy(order[start:start + args.batch_size]).to(device)
                loss = torch.nn.functional.cross_entropy(forward(x_train[rows]), y_train[rows])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                epoch_losses.append(loss.item())        # waits for the step's work
                del loss, rows
            times.append(time.perf_counter() - began)
            if "step 1" not in reserved:
                reserved["step 1"] = reserved_bytes()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
        reserved["last epoch"] = reserved_bytes()
        if "epoch 1" not in reserved:
            reserved["epoch 1"] = reserved["last epoch"]
        losses += epoch_losses
        if not args.quiet:
            print(f"{_digits.epoch_line(mode, epoch, epoch_losses, accuracy)}"
                  f"  reserved {mib(reserved['last epoch'])} MiB", flush=True)
    timed = times[len(times) // args.epochs:] if args.epochs >= 2 else times   # epoch 1 warms up
    return TorchRun(mode=mode, accuracy=accuracy, reserved_first_epoch=reserved["epoch 1"],
                    reserved_last_epoch=reserved["last epoch"],
                    ms_per_step=1e3 * statistics.median(timed), losses=losses,
                    reserved_first_step=reserved["step 1"])


def run_child(mode, args):
    """Run one mode in a fresh process; its result. Its per-epoch lines pass through."""
    command = [sys.executable, os.path.abspath(__file__), "--child", mode, "--epochs",
               str(args.epochs), "--batch-size", str(args.batch_size), "--hidden",
               str(args.hidden), "--lr", str(args.lr), "--seed", str(args.seed),
               "--compile", args.compile]
    if args.quiet:
        command.append("--quiet")
    if args.cudnn_benchmark:
        command.append("--cudnn-benchmark")
    print(f"== {mode}: {MODE_TITLES[mode]} ==", flush=True)
    proc = subprocess.run(command, capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    if proc.returncode == 2:
        raise SetupError(proc.stderr.strip().removeprefix(f"{PROG}: "))
    if proc.returncode != 0 or not lines:
        raise RunFailed(f"the {mode} run failed (exit status {proc.returncode}):\n"
                        f"{proc.stderr}")
    for line in lines[:-1]:
        print(line)
    return TorchRun(**json.loads(lines[-1]))


# --- report ------------------------------------------------------------------------------------


def max_loss_difference(result, reference):
    if reference is None or result is reference:
        return None
    return max(abs(a - b) for a, b in zip(result.losses, reference.losses, strict=True))


def print_table(results, reference, epochs):
    def difference(r):
        value = max_loss_difference(r, reference)
        return "-" if value is None else f"{value:.1e}"

    _digits.print_summary(epochs, results, [
        ("last loss", lambda r: f"{r.losses[-1]:.6f}"),
        ("max |loss - torch|", difference),
        ("reserved step 1 (MiB)", lambda r: mib(r.reserved_first_step)),
        ("epoch 1 (MiB)", lambda r: mib(r.reserved_first_epoch)),
        (f"epoch {epochs} (MiB)", lambda r: mib(r.reserved_last_epoch)),
    ], note="reserved after the first step, the first epoch and the last; ")


def failed_checks(results, reference):
    failures = []
    for r in results:
        failures += _digits.run_failures(r, "at the end")
        difference = max_loss_difference(r, reference)
        if difference is not None and difference > MAX_LOSS_DIFFERENCE:
            failures.append(f"{r.mode}: a loss differs from PyTorch's allocator's by"
                            f" {difference:.1e}")
    return failures


def parse_args(argv):
    p = _digits.parser("Train an MLP on scikit-learn's digits in PyTorch on gpupool (see the"
                       " module docstring). It needs an NVIDIA GPU, a CUDA build of PyTorch"
                       " and scikit-learn.", MODES)
    p.add_argument("--compile", choices=COMPILE_MODES, default="none",
                   help="train through torch.compile (reduce-overhead: with CUDA graphs; "
                        "default %(default)s: not compiled)")
    p.add_argument("--cudnn-benchmark", action="store_true",
                   help="torch.backends.cudnn.benchmark = True")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run(args):
    """The child: train args.child, print its result as JSON; no checks. The parent: every mode
    asked for, each in a child, then the summary; the failed checks."""
    require_torch_gpu()
    if args.child:
        print(json.dumps(asdict(train(args.child, args))))
        return []
    load_data()                         # scikit-learn is there: fail early otherwise
    modes = MODES if args.mode == "all" else (args.mode,)
    results = [run_child(mode, args) for mode in modes]
    reference = next((r for r in results if r.mode == "torch"), None)
    print_table(results, reference, args.epochs)
    return failed_checks(results, reference)


def main(argv=None):
    args = parse_args(argv)
    return _digits.exit_status(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
