"""Device memory of a deep MLP training step whose temporaries sit in reference cycles.

The step: a CuPy MLP (8 dense layers of 1024, batch 256, float32, ReLU, softmax cross entropy)
trained with SGD and weight decay, through ``examples/_autograd.py``, the tiny autograd that
``examples/train_digits.py`` uses: every node keeps its parents and a backward closure that
refers back to the node, so a step's tape (its activations) is a reference cycle that only the
cyclic garbage collector frees. Backward frees each gradient once it has been passed on, and
the optimizer works unfused, so the step makes many short-lived temporaries besides. PyTorch is
imported first, as in real jobs (its objects are what make a full collection slow).
``--steps`` steps (500; ``--quick``: 60) run in each of six ways, each from a fresh state:

* ``cupy-default``: CuPy's ``MemoryPool``, default garbage collection;
* ``cupy-gc``: the same with ``gc.collect()`` after every step (for at most ``--gc-steps``);
* ``gpupool``: ``gpupool.Pool``, no region, default garbage collection;
* ``gpupool-region``: the same with ``with gpupool.Region(pool=pool):`` around every step;
* ``gpupool-invalidate``: the same with ``Region(pool=pool, on_exit="invalidate")``;
* ``pin-until-step-end``: a reference cache, written here, that reuses a freed block only
  after the step ends (the failure mode: reserved memory becomes the sum of the step's
  allocations instead of its working set).

Reported per way: median ms per step, peak bytes in use and reserved, reserved after step 2
and after the last step, whether reserved stayed flat after step 2 (with ``--batches``: after the
step by which every batch size was seen), and peak reserved over the
working set of the step; the targets for the two region ways; a plot of reserved memory over
the steps. With ``--batches 64,128,256`` each step's batch is drawn from the set instead (one
fixed seed, the same sizes for every way; varying shapes, as a CuPy user's data can have): the
flatness counts from the step after every size has been seen, and the region ways' peak
reserved must not exceed CuPy's pool's. Run::

    python bench/region_memory.py [--json PATH] [--plot PATH] [--quick] [--steps N]
        [--batches 64,128,256]
"""

import gc
import os
import sys
import time

import _common
import numpy as np
from _region_report import STEADY_FROM, mib_text, plot, report, summarize, targets, working_set
from _region_ways import COLUMNS, WAYS, make_way

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import _autograd as autograd  # noqa: E402  (shared with examples/train_digits.py)

SCRIPT = "region_memory"
DEPTH, WIDTH, BATCH = 8, 1024, 256
LR, WEIGHT_DECAY, SEED = 0.01, 1e-4, 0
STEPS, QUICK_STEPS = 500, 60
# A full collection with PyTorch loaded takes ~100 ms (docs/design.md): 500 of them would be most
# of the run, and 150 steps already show whether reserved memory stays flat.
GC_STEPS = 150
WARMUP_STEPS = 2         # on a throwaway pool, so that compiling CuPy's kernels is not timed


# Model -------------------------------------------------------------------------------------

def make_problem(xp, seed=SEED, depth=DEPTH, width=WIDTH, batch=BATCH):
    """A fresh model, one batch of inputs and labels (the same for every way)."""
    rng = np.random.RandomState(seed)
    model = autograd.MLP([width] * (depth + 1), rng, xp)
    x = xp.asarray(rng.standard_normal((batch, width)).astype(np.float32))
    labels = xp.asarray(rng.randint(0, width, size=batch).astype(np.int64))
    return model, x, labels


def train_step(model, x, labels, want_loss=False):
    """Forward, backward and update; the loss as a float if asked (that synchronizes).

    On return nothing of the step is referenced from outside: its tape is cyclic garbage.
    """
    loss = autograd.mean(autograd.softmax_cross_entropy(model(autograd.Tensor(x)), labels))
    loss.backward()                  # drops each gradient once it has been passed on
    autograd.sgd_update(model.parameters(), LR, WEIGHT_DECAY)   # unfused: many temporaries
    return float(loss.data) if want_loss else None


# Running -----------------------------------------------------------------------------------

def batch_sizes(steps, batches=None, seed=SEED):
    """The batch of each step: ``BATCH`` for every step, or drawn from ``batches`` (fixed
    seed, the same for every way)."""
    if not batches:
        return [BATCH] * steps
    return [int(b) for b in np.random.default_rng(seed).choice(batches, size=steps)]


def all_seen_step(sizes):
    """The 1-based step after which every batch size has been seen once."""
    seen = set()
    for step, size in enumerate(sizes, 1):
        seen.add(size)
        if len(seen) == len(set(sizes)):
            return step
    return len(sizes)


def train(cp, way, steps, batches=None):
    """``steps`` training steps of a fresh model, every allocation served by ``way``; with
    ``batches``, step ``k`` trains on the first ``batch_sizes(steps, batches)[k]`` rows.

    Returns ``(per_step, losses)``: lists per column of :data:`COLUMNS`, and the loss at the
    first and the last step. A step's time runs from before its forward to after
    ``after_step`` (the way's collection, if any) and a synchronization of the stream.
    """
    per_step = {column: [] for column in COLUMNS}
    losses = {}
    sizes = batch_sizes(steps, batches)
    stream = cp.cuda.get_current_stream()
    with cp.cuda.using_allocator(way.allocator):
        model, x, labels = make_problem(cp, batch=max(sizes))
        stream.synchronize()
        for step in range(1, steps + 1):
            way.before_step()
            start = time.perf_counter()
            b = sizes[step - 1]
            with way.scope:
                loss = train_step(model, x[:b], labels[:b], want_loss=step in (1, steps))
            way.after_step()
            stream.synchronize()
            per_step["ms"].append(1e3 * (time.perf_counter() - start))
            sample = way.sample()
            for column in COLUMNS[1:]:
                per_step[column].append(getattr(sample, column))
            if loss is not None:
                losses[str(step)] = loss
    return per_step, losses


def run_way(name, cp, steps, batches=None):
    """One way from a fresh state: its record for the JSON (or an error)."""
    gc.collect()
    start = time.perf_counter()
    record = {"label": WAYS[name]}
    try:
        way = make_way(name, cp)
    except Exception as exc:  # a way that cannot start is reported, the others go on
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["seconds"] = time.perf_counter() - start
        return record
    record["peak_measured"] = way.peak_measured
    try:
        record["per_step"], record["losses"] = train(cp, way, steps, batches)
    except Exception as exc:  # a failed way is reported, the others go on
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["counters"] = way.counters()
    gc.collect()                 # what the default collector left, so close() frees it all
    way.close()
    record["seconds"] = time.perf_counter() - start
    return record


def warm_up(cp):
    """A few steps on a throwaway CuPy pool: compiles CuPy's kernels outside every way."""
    start = time.perf_counter()
    way = make_way("cupy-default", cp)
    train(cp, way, WARMUP_STEPS)
    gc.collect()
    way.close()
    return time.perf_counter() - start


# Main --------------------------------------------------------------------------------------

def import_torch():
    """Import PyTorch, as a real job would before anything else: a record for the JSON."""
    try:
        import torch
    except Exception as exc:  # missing or broken: the run goes on, and says so
        return {"imported": False, "version": None,
                "reason": " ".join(f"{type(exc).__name__}: {exc}".split())}
    return {"imported": True, "version": torch.__version__, "reason": None}


def _skip_without(reason, json_path):
    """One line, a JSON record with the environment, exit status 0."""
    print(f"{SCRIPT}: skipped: {reason}")
    if json_path:
        _common.write_json(json_path, {"script": SCRIPT, "skipped": reason,
                                       "env": _common.environment()})
    return 0


def default_plot_path(json_path):
    folder = os.path.dirname(os.path.abspath(json_path)) if json_path else os.getcwd()
    return os.path.join(folder, f"{SCRIPT}.png")


def main(argv=None):
    p = _common.parser(__doc__.splitlines()[0],
                       no_simulated="it trains a CuPy model on the GPU")
    p.add_argument("--steps", type=int,
                   help=f"training steps per way (default {STEPS}; --quick: {QUICK_STEPS})")
    p.add_argument("--gc-steps", type=int, default=GC_STEPS,
                   help=f"at most this many steps for cupy-gc (default {GC_STEPS})")
    p.add_argument("--batches", metavar="N,N,...",
                   help="draw each step's batch from these sizes (varying shapes)")
    p.add_argument("--plot", metavar="PATH",
                   help=f"PNG of reserved memory over the steps (default: {SCRIPT}.png beside "
                        "--json, else in the current folder)")
    args = p.parse_args(argv)
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    try:
        batches = [int(b) for b in args.batches.split(",")] if args.batches else None
    except ValueError:
        p.error(f"--batches must be comma-separated ints, got {args.batches!r}")
    if batches and min(batches) < 1:
        p.error("--batches must be positive")
    if steps < STEADY_FROM or args.gc_steps < STEADY_FROM:
        p.error(f"--steps and --gc-steps must be at least {STEADY_FROM}")
    if args.simulated:
        return _skip_without("it trains a CuPy model on the GPU; --simulated has none",
                             args.json)
    _, reason = _common.gpu_pool()
    if reason is not None:
        _common.skip(SCRIPT, reason, args.json)
    torch = import_torch()
    cp, reason = _common.optional_import("cupy")
    if cp is None:
        return _skip_without(f"needs CuPy ({' '.join(reason.split())})", args.json)
    cp.cuda.Device(0).use()
    start = time.perf_counter()
    out = {"script": SCRIPT, "unit": {"bytes": "bytes", "ms": "ms per step"},
           "model": {"depth": DEPTH, "width": WIDTH, "batch": BATCH, "dtype": "float32",
                     "lr": LR, "weight_decay": WEIGHT_DECAY, "seed": SEED},
           "steps": steps, "gc_steps": min(steps, args.gc_steps), "steady_from": STEADY_FROM,
           "batches": batches,
           "quick": args.quick, "torch": torch, "gc_tracked_objects": len(gc.get_objects()),
           "gc_thresholds": gc.get_threshold(), "env": _common.environment()}
    print(f"  warm-up ({WARMUP_STEPS} steps, throwaway CuPy pool): {warm_up(cp):.1f} s",
          file=sys.stderr)
    out["ways"] = {}
    for name in WAYS:
        n = out["gc_steps"] if name == "cupy-gc" else steps
        record = out["ways"][name] = run_way(name, cp, n, batches)
        last = record["per_step"]["reserved"][-1] if "per_step" in record else None
        error = f"; error: {record['error']}" if "error" in record else ""
        print(f"  {name}: {n} steps, {record['seconds']:.1f} s, reserved at the end "
              f"{mib_text(last)} MiB{error}", file=sys.stderr, flush=True)
    out["working_set"] = working_set(out["ways"], varying=bool(batches))
    ws_bytes = None if out["working_set"] is None else out["working_set"]["bytes"]
    flat_from = max(2, all_seen_step(batch_sizes(steps, batches)) + 1) if batches else 2
    out["summaries"] = {name: summarize(r, ws_bytes, flat_from)
                        for name, r in out["ways"].items()
                        if "per_step" in r}
    out["targets"] = targets(out["summaries"], ws_bytes)
    out["plot"], out["plot_skipped"] = plot(out, args.plot or default_plot_path(args.json))
    return _common.finish(out, start, report, args.json)


if __name__ == "__main__":
    sys.exit(main())
