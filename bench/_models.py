"""Real PyTorch workloads for the memory benchmarks (random init from configs, no download).

Each workload is made by :func:`make` and run by :func:`step`: the same model, data and
optimizer for every allocator, seeded so that the losses agree across allocators.

- ``resnet50``: torchvision's ResNet-50, batch 64 of 224x224 RGB images, 1000 classes, fp32,
  cross entropy, AdamW;
- ``gpt2``: GPT-2 small (``transformers.GPT2Config()``: 12 layers, d_model 768, 124 M
  parameters) as ``GPT2LMHeadModel``, batch 8 of 512 tokens, fp32, its own LM loss, AdamW;
- ``gpt2-varlen``: the same with each step's sequence length drawn uniformly from 128..1024
  (one fixed seed, so every allocator sees the same lengths in the same order);
- ``vit``, ``bert-varlen``: workloads added as a check on a policy not tuned on them; since
  2026-12-02 the placement of small blocks is tuned on ViT-B/16's trace,
  so BERT is the check left: torchvision's ViT-B/16, batch 32 of 224x224 images, fp32,
  AdamW; BERT base (``transformers.BertConfig()``: 12 layers, d_model 768, 110 M parameters) as
  ``BertForMaskedLM``, batch 16, each step's sequence length drawn uniformly from 64..512, its
  own MLM loss on every token, fp32, AdamW;
- ``gpt2-ckpt``: GPT-2 small with activation checkpointing
  (``gradient_checkpointing_enable``, non-reentrant), the forward under bf16 autocast, each
  step's batch drawn from 4, 8, 16 and its length uniformly from 128..1024, AdamW;
- ``llama-ckpt``: a Llama-style decoder (``transformers.LlamaConfig``: 24 layers, hidden 1024,
  16 heads, MLP 2816, vocabulary 32000, untied embeddings: 374 M parameters) as
  ``LlamaForCausalLM``, checkpointed and autocast the same way, batch drawn from 2, 4, 8 and
  length from 256..2048, AdamW;
- ``gpt2-generate``: inference, no optimizer: GPT-2 small in bf16, greedy ``generate()`` (its
  KV cache grows by one token a step of decoding) under ``torch.inference_mode()``, each step's
  batch drawn from 8, 16, 32, 64, its prompt from 64..512 tokens and its new tokens from
  16..48 (all of them generated: the end-of-text token is held back until then).

The per-step shapes come from one generator with a fixed seed, drawn step by step, so a run
of fewer steps sees the first steps of a longer one. ``make(..., tiny=True)`` shrinks the
transformers models and their shapes to a few layers and tokens, for a check of the code
paths on the CPU.
"""

from contextlib import nullcontext

import numpy as np

LR = 1e-4
SEED = 0
MODELS = ("resnet50", "gpt2", "gpt2-varlen", "vit", "bert-varlen", "gpt2-ckpt", "llama-ckpt",
          "gpt2-generate")
DEFAULT_MODELS = MODELS[:5]     # real_models.py's default: the runs its history compares
DESCRIPTIONS = {
    "resnet50": "torchvision ResNet-50, batch 64, 224x224, fp32, AdamW",
    "gpt2": "GPT-2 small (transformers config), batch 8, seq 512, fp32, AdamW",
    "gpt2-varlen": "GPT-2 small, batch 8, seq drawn from 128..1024 per step, fp32, AdamW",
    "vit": "torchvision ViT-B/16, batch 32, 224x224, fp32, AdamW",
    "bert-varlen": "BERT base MLM, batch 16, seq drawn from 64..512 per step, fp32, AdamW "
                   "(not tuned on)",
    "gpt2-ckpt": "GPT-2 small, activation checkpointing, bf16 autocast, batch from 4,8,16 x "
                 "seq from 128..1024 per step, AdamW",
    "llama-ckpt": "Llama-style 374 M (24 layers, hidden 1024), activation checkpointing, bf16 "
                  "autocast, batch from 2,4,8 x seq from 256..2048 per step, AdamW",
    "gpt2-generate": "GPT-2 small bf16, greedy generate() (KV cache), batch from 8..64, prompt "
                     "64..512, 16..48 new tokens per step, inference_mode",
}
# name -> (batch sizes, shortest, longest sequence); tiny: for the CPU check of the code paths
CHECKPOINTED = {"gpt2-ckpt": ((4, 8, 16), 128, 1024), "llama-ckpt": ((2, 4, 8), 256, 2048)}
GENERATE = ((8, 16, 32, 64), (64, 512), (16, 48))   # batch sizes, prompt range, new tokens range
TINY_CHECKPOINTED = ((1, 2), 8, 32)
TINY_GENERATE = ((1, 2), (4, 16), (2, 6))


class Workload:
    """A model on a device, its optimizer (None for inference) and its batches.

    Attributes
    ----------
    model : torch.nn.Module
    optimizer : torch.optim.Optimizer or None
        AdamW over the model's parameters; None: an inference workload, whose step runs
        ``loss`` under ``torch.inference_mode()`` and nothing else.
    batch : callable
        ``batch(step)`` -> the inputs of step ``step`` (0-based), made on the device.
    loss : callable
        ``loss(inputs)`` -> a scalar tensor: the loss to train on, or for inference a
        checksum of the output (equal across allocators).
    autocast : torch.dtype or None
        The dtype of ``torch.autocast`` around ``loss`` (the forward); None: no autocast.
    """

    def __init__(self, model, batch, loss, *, train=True, autocast=None):
        import torch

        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR) if train else None
        self.batch = batch
        self.loss = loss
        self.autocast = autocast

    def forward_context(self):
        """The context the forward runs in: autocast to :attr:`autocast` on the model's
        device type, or nothing."""
        if self.autocast is None:
            return nullcontext()
        import torch

        device = next(self.model.parameters()).device
        return torch.autocast(device.type, dtype=self.autocast)


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


def _decoder(name, tiny):
    """The config and class of a decoder: ``"gpt2"`` (GPT-2 small) or ``"llama"`` (the
    Llama-style 374 M); ``tiny``: two layers of width 64 over 512 tokens."""
    import transformers

    if name == "gpt2":
        small = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128,
                     bos_token_id=511, eos_token_id=511)
        return transformers.GPT2Config(**(small if tiny else {})), transformers.GPT2LMHeadModel
    size = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
                 max_position_embeddings=128, bos_token_id=0, eos_token_id=511) if tiny else
            dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                 max_position_embeddings=2048))
    return transformers.LlamaConfig(**size), transformers.LlamaForCausalLM


def _checkpointed(torch, device, name, shapes, tiny):
    """A decoder (see :func:`_decoder`) with activation checkpointing, trained under bf16
    autocast with its own LM loss on ``shapes[step]`` = (batch, length) random tokens."""
    config, cls = _decoder(name, tiny)
    with torch.device(device):
        model = cls(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def batch(step):
        return torch.randint(0, config.vocab_size, shapes[step % len(shapes)], device=device)

    def loss(tokens):
        return model(input_ids=tokens, labels=tokens, use_cache=False).loss

    return Workload(model, batch, loss, autocast=torch.bfloat16)


def _generate(torch, device, shapes, tiny):
    """GPT-2 in bf16, greedy ``generate()`` of ``new`` tokens after a random prompt of
    ``shapes[step]`` = (batch, prompt, new); the checksum is the sum of the new tokens."""
    config, cls = _decoder("gpt2", tiny)
    with torch.device(device):
        model = cls(config)
    model = model.to(torch.bfloat16).eval()

    def batch(step):
        size, prompt, new = shapes[step % len(shapes)]
        return torch.randint(0, config.vocab_size, (size, prompt), device=device), new

    def loss(inputs):
        prompt, new = inputs
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                             do_sample=False, max_new_tokens=new, min_new_tokens=new,
                             pad_token_id=config.eos_token_id)
        return out[:, prompt.shape[1]:].sum()

    return Workload(model, batch, loss, train=False)


def sequence_lengths(steps, low=128, high=1024, seed=SEED):
    """The per-step sequence lengths of ``gpt2-varlen`` (and, 64..512, ``bert-varlen``): ints
    uniform in [low, high]."""
    return np.random.default_rng(seed).integers(low, high + 1, size=max(steps, 1))


def batch_shapes(steps, batches, lengths, *more, seed=SEED):
    """Per-step shapes, drawn step by step: a batch size from ``batches``, then an int uniform
    in each inclusive range of ``lengths`` and ``more`` (each a (low, high) pair).

    Returns
    -------
    list of tuple of int
        ``max(steps, 1)`` tuples (batch, length, ...); the first k of a longer run's are a
        shorter run's.
    """
    rng = np.random.default_rng(seed)
    ranges = (lengths, *more)
    return [(int(rng.choice(batches)), *(int(rng.integers(lo, hi + 1)) for lo, hi in ranges))
            for _ in range(max(steps, 1))]


def make(name, steps, device="cuda", tiny=False):
    """The workload ``name`` (one of :data:`MODELS`) on ``device``, seeded.

    Parameters
    ----------
    name : str
    steps : int
        How many steps will run (the varying workloads draw that many shapes).
    device : str or torch.device
    tiny : bool
        Shrink the checkpointed and generating workloads to two narrow layers and a few
        tokens (a check of their code paths on the CPU); the others refuse it.

    Raises
    ------
    ValueError
        An unknown name, or ``tiny`` for a workload without a tiny form.
    ImportError
        torchvision (ResNet-50, ViT) or transformers (the language models) is missing.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {MODELS}")
    if tiny and name not in (*CHECKPOINTED, "gpt2-generate"):
        raise ValueError(f"{name!r} has no tiny form; those with one: "
                         f"{(*CHECKPOINTED, 'gpt2-generate')}")
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
    if name in CHECKPOINTED:
        batches, low, high = TINY_CHECKPOINTED if tiny else CHECKPOINTED[name]
        shapes = batch_shapes(steps, batches, (low, high))
        return _checkpointed(torch, device, name.split("-")[0], shapes, tiny)
    batches, prompts, new = TINY_GENERATE if tiny else GENERATE
    return _generate(torch, device, batch_shapes(steps, batches, prompts, new), tiny)


def step(work, index, on_phase=None):
    """One step of batch ``index``; returns the loss tensor (for inference: the checksum).

    Training: forward (under :meth:`Workload.forward_context`), backward, optimizer step.
    Inference (``work.optimizer`` is None): the forward alone, under
    ``torch.inference_mode()``. ``on_phase(name)`` runs after the forward ("forward") and the
    backward ("backward"), for memory samples at the moments of a step's peak.
    """
    import torch

    if work.optimizer is None:
        with torch.inference_mode(), work.forward_context():
            out = work.loss(work.batch(index))
        if on_phase is not None:
            on_phase("forward")
        return out
    work.optimizer.zero_grad(set_to_none=True)
    with work.forward_context():
        loss = work.loss(work.batch(index))
    if on_phase is not None:
        on_phase("forward")
    loss.backward()
    if on_phase is not None:
        on_phase("backward")
    work.optimizer.step()
    return loss
