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

# Deterministic cuBLAS (with torch.use_deterministic_algorithms), set before PyTorch starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
from _digits import SetupError, load_data, mib, one_line  # noqa: E402

MODES = ("region", "no-region", "torch")
MODE_TITLES = {
    "region": "gpupool.torch.use(), one Region around every step",
    "no-region": "gpupool.torch.use(), no region",
    "torch": "PyTorch's caching allocator",
}
MIN_ACCURACY = 0.95
MAX_LOSS_DIFFERENCE = 1e-6
N_CLASSES = 10
PROG = "train_digits_torch"


class RunFailed(Exception):
    """A mode's child process failed for another reason than a missing prerequisite."""


def require_torch_gpu():
    """Check that PyTorch sees a GPU and that gpupool imports; SetupError otherwise."""
    try:
        import torch
    except ImportError as exc:
        raise SetupError(f"PyTorch cannot be imported: {one_line(exc)} (pip install torch on a"
                         " machine with an NVIDIA GPU)") from None
    if not torch.backends.cuda.is_built():
        raise SetupError(f"PyTorch {torch.__version__} was built without CUDA")
    if not torch.cuda.is_available():
        raise SetupError("no CUDA GPU found: torch.cuda.is_available() is False")
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
    data = load_data()
    device = torch.device("cuda", 0)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(data.x_train.shape[1], args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, N_CLASSES),
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
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
                rows = torch.from_numpy(order[start:start + args.batch_size]).to(device)
                loss = torch.nn.functional.cross_entropy(model(x_train[rows]), y_train[rows])
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
            print(f"[{mode}] epoch {epoch:3d}  loss {statistics.fmean(epoch_losses):.4f}  test"
                  f" accuracy {accuracy:.4f}  reserved {mib(reserved['last epoch'])} MiB",
                  flush=True)
    timed = times[len(times) // args.epochs:] if args.epochs >= 2 else times   # epoch 1 warms up
    return {"mode": mode, "accuracy": accuracy, "losses": losses, "reserved": reserved,
            "ms_per_step": 1e3 * statistics.median(timed)}


def run_child(mode, args):
    """Run one mode in a fresh process; its result. Its per-epoch lines pass through."""
    command = [sys.executable, os.path.abspath(__file__), "--child", mode, "--epochs",
               str(args.epochs), "--batch-size", str(args.batch_size), "--hidden",
               str(args.hidden), "--lr", str(args.lr), "--seed", str(args.seed)]
    if args.quiet:
        command.append("--quiet")
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
    return json.loads(lines[-1])


# --- report ------------------------------------------------------------------------------------


def max_loss_difference(result, reference):
    if reference is None or result is reference:
        return None
    return max(abs(a - b) for a, b in zip(result["losses"], reference["losses"], strict=True))


def is_flat(result):
    return result["reserved"]["epoch 1"] == result["reserved"]["last epoch"]


def print_table(results, reference, epochs):
    header = ("mode", "test acc", "last loss", "max |loss - torch|", "reserved step 1 (MiB)",
              "epoch 1 (MiB)", f"epoch {epochs} (MiB)", "flat?", "ms/step")
    rows = []
    for r in results:
        difference = max_loss_difference(r, reference)
        rows.append((r["mode"], f"{r['accuracy']:.4f}", f"{r['losses'][-1]:.6f}",
                     "-" if difference is None else f"{difference:.1e}",
                     mib(r["reserved"]["step 1"]), mib(r["reserved"]["epoch 1"]),
                     mib(r["reserved"]["last epoch"]), "yes" if is_flat(r) else "no",
                     f"{r['ms_per_step']:.3f}"))
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    warm_up = ", epoch 1 excluded" if epochs >= 2 else ""
    print(f"\nSummary ({epochs} epochs; reserved after the first step, the first epoch and the"
          f" last; ms/step is the median time of a step{warm_up})")
    for row in (header, tuple("-" * w for w in widths), *rows):
        cells = [c.rjust(w) for c, w in zip(row, widths, strict=True)]
        print("  ".join([row[0].ljust(widths[0]), *cells[1:]]))


def failed_checks(results, reference):
    failures = []
    for r in results:
        if r["accuracy"] < MIN_ACCURACY:
            failures.append(f"{r['mode']}: test accuracy {r['accuracy']:.4f} is below"
                            f" {MIN_ACCURACY}")
        if r["mode"] == "region" and not is_flat(r):
            failures.append(f"region: reserved memory is not flat ({mib(r['reserved']['epoch 1'])}"
                            f" MiB after epoch 1, {mib(r['reserved']['last epoch'])} MiB at the"
                            f" end)")
        difference = max_loss_difference(r, reference)
        if difference is not None and difference > MAX_LOSS_DIFFERENCE:
            failures.append(f"{r['mode']}: a loss differs from PyTorch's allocator's by"
                            f" {difference:.1e}")
    return failures


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Train an MLP on scikit-learn's digits in PyTorch on gpupool (see the module"
        " docstring).")
    parser.add_argument("--epochs", type=_positive_int, default=30)
    parser.add_argument("--batch-size", type=_positive_int, default=64)
    parser.add_argument("--hidden", type=_positive_int, default=128, help="hidden layer width")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    parser.add_argument("--mode", choices=(*MODES, "all"), default="all")
    parser.add_argument("--quiet", action="store_true", help="no per-epoch lines")
    parser.add_argument("--seed", type=int, default=0, help="weights and shuffling")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        require_torch_gpu()
        if args.child:
            print(json.dumps(train(args.child, args)))
            return 0
        load_data()                         # scikit-learn is there: fail early otherwise
        modes = MODES if args.mode == "all" else (args.mode,)
        results = [run_child(mode, args) for mode in modes]
    except SetupError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    reference = next((r for r in results if r["mode"] == "torch"), None)
    print_table(results, reference, args.epochs)
    failures = failed_checks(results, reference)
    for failure in failures:
        print(f"{PROG}: check failed: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
