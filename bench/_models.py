"""Real PyTorch training workloads for the memory benchmarks (random init, no download).

Each workload is made by :func:`make` and trained by :func:`step`: the same model, data and
optimizer for every allocator, seeded so that the losses agree across allocators.

- ``resnet50``: torchvision's ResNet-50, batch 64 of 224x224 RGB images, 1000 classes, fp32,
  cross entropy, AdamW;
- ``gpt2``: GPT-2 small (``transformers.GPT2Config()``: 12 layers, d_model 768, 124 M
  parameters) as ``GPT2LMHeadModel``, batch 8 of 512 tokens, fp32, its own LM loss, AdamW;
- ``gpt2-varlen``: the same with each step's sequence length drawn uniformly from 128..1024
  (one fixed seed, so every allocator sees the same lengths in the same order);
- ``vit``, ``bert-varlen``: workloads added as a check on a policy not tuned on them (issue 13
  asks for one); since 2026-12-02 the placement of small blocks is tuned on ViT-B/16's trace,
  so BERT is the check left: torchvision's ViT-B/16, batch 32 of 224x224 images, fp32,
  AdamW; BERT base (``transformers.BertConfig()``: 12 layers, d_model 768, 110 M parameters) as
  ``BertForMaskedLM``, batch 16, each step's sequence length drawn uniformly from 64..512, its
  own MLM loss on every token, fp32, AdamW.
"""

import numpy as np

LR = 1e-4
SEED = 0
MODELS = ("resnet50", "gpt2", "gpt2-varlen", "vit", "bert-varlen")
DESCRIPTIONS = {
    "resnet50": "torchvision ResNet-50, batch 64, 224x224, fp32, AdamW",
    "gpt2": "GPT-2 small (transformers config), batch 8, seq 512, fp32, AdamW",
    "gpt2-varlen": "GPT-2 small, batch 8, seq drawn from 128..1024 per step, fp32, AdamW",
    "vit": "torchvision ViT-B/16, batch 32, 224x224, fp32, AdamW",
    "bert-varlen": "BERT base MLM, batch 16, seq drawn from 64..512 per step, fp32, AdamW "
                   "(not tuned on)",
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


def _images(torch, device, name, batch_size):
    """A torchvision classifier ``name`` on batches of batch_size random 224x224 images."""
    import torchvision

    model = getattr(torchvision.models, name)(weights=None).to(device)

    def batch(_step):
        return (torch.randn(batch_size, 3, 224, 224, device=device),
                torch.randint(0, 1000, (batch_size,), device=device))

    def loss(inputs):
        images, labels = inputs
        return torch.nn.functional.cross_entropy(model(images), labels)

    return Workload(model, batch, loss)


def _language_model(torch, device, name, batch_size, lengths):
    """transformers' ``GPT2LMHeadModel`` or ``BertForMaskedLM`` (name "gpt2" or "bert") in its
    default configuration, on batch_size random token sequences of ``lengths[step]`` tokens,
    trained with its own loss on every token."""
    import transformers

    if name == "gpt2":
        config, cls = transformers.GPT2Config(), transformers.GPT2LMHeadModel
    else:
        config, cls = transformers.BertConfig(), transformers.BertForMaskedLM
    model = cls(config).to(device)

    def batch(step):
        return torch.randint(0, config.vocab_size,
                             (batch_size, int(lengths[step % len(lengths)])), device=device)

    def loss(tokens):
        return model(input_ids=tokens, labels=tokens).loss

    return Workload(model, batch, loss)


def sequence_lengths(steps, low=128, high=1024, seed=SEED):
    """The per-step sequence lengths of ``gpt2-varlen`` (and, 64..512, ``bert-varlen``): ints
    uniform in [low, high]."""
    return np.random.default_rng(seed).integers(low, high + 1, size=max(steps, 1))


def make(name, steps, device="cuda"):
    """The workload ``name`` (one of :data:`MODELS`) on ``device``, seeded.

    Raises
    ------
    ValueError
        An unknown name.
    ImportError
        torchvision (ResNet-50, ViT) or transformers (GPT-2, BERT) is missing.
    """
    import torch

    torch.manual_seed(SEED)
    if name == "resnet50":
        return _images(torch, device, "resnet50", 64)
    if name == "vit":
        return _images(torch, device, "vit_b_16", 32)
    if name == "gpt2":
        return _language_model(torch, device, "gpt2", 8, [512])
    if name == "gpt2-varlen":
        return _language_model(torch, device, "gpt2", 8, sequence_lengths(steps))
    if name == "bert-varlen":
        return _language_model(torch, device, "bert", 16, sequence_lengths(steps, 64, 512))
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
