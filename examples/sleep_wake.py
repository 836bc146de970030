"""A trainer and an inference engine taking turns on one GPU: PyTorch on gpupool, put to sleep
and woken with ``Pool.sleep`` and ``Pool.wake``.

What it shows
-------------
Reinforcement-learning loops keep a trainer and an inference engine on one GPU and swap them.
Under ``gpupool.torch.use()`` every PyTorch tensor is a block of gpupool's pool, and
``with gpupool.tag(name):`` marks the blocks allocated inside it. On a pool of the expandable
upstream (``upstream="vmm"``) ``pool.sleep(tags, offload=...)`` gives the physical memory of a
tag's blocks back to the device, keeping their addresses, and ``pool.wake(tags)`` maps new memory
at the same addresses; tensors stay the same Python objects with the same pointers.

``trainer``
    an MLP (``--width``, ``--layers``) and its Adam optimizer: weights and optimizer state
    under the tag ``"trainer"`` (slept with ``offload=True``: their bytes go to host memory),
    the forward pass and the batches under ``"activations"`` (slept without offload: freed
    by then, only their cached pages are given back).
``engine``
    a larger MLP in inference mode: weights under ``"engine"`` (offloaded), its inputs and
    activations under ``"engine-scratch"`` (discarded).

It trains the trainer ``--steps`` steps without sleeping (the reference), then a fresh trainer of
the same seed half the steps; puts it to sleep; runs the engine in the freed memory; puts the
engine to sleep; wakes the trainer and trains the other half; then wakes the engine once more.
PyTorch runs backward on a thread of its own, which a tag (per thread) does not reach: the
gradients are untagged, so each step ends with ``zero_grad(set_to_none=True)`` and the pool's
untagged cache is trimmed after the sleep. The first matrix product is run before any tag, so that
cuBLAS's workspace, which PyTorch keeps for the process, is untagged too: a workspace allocated
inside a tag would sleep with it while cuBLAS still uses it.

Checks (``[ok]`` or ``[FAIL]``): the device's free memory (``torch.cuda.mem_get_info``, the
driver's ``cuMemGetInfo``) grows by at least 99% of the bytes the sleep released from the pool;
the trainer's tensors keep their addresses and their values bit for bit (compared with host
copies made before the sleep); a tensor allocated with the sleeping tag is refused with an error
naming the tag; the losses equal the reference's step for step, exactly (same seed, same data,
deterministic algorithms and the same kernels on the same shapes: no tolerance is needed); the
engine's output after its wake equals its output before its sleep.

Running it
----------
It needs an NVIDIA GPU with virtual memory management and a CUDA build of PyTorch::

    python examples/sleep_wake.py
    python examples/sleep_wake.py --width 8192 --layers 6 --steps 20

``GPUPOOL_TORCH_ALLOCATOR=pluggable`` runs it on PyTorch's pluggable allocator instead of
gpupool's compiled one (``gpupool.torch.allocator()`` names the one in use).

Exit status: 0 when every check passed, 1 when one failed, 2 when the GPU, PyTorch or gpupool
is missing (one line on stderr).
"""

import argparse
import gc
import os
import sys
import time

# Deterministic cuBLAS (with torch.use_deterministic_algorithms), set before PyTorch starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from _digits import SetupError, exit_status, mib, one_line  # noqa: E402
from train_digits_torch import require_torch_gpu  # noqa: E402

PROG = "sleep_wake"
IN_FEATURES = 1024
BATCH = 512
BATCHES = 4                 # the training set: BATCHES batches, used in turn
ENGINE_TOKENS = 4096        # rows of one inference batch


def mlp(torch, sizes, norm=False):
    """Dense layers of ``sizes`` with a ReLU (and a LayerNorm, for the engine) between them."""
    layers = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [torch.nn.Linear(n_in, n_out), torch.nn.ReLU()]
        if norm:
            layers.append(torch.nn.LayerNorm(n_out))
    return torch.nn.Sequential(*layers[:-2 if norm else -1])


class Trainer:
    """The MLP and its Adam optimizer, built on the CPU from ``seed`` and moved to the GPU under
    the tag ``"trainer"``; the training set is drawn from ``seed`` too."""

    def __init__(self, torch, gpupool, args, device):
        self.torch, self.gpupool, self.device = torch, gpupool, device
        torch.manual_seed(args.seed)
        model = mlp(torch, [IN_FEATURES] + [args.width] * (args.layers - 1) + [IN_FEATURES])
        data = torch.Generator().manual_seed(args.seed + 1)
        self.xs = torch.randn(BATCHES, BATCH, IN_FEATURES, generator=data)
        teacher = torch.randn(IN_FEATURES, IN_FEATURES, generator=data) / IN_FEATURES ** 0.5
        self.ys = torch.sin(self.xs @ teacher)
        with gpupool.tag("trainer"):
            self.model = model.to(device)
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.steps = 0

    def train(self, steps):
        """``steps`` steps; their losses (floats). No gradient outlives a step."""
        torch, losses = self.torch, []
        for _ in range(steps):
            i = self.steps % BATCHES
            with self.gpupool.tag("activations"):
                x, y = self.xs[i].to(self.device), self.ys[i].to(self.device)
                loss = torch.nn.functional.mse_loss(self.model(x), y)
                loss.backward()
            with self.gpupool.tag("trainer"):       # Adam's state is made at the first step
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            del x, y, loss
            self.steps += 1
        return losses

    def tensors(self):
        """The weights and the optimizer's state tensors on the GPU, in a fixed order."""
        found = list(self.model.parameters())
        for state in self.optimizer.state.values():
            found += [v for _, v in sorted(state.items()) if v.is_cuda]
        return found


class Engine:
    """The inference engine: a larger MLP, weights under ``"engine"``, its batch and activations
    under ``"engine-scratch"``."""

    def __init__(self, torch, gpupool, args, device):
        self.torch, self.gpupool, self.device = torch, gpupool, device
        torch.manual_seed(args.seed + 2)
        width = 2 * args.width
        model = mlp(torch, [IN_FEATURES] + [width] * args.layers + [IN_FEATURES], norm=True)
        self.tokens = torch.randn(ENGINE_TOKENS, IN_FEATURES,
                                  generator=torch.Generator().manual_seed(args.seed + 3))
        with gpupool.tag("engine"):
            self.model = model.to(device).eval()

    def generate(self):
        """One inference batch; its output, copied to the host."""
        with self.torch.inference_mode(), self.gpupool.tag("engine-scratch"):
            out = self.model(self.tokens.to(self.device))
            return out.cpu()


def host_copies(tensors):
    return [t.detach().to("cpu", copy=True) for t in tensors]


def used(torch, device):
    """Bytes of the device in use (``cudaMemGetInfo``: total minus free), after a synchronize."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def timed(action):
    began = time.perf_counter()
    action()
    return 1e3 * (time.perf_counter() - began)


def start(args):
    """Import PyTorch and gpupool, make a VMM pool of device 0 PyTorch's allocator; returns
    ``(torch, gpupool, pool, device)``. SetupError when a piece is missing."""
    require_torch_gpu()
    import torch

    import gpupool
    import gpupool.torch

    try:
        pool = gpupool.Pool(device=0, upstream="vmm")
    except gpupool.GpupoolError as exc:
        raise SetupError(f"no pool on the expandable upstream (sleep needs the GPU's virtual "
                         f"memory management): {one_line(exc)}") from None
    gpupool.torch.use(pool)                 # before PyTorch's first CUDA allocation
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", 0)
    # cuBLAS's workspaces, kept by PyTorch for the process, made untagged (forward and backward).
    w = torch.ones(64, 64, device=device, requires_grad=True)
    torch.nn.functional.linear(w, w, w[0]).sum().backward()
    del w
    return torch, gpupool, pool, device


def run(args):
    torch, gpupool, pool, device = start(args)
    print(f"{PROG}: trainer MLP {IN_FEATURES}-{args.width}x{args.layers - 1}-{IN_FEATURES} with "
          f"Adam, engine MLP {IN_FEATURES}-{2 * args.width}x{args.layers}-{IN_FEATURES}, on "
          f"{torch.cuda.get_device_name(device)}, PyTorch {torch.__version__}, allocator "
          f"{gpupool.torch.allocator()!r}")
    half = args.steps // 2

    reference = Trainer(torch, gpupool, args, device)
    expected = reference.train(args.steps)
    del reference
    gc.collect()
    print(f"reference: {args.steps} steps without sleeping, last loss {expected[-1]:.6f}")

    trainer = Trainer(torch, gpupool, args, device)
    losses = trainer.train(half)
    tensors = trainer.tensors()
    ptrs, saved = [t.data_ptr() for t in tensors], host_copies(tensors)
    print(f"trainer: {half} steps, loss {losses[-1]:.6f}; "
          f"{mib(sum(t.nbytes for t in saved))} MiB of weights and optimizer state")

    before, reserved = used(torch, device), pool.stats().reserved_bytes
    ms = timed(lambda: (pool.sleep("trainer", offload=True), pool.sleep("activations")))
    asleep, after = pool.stats(), used(torch, device)
    released = reserved - asleep.reserved_bytes
    print(f"sleep trainer ({ms:.1f} ms): pool reserved {mib(reserved)} -> "
          f"{mib(asleep.reserved_bytes)} MiB, device in use {mib(before)} -> {mib(after)} MiB; "
          f"asleep {mib(asleep.asleep_bytes)} MiB, offloaded {mib(asleep.offloaded_bytes)} MiB")
    pool.trim()                             # the untagged cache: the gradients' blocks
    refused = refusal(torch, gpupool, device)

    engine = Engine(torch, gpupool, args, device)
    answers = [engine.generate() for _ in range(args.engine_batches)]
    print(f"engine: {args.engine_batches} batches in the freed memory; pool reserved "
          f"{mib(pool.stats().reserved_bytes)} MiB, peak {mib(pool.stats().peak_reserved_bytes)}"
          f" MiB")
    ms = timed(lambda: (pool.sleep("engine", offload=True), pool.sleep("engine-scratch")))
    print(f"sleep engine ({ms:.1f} ms): device in use {mib(used(torch, device))} MiB")

    ms = timed(lambda: pool.wake(["trainer", "activations"]))
    print(f"wake trainer ({ms:.1f} ms): device in use {mib(used(torch, device))} MiB")
    same_ptrs = [t.data_ptr() for t in tensors] == ptrs
    same_values = all(torch.equal(a, b) for a, b in zip(host_copies(tensors), saved,
                                                        strict=True))
    losses += trainer.train(args.steps - half)
    print(f"trainer: {args.steps - half} more steps, last loss {losses[-1]:.6f}")

    pool.sleep(["trainer", "activations"], offload=True)
    pool.wake(["engine", "engine-scratch"])
    engine_same = torch.equal(engine.generate(), answers[0])

    differing = [i for i, (a, b) in enumerate(zip(losses, expected, strict=True)) if a != b]
    checks = [
        (f"sleep freed {mib(before - after)} MiB of the device, at least 99% of the "
         f"{mib(released)} MiB the pool released",
         released > 0 and before - after >= 0.99 * released),
        ("the trainer's tensors kept their addresses across sleep and wake", same_ptrs),
        ("the trainer's weights and optimizer state are bit-identical after wake", same_values),
        (f"allocating with the sleeping tag is refused: {refused}",
         "'trainer'" in refused and "sleeps" in refused),
        (f"the losses equal the run without sleeping, step for step ({args.steps} steps)",
         not differing),
        ("the engine's output after its wake equals its output before its sleep", engine_same),
    ]
    for title, passed in checks:
        print(f"[{'ok' if passed else 'FAIL'}] {title}")
    if differing:
        i = differing[0]
        print(f"first differing step {i}: {losses[i]!r} with sleep, {expected[i]!r} without")
    return [title for title, passed in checks if not passed]


def refusal(torch, gpupool, device):
    """What allocating a tensor with the sleeping tag raises (type and message), or a note that
    it did not."""
    try:
        with gpupool.tag("trainer"):
            torch.empty(1024, device=device)
    except RuntimeError as exc:             # gpupool.SleepingMemoryError is one too
        return f"{type(exc).__name__}: {one_line(exc)}"
    return "nothing raised"


def parse_args(argv):
    p = argparse.ArgumentParser(description="A PyTorch trainer and an inference engine taking "
                                "turns on one GPU through gpupool's sleep and wake (see the "
                                "module docstring). It needs an NVIDIA GPU and a CUDA build of "
                                "PyTorch; without them it exits 2 naming what is missing.")
    p.add_argument("--steps", type=int, default=8,
                   help="training steps in all (default %(default)s)")
    p.add_argument("--width", type=int, default=4096, help="the trainer's hidden width (the "
                   "engine's is twice it; default %(default)s)")
    p.add_argument("--layers", type=int, default=4,
                   help="the trainer's layers (default %(default)s)")
    p.add_argument("--engine-batches", type=int, default=4,
                   help="inference batches per turn (default %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of both models' weights, the training data and the engine's "
                        "tokens (default %(default)s)")
    args = p.parse_args(argv)
    if args.steps < 2 or args.width < 1 or args.layers < 2 or args.engine_batches < 1:
        p.error("--steps and --layers must be at least 2, --width and --engine-batches 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    return exit_status(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
