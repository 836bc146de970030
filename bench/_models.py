"""Real PyTorch training workloads for the memory benchmarks (random init, no download).

Each workload is made by :func:`make` and trained by :func:`step`: the same model, data and
optimizer for every allocator, seeded so that the losses agree across allocators.

- ``resnet50``: torchvision's ResNet-50, batch 64 of 224x224 RGB images, 1000 classes, fp32,
  cross entropy, AdamW;
- ``gpt2``: GPT-2 small (``transformers.GPT2Config()``: 12 layers, d_model 768, 124 M
  parameters) as ``GPT2LMHeadModel``, batch 8 of 512 tokens, fp32, its own LM loss, AdamW;
- ``gpt2-varlen``: the same with each step's sequence length drawn uniformly from 128..1024
  (one fixed seed, so every allocator sees the same lengths in the same order).
"""

import numpy as np

LR = 1e-4
SEED = 0
MODELS = ("resnet50", "gpt2", "gpt2-varlen")
DESCRIPTIONS = {
    "resnet50": "torchvision ResNet-50, batch 64, 224x224, fp32, AdamW",
    "gpt2": "GPT-2 small (transformers config), batch 8, seq 512, fp32, AdamW",
    "gpt2-varlen": "GPT-2 small, batch 8, seq drawn from 128..1024 per step, fp32, AdamW",
}


class Workload:
    """A model on the GPU, its optimizer and its batches.

    Attributes
    ----------
    model : torch.nn.Module
    optimizer : torch.optim.Optimizer
    batch : callable
        ``batch(step)`` -> the inputs of step ``step`` (0-based), made on the GPU.
    loss : callable
        ``loss(inputs)`` -> the scalar loss tensor.
    """

    def __init__(self, model, batch, loss):
        import torch

        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        self.batch = batch
        self.loss = loss


def _resnet50(torch, device):
    import torchvision

    model = torchvision.models.resnet50(weights=None).to(device)

    def batch(_step):
        return (torch.randn(64, 3, 224, 224, device=device),
                torch.randint(0, 1000, (64,), device=device))

    def loss(inputs):
        images, labels = inputs
        return torch.nn.functional.cross_entropy(model(images), labels)

    return Workload(model, batch, loss)


def _gpt2(torch, device, lengths):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config()
    model = GPT2LMHeadModel(config).to(device)

    def batch(step):
        return torch.randint(0, config.vocab_size, (8, int(lengths[step % len(lengths)])),
                             device=device)

    def loss(tokens):
        return model(input_ids=tokens, labels=tokens).loss

    return Workload(model, batch, loss)


def sequence_lengths(steps, low=128, high=1024, seed=SEED):
    """The per-step sequence lengths of ``gpt2-varlen``: ints uniform in [low, high]."""
    return np.random.default_rng(seed).integers(low, high + 1, size=max(steps, 1))


def make(name, steps, device="cuda"):
    """The workload ``name`` (one of :data:`MODELS`) on ``device``, seeded.

    Raises
    ------
    ValueError
        An unknown name.
    ImportError
        torchvision (ResNet-50) or transformers (GPT-2) is missing.
    """
    import torch

    torch.manual_seed(SEED)
    if name == "resnet50":
        return _resnet50(torch, device)
    if name == "gpt2":
        return _gpt2(torch, device, [512])
    if name == "gpt2-varlen":
        return _gpt2(torch, device, sequence_lengths(steps))
    raise ValueError(f"unknown model {name!r}; known: {MODELS}")


def step(work, index, on_phase=None):
    """One training step (forward, backward, optimizer step) of batch ``index``; returns the
    loss tensor. ``on_phase(name)`` runs after the forward ("forward") and the backward
    ("backward"), for memory samples at the moments of a step's peak."""
    work.optimizer.zero_grad(set_to_none=True)
    loss = work.loss(work.batch(index))
    if on_phase is not None:
        on_phase("forward")
    loss.backward()
    if on_phase is not None:
        on_phase("backward")
    work.optimizer.step()
    return loss
