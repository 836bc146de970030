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
  AdamW;
- any workload of ``_models.py`` (``real_models.py``'s: ``gpt2-ckpt``, ``llama-ckpt``,
  ``gpt2-generate``...), run step by step as ``real_models.py`` runs it, with the start of
  each step marked (one allocation of ``MARK_BYTES``, left out of the trace; the index of the
  event after it goes to ``meta["step_starts"]``): those traces are for ``fragmentation.py``,
  which replays its region and thread models at the step starts, and belong in
  ``bench/data/traces-real/``.

Not part of ``run_all.py``: the traces are recorded once and committed under
``bench/data/traces/`` (the two small models) and ``bench/data/traces-real/`` (the
workloads). Without PyTorch or a GPU the script prints a one-line skip and exits 0.
"""

import os
import sys
import time

import _common
import _models
import alloc_trace
from _common import MiB, format_table

SCRIPT = "record_trace"
MAX_ENTRIES = 4_000_000
MARK_BYTES = 7_777_777     # workloads: one allocation of this size marks each step's start


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
KNOWN = (*MODELS, *_models.MODELS)


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


def history_on(torch, max_entries=MAX_ENTRIES):
    """Switch PyTorch's memory history on, cleared: every allocation and free, no stacks."""
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             max_entries=max_entries, clear_history=True)


def mark_step(torch):
    """Allocate and free one block of ``MARK_BYTES`` on the GPU: the mark of a step's start,
    which :func:`history_trace` turns into ``meta["step_starts"]``."""
    torch.empty(MARK_BYTES, dtype=torch.uint8, device="cuda")


def history_trace(torch, name, steps, description, max_entries=MAX_ENTRIES, marked=False):
    """Switch the memory history off and return what it recorded on the current device.

    Parameters
    ----------
    name : str
        The trace's name (its model).
    steps : int
        Steps run while recording, and ``description`` the model's one line: both to ``meta``,
        with PyTorch's version, the GPU and PyTorch's own peaks (bytes).
    marked : bool
        The steps were marked by :func:`mark_step`: drop the marks, list the step starts.

    Returns
    -------
    alloc_trace.Trace

    Raises
    ------
    RuntimeError
        The history filled ``max_entries`` (PyTorch then drops the oldest entries, so the
        trace would be cut): run again with a larger ``--max-entries``.
    """
    device = torch.cuda.current_device()
    try:
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    if len(snapshot["device_traces"][device]) >= max_entries:
        raise RuntimeError(f"{name}: the memory history filled max_entries={max_entries}, so "
                           "its start was dropped; run again with a larger --max-entries")
    meta = {"model": name, "steps": steps, "description": description,
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(device),
            "torch_max_memory_allocated": torch.cuda.max_memory_allocated(device),
            "torch_max_memory_reserved": torch.cuda.max_memory_reserved(device)}
    trace = alloc_trace.from_snapshot(snapshot, name, device, meta)
    return alloc_trace.without_markers(trace, MARK_BYTES) if marked else trace


def run_workload(torch, name, steps):
    """Make ``_models`` workload ``name`` on the GPU and run ``steps`` steps, each marked
    (:func:`mark_step`) and ended by reading its loss, as ``real_models.py`` runs them;
    returns the workload."""
    work = _models.make(name, steps)
    for i in range(steps):
        mark_step(torch)
        float(_models.step(work, i))
    torch.cuda.synchronize()
    return work


def record(torch, name, steps, max_entries):
    """Train model ``name`` (of :data:`MODELS` or ``_models.MODELS``) under PyTorch's memory
    history; returns its Trace.

    Raises
    ------
    RuntimeError
        The history filled ``max_entries`` (see :func:`history_trace`).
    """
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    history_on(torch, max_entries)
    try:
        if name in MODELS:
            model, opt = train(torch, MODELS[name], steps, device)
            description = MODELS[name].__doc__.splitlines()[0]
        else:
            work = run_workload(torch, name, steps)
            model, opt, description = work.model, work.optimizer, _models.DESCRIPTIONS[name]
            del work
    except BaseException:
        torch.cuda.memory._record_memory_history(enabled=None)
        raise
    trace = history_trace(torch, name, steps, description, max_entries,
                          marked=name not in MODELS)
    trace.meta["parameters"] = sum(p.numel() for p in model.parameters())
    del model, opt
    torch.cuda.empty_cache()
    return trace


def main(argv=None):
    p = _common.parser(__doc__.splitlines()[0],
                       no_simulated="recording needs PyTorch on a GPU")
    p.add_argument("--out", default=alloc_trace.TRACE_DIR, metavar="DIR",
                   help="folder for NAME.npz (default: bench/data/traces)")
    p.add_argument("--steps", type=int, default=5, help="training steps per model (5)")
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated models among {', '.join(KNOWN)} (default: "
                        f"{','.join(MODELS)})")
    p.add_argument("--max-entries", type=int, default=MAX_ENTRIES,
                   help=f"PyTorch memory history entries kept ({MAX_ENTRIES:,})")
    args = p.parse_args(argv)
    if args.quick:
        args.steps = min(args.steps, 2)
    names = args.models.split(",")
    if set(names) - set(KNOWN) or args.steps < 1:
        p.error(f"models must be among {list(KNOWN)} and --steps >= 1")
    if args.simulated:
        _common.skip(SCRIPT, "--simulated: recording needs PyTorch on a GPU", args.json)
    torch = _common.cuda_torch_or_skip(SCRIPT, args.json)
    start, rows, results = time.perf_counter(), [], {}
    for name in names:
        began = time.perf_counter()
        trace = record(torch, name, args.steps, args.max_entries)
        seconds = time.perf_counter() - began
        path = os.path.join(args.out, f"{name}.npz")
        alloc_trace.save(trace, path)
        summary = trace.summary()
        results[name] = {"path": os.path.abspath(path), "summary": summary, "meta": trace.meta}
        rows.append([name, f"{summary['events']:,}", str(summary["streams"]),
                     f"{summary['peak_live_bytes'] / MiB:,.1f}",
                     f"{trace.meta['torch_max_memory_allocated'] / MiB:,.1f}",
                     f"{trace.meta['torch_max_memory_reserved'] / MiB:,.1f}",
                     str(trace.meta["unmatched_frees"]),
                     str(len(trace.meta.get("step_starts", ()))),
                     f"{os.path.getsize(path) / 1024:,.0f}", f"{seconds:.0f}"])
        print(f"  {name}: {summary['events']:,} events -> {path}, {seconds:.0f} s",
              file=sys.stderr, flush=True)
    print(format_table(["model", "events", "streams", "peak live MiB",
                        "torch peak allocated MiB", "torch peak reserved MiB",
                        "unmatched frees", "steps marked", "file KiB", "s"], rows,
                       f"traces of {args.steps} steps, in {os.path.abspath(args.out)}"))
    elapsed = time.perf_counter() - start
    print(f"\n{SCRIPT}: {elapsed:.1f} s")
    if args.json:
        _common.write_json(args.json, {"script": SCRIPT, "traces": results, "elapsed_s": elapsed,
                                       "env": _common.environment()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
