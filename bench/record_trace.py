"""Record allocation traces from real PyTorch training steps on the GPU (for trace_replay.py).

For each model: PyTorch's memory history is switched on
(``torch.cuda.memory._record_memory_history``), the model and its optimizer are made on the
GPU and trained for ``--steps`` steps (forward, backward, optimizer step) on random data made
on the GPU each step, then ``torch.cuda.memory._snapshot()`` is converted
(``alloc_trace.from_snapshot``) and saved as ``DIR/NAME.npz``. Run::

    python bench/record_trace.py --out DIR [--steps 5] [--models conv,transformer] [--quick]

(``--quick``: at most 2 steps.)

Models:

- ``conv``: four Conv2d(3x3) + BatchNorm2d + ReLU blocks (32, 64, 128, 128 channels, max
  pooling after the second and third), global average pooling and a Linear layer to 10
  classes; 32x32 RGB images, batch 64, cross entropy, SGD with momentum 0.9;
- ``transformer``: an Embedding (vocabulary 1000, d_model 256), a 2-layer
  nn.TransformerEncoder (8 heads, feed-forward 1024, dropout 0.1, batch first) and a Linear
  layer back to the vocabulary; sequences of 128 tokens, batch 16, cross entropy per token,
  AdamW.

Not part of ``run_all.py``: the traces are recorded once and committed under
``bench/data/traces/``. Without PyTorch or a GPU the script prints a one-line skip and exits 0.
"""

import os
import sys
import time

import _common
import alloc_trace
from _common import MiB, format_table

SCRIPT = "record_trace"
MAX_ENTRIES = 1_000_000


def conv_model(torch):
    """Conv2d+BatchNorm2d+ReLU x4 on 32x32 images, batch 64, SGD momentum.

    Returns the model, ``batch(device)`` -> (inputs, targets) and ``optimizer(params)``.
    """
    nn = torch.nn

    def block(cin, cout, pool):
        layers = [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
        return layers + ([nn.MaxPool2d(2)] if pool else [])

    model = nn.Sequential(*block(3, 32, False), *block(32, 64, True), *block(64, 128, True),
                          *block(128, 128, False), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(128, 10))

    def batch(device):
        return (torch.randn(64, 3, 32, 32, device=device),
                torch.randint(0, 10, (64,), device=device))

    def optimizer(params):
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    return model, batch, optimizer


def transformer_model(torch):
    """Embedding + 2-layer TransformerEncoder (d_model 256) + Linear, seq 128, batch 16, AdamW.

    Returns the model, ``batch(device)`` -> (tokens, targets) and ``optimizer(params)``.
    """
    nn = torch.nn
    vocab, d_model = 1000, 256

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            layer = nn.TransformerEncoderLayer(d_model, nhead=8, dim_feedforward=1024,
                                               dropout=0.1, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, num_layers=2,
                                                 enable_nested_tensor=False)
            self.head = nn.Linear(d_model, vocab)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens))).flatten(0, 1)

    def batch(device):
        tokens = torch.randint(0, vocab, (16, 128), device=device)
        return tokens, torch.randint(0, vocab, (16 * 128,), device=device)

    def optimizer(params):
        return torch.optim.AdamW(params, lr=1e-3)

    return Encoder(), batch, optimizer


MODELS = {"conv": conv_model, "transformer": transformer_model}


def train(torch, make, steps, device):
    """Make the model and optimizer on ``device`` (a ``torch.device``) and run ``steps``
    training steps; returns the model and the optimizer."""
    model, batch, optimizer = make(torch)
    model = model.to(device)
    opt = optimizer(model.parameters())
    loss_fn = torch.nn.functional.cross_entropy
    for _ in range(steps):
        x, y = batch(device)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return model, opt


def record(torch, name, steps, max_entries):
    """Train model ``name`` under PyTorch's memory history; returns its Trace.

    Raises
    ------
    RuntimeError
        The history filled ``max_entries`` (PyTorch then drops the oldest entries, so the
        trace would be cut): run again with a larger ``--max-entries``.
    """
    memory = torch.cuda.memory
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    memory._record_memory_history(enabled="all", context=None, stacks="python",
                                  max_entries=max_entries, clear_history=True)
    try:
        model, opt = train(torch, MODELS[name], steps, device)
        snapshot = memory._snapshot()
    finally:
        memory._record_memory_history(enabled=None)
    entries = len(snapshot["device_traces"][device.index])
    if entries >= max_entries:
        raise RuntimeError(f"{name}: the memory history filled max_entries={max_entries}, so "
                           "its start was dropped; run again with a larger --max-entries")
    meta = {"model": name, "steps": steps, "description": MODELS[name].__doc__.splitlines()[0],
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(device),
            "torch_max_memory_reserved": torch.cuda.max_memory_reserved(device),
            "torch_max_memory_allocated": torch.cuda.max_memory_allocated(device),
            "parameters": sum(p.numel() for p in model.parameters())}
    del model, opt
    torch.cuda.empty_cache()
    return alloc_trace.from_snapshot(snapshot, name, device.index, meta)


def main(argv=None):
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--out", default=alloc_trace.TRACE_DIR, metavar="DIR",
                   help="folder for NAME.npz (default: bench/data/traces)")
    p.add_argument("--steps", type=int, default=5, help="training steps per model (5)")
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated models (default: {','.join(MODELS)})")
    p.add_argument("--max-entries", type=int, default=MAX_ENTRIES,
                   help=f"PyTorch memory history entries kept ({MAX_ENTRIES:,})")
    args = p.parse_args(argv)
    if args.quick:
        args.steps = min(args.steps, 2)
    names = args.models.split(",")
    if set(names) - set(MODELS) or args.steps < 1:
        p.error(f"models must be among {list(MODELS)} and --steps >= 1")
    if args.simulated:
        _common.skip(SCRIPT, "--simulated: recording needs PyTorch on a GPU", args.json)
    torch = _common.cuda_torch_or_skip(SCRIPT, args.json)
    start, rows, results = time.perf_counter(), [], {}
    for name in names:
        trace = record(torch, name, args.steps, args.max_entries)
        path = os.path.join(args.out, f"{name}.npz")
        alloc_trace.save(trace, path)
        summary = trace.summary()
        results[name] = {"path": os.path.abspath(path), "summary": summary, "meta": trace.meta}
        rows.append([name, f"{summary['events']:,}", str(summary["streams"]),
                     f"{summary['peak_live_bytes'] / MiB:,.1f}",
                     f"{trace.meta['torch_max_memory_allocated'] / MiB:,.1f}",
                     f"{trace.meta['torch_max_memory_reserved'] / MiB:,.1f}",
                     str(trace.meta["unmatched_frees"]),
                     f"{os.path.getsize(path) / 1024:,.0f}"])
        print(f"  {name}: {summary['events']:,} events -> {path}", file=sys.stderr)
    print(format_table(["model", "events", "streams", "peak live MiB",
                        "torch peak allocated MiB", "torch peak reserved MiB",
                        "unmatched frees", "file KiB"], rows,
                       f"traces of {args.steps} training steps, in {os.path.abspath(args.out)}"))
    elapsed = time.perf_counter() - start
    print(f"\n{SCRIPT}: {elapsed:.1f} s")
    if args.json:
        _common.write_json(args.json, {"script": SCRIPT, "traces": results, "elapsed_s": elapsed,
                                       "env": _common.environment()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
