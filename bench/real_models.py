"""Device memory of real PyTorch training runs, each (model, allocator) in a fresh process.

The ruler is the same for every allocator: device memory in use (``cuMemGetInfo``: total -
free) above the baseline taken once CUDA is initialized (a one-element tensor made and freed),
sampled by a thread every half millisecond and at the end of each step's forward and backward.
Reported per (model, allocator): the peak of that ruler over the run, the allocator's own peak
reserved and peak in use bytes where it reports them, the ruler after step 3 and after the
last step, median ms per step (steps after the third, the GPU synchronized at each step's
end) and the final loss (equal across a model's allocators: same seed, same data).
Beside them, the floor: the most bytes in use at once by the allocator's own counter
(``torch.cuda.max_memory_allocated``, gpupool's peak in use) plus the device memory used
outside the allocator (its peak less its own peak reserved), taken from the ``torch.exp``
run (else ``torch``, else the first run with both counters), and each run's excess over it
(MiB and ratio): no allocator can go below the floor.
Models (``_models.py``; ``--models``, by default the first five):
ResNet-50 batch 64 fp32, GPT-2 small batch 8 seq 512, GPT-2 at sequence lengths drawn from
128..1024, ViT-B/16 batch 32 (not tuned on when added; its trace set the placement of small
blocks on 2026-12-02) and BERT base at sequence lengths drawn from 64..512 (not tuned on);
GPT-2 small and a Llama-style 374 M with activation checkpointing under bf16 autocast at
batches and lengths drawn per step (``gpt2-ckpt``, ``llama-ckpt``), and GPT-2's greedy
``generate()`` with a growing KV cache under ``torch.inference_mode()`` (``gpt2-generate``,
no optimizer; its "loss" is a checksum of the tokens generated).
Allocators (``--columns``; by default all but ``gp``,
``gp.region``, ``gp.driver.region`` and ``gp.vmm.nomag``):

=================  ================================================================
``torch``          PyTorch's caching allocator
``torch.exp``      the same with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
``rmm.pool``       RMM's pool resource (``rmm.mr.PoolMemoryResource`` over
                   ``CudaMemoryResource``, initial size 0) through
                   ``rmm.allocators.torch.rmm_torch_allocator``
``rmm.async``      RMM's ``CudaAsyncMemoryResource`` through the same allocator
``gp``             ``gpupool.torch.use()`` (the default upstream, ``GPUPOOL_UPSTREAM``)
``gp.region``      the same with ``with gpupool.Region(scope="process"):`` per step
``gp.driver``...   ``gp``/``gp.region`` on one upstream: ``.driver``, ``.vmm``
``gp.vmm.nomag``   ``gp.vmm`` with ``GPUPOOL_MAGAZINES=0`` (asked for by name only)
``gp.vmm.plan``    ``gp.vmm`` with ``gpupool.Region(scope="process", plan=True)`` per step
                   (a planned region)
=================  ================================================================

RMM columns are skipped with their reason where RMM is not installed, ``gp.vmm.plan`` where
``gpupool.Region`` takes no ``plan`` argument. ``--dry-run`` lists the runs and the skips
without starting any. ``--json PATH`` is written after every run too (with ``"partial":
true`` until the last), so a run cut short keeps what it measured. ``--trace-dir DIR``
adds, per model, a run on PyTorch's allocator under its memory history that saves the
allocation trace as ``DIR/MODEL.npz`` (``alloc_trace``), step starts in its ``meta``, for
``trace_replay.py`` and CPU replays. Run::

    python bench/real_models.py [--json PATH] [--plot PATH] [--steps 30]
        [--models resnet50,gpt2,gpt2-varlen,vit,bert-varlen,gpt2-ckpt,llama-ckpt,gpt2-generate]
        [--columns torch,gp,...] [--cudnn-benchmark] [--dry-run]

``--simulated`` skips it (it trains PyTorch models on the GPU).
"""

import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext

import _common
import _models
import _samplers
import _run_line
import record_trace
from _common import MiB, format_table

SCRIPT = "real_models"
STEPS = 30
QUICK_STEPS = 5
STEADY_FROM = 3            # ms/step medians over the steps after this many
CHILD_TIMEOUT = 300        # seconds per (model, allocator) process
SAMPLE_S = 0.0005          # the sampler thread's period
REGION = {"scope": "process"}               # the region entered around each step
NO_SIMULATED = "it trains PyTorch models on the GPU"
PLANNED = {"scope": "process", "plan": True}  # the same, planned

# key -> (description, environment, allocator, Region's arguments per step or None)
COLUMNS = {
    "torch": ("PyTorch caching allocator", {}, "torch", None),
    "torch.exp": ("PyTorch, expandable_segments:True",
                  {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "torch", None),
    "rmm.pool": ("RMM pool (PoolMemoryResource over CudaMemoryResource)", {}, "rmm.pool", None),
    "rmm.async": ("RMM async (CudaAsyncMemoryResource)", {}, "rmm.async", None),
    "gp": ("gpupool.torch.use(), default upstream", {}, "gpupool", None),
    "gp.region": ("gpupool.torch.use() + Region(scope='process') per step", {}, "gpupool",
                  REGION),
    "gp.driver": ("gpupool.torch.use(), driver upstream", {"GPUPOOL_UPSTREAM": "driver"},
                  "gpupool", None),
    "gp.driver.region": ("gpupool driver upstream + region", {"GPUPOOL_UPSTREAM": "driver"},
                         "gpupool", REGION),
    "gp.vmm": ("gpupool.torch.use(), vmm upstream", {"GPUPOOL_UPSTREAM": "vmm"}, "gpupool",
               None),
    "gp.vmm.region": ("gpupool vmm upstream + region", {"GPUPOOL_UPSTREAM": "vmm"}, "gpupool",
                      REGION),
    "gp.vmm.plan": ("gpupool vmm upstream + Region(scope='process', plan=True) per step",
                    {"GPUPOOL_UPSTREAM": "vmm"}, "gpupool", PLANNED),
    # Not a default column: the pool without the threads' magazines (what they cost
    # when PyTorch's autograd thread allocates while the main thread's magazine holds blocks).
    "gp.vmm.nomag": ("gpupool.torch.use(), vmm upstream, GPUPOOL_MAGAZINES=0",
                     {"GPUPOOL_UPSTREAM": "vmm", "GPUPOOL_MAGAZINES": "0"}, "gpupool", None),
}
DEFAULT_COLUMNS = ("torch", "torch.exp", "rmm.pool", "rmm.async", "gp.vmm", "gp.vmm.region",
                   "gp.vmm.plan", "gp.driver")
ANCHOR = "torch.exp"
FLOOR_FROM = (ANCHOR, "torch")   # the runs the floor is taken from, first present first


# The child: one (model, allocator) ---------------------------------------------------------

def _install_allocator(kind):
    """Route PyTorch's CUDA allocations before its first one; returns a ``peaks()`` callable:
    (peak reserved, peak in use) of the allocator's own counters, bytes, each None where it
    has no such counter. Peak in use is the most bytes of blocks handed out at once (the
    requests rounded to the allocator's block sizes): no allocator can reserve less."""
    import torch

    if kind == "torch":
        return lambda: (torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated())
    if kind.startswith("rmm."):
        import rmm
        from rmm.allocators.torch import rmm_torch_allocator

        if kind == "rmm.pool":
            resource = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(),
                                                 initial_pool_size=0)
        else:
            resource = rmm.mr.CudaAsyncMemoryResource()
        rmm.mr.set_current_device_resource(resource)
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
        return lambda: (None, None)
    import gpupool
    import gpupool.torch

    gpupool.torch.use()

    def peaks():
        stats = gpupool.get_pool(0).stats()
        return stats.peak_reserved_bytes, stats.peak_in_use_bytes

    return peaks


def child(model, column, steps, trace_path, cudnn_benchmark):
    """Train ``model`` on allocator ``column``; returns the run's record."""
    _description, _env, kind, region_args = COLUMNS[column]
    peaks = _install_allocator(kind)
    import torch

    torch.backends.cudnn.benchmark = cudnn_benchmark
    native = os.environ.get(_samplers.ENV) == "native"
    sampler = (_samplers.NativeSampler if native else _samplers.Sampler)(SAMPLE_S)
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    baseline = sampler.used()
    sampler.take_peak()
    if trace_path:
        record_trace.history_on(torch)
    region = None
    if region_args is not None:
        import gpupool

        region = gpupool.Region(**region_args)
    sampler.start()
    work = _models.make(model, steps)
    used_after, peak_in_step, ms, losses, exit_ms, phase_ms = [], [], [], [], [], []
    cpu_ms = []     # the process's CPU time (all its threads): host work, not waits
    clock = _run_line.PhaseClock(sampler.sample)
    for i in range(steps):
        if trace_path:
            record_trace.mark_step(torch)
        start, cpu_start = time.perf_counter(), time.process_time()
        with region if region is not None else nullcontext():
            loss = _models.step(work, i, on_phase=clock)
            losses.append(float(loss))          # synchronizes the loss's stream
            del loss
            body_end = time.perf_counter()
            phase_ms.append(clock.split(start, body_end))
        exit_ms.append((time.perf_counter() - body_end) * 1e3)     # the region's exit
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - start) * 1e3)
        cpu_ms.append((time.process_time() - cpu_start) * 1e3)
        used_after.append(sampler.used() - baseline)
        peak_in_step.append(sampler.take_peak() - baseline)
    sampler.stop()
    peak_reserved, peak_in_use = peaks()
    record = {
        "model": model, "column": column, "steps": steps, "baseline_bytes": baseline,
        "per_step": {"used_after": used_after, "peak": peak_in_step, "ms": ms,
                     "loss": losses, "exit_ms": exit_ms, "phase_ms": phase_ms,
                     "cpu_ms": cpu_ms},
        "peak_bytes": max(peak_in_step), "allocator_peak_reserved": peak_reserved,
        "allocator_peak_in_use": peak_in_use,
        "cudnn_benchmark": cudnn_benchmark,
    }
    if kind == "gpupool":
        import gpupool.torch

        record["torch_allocator"] = gpupool.torch.allocator()   # gpupool's, or the fallback
        record["pool"] = gpupool.get_pool(0).stats().as_dict()  # hits, misses, upstream calls
    if region is not None:
        record["region"] = region.stats().as_dict()
    if trace_path:
        record["trace"] = _save_trace(torch, model, steps, trace_path)
    return record


def _save_trace(torch, model, steps, path):
    """Stop the memory history, drop the step markers (their positions become
    ``meta["step_starts"]``) and save the trace; returns its summary."""
    import alloc_trace

    trace = record_trace.history_trace(torch, model, steps, _models.DESCRIPTIONS[model],
                                       marked=True)
    alloc_trace.save(trace, path)
    return {"path": path, **trace.summary(), "step_starts": len(trace.meta["step_starts"])}


# The parent: every (model, allocator) in its own process -----------------------------------

def _rmm_missing():
    try:
        import importlib.util

        found = importlib.util.find_spec("rmm") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "rmm is not installed (pip install rmm-cu13)"


def _plan_missing():
    """None where ``gpupool.Region`` takes the planned columns' arguments (``plan=True``);
    else why those columns are skipped. Tried on a pool over the simulated device, so that
    this process never touches the GPU."""
    try:
        import gpupool
        from gpupool.testing import SimulatedDevice
    except ImportError as exc:
        return f"gpupool not importable: {exc}"
    try:
        gpupool.Region(pool=gpupool.Pool(upstream=SimulatedDevice()), **PLANNED)
    except TypeError as exc:
        return f"gpupool.Region takes no plan argument in this build ({exc})"
    return None


def skip_reasons(columns):
    """{column: why this machine skips it} for the columns of ``columns`` it cannot run:
    RMM's where RMM is not installed, the planned ones where ``Region`` takes no plan."""
    checks = {"rmm": (lambda c: COLUMNS[c][2].startswith("rmm"), _rmm_missing),
              "plan": (lambda c: "plan" in (COLUMNS[c][3] or {}), _plan_missing)}
    reasons = {}
    for wants, missing in checks.values():
        asked = [c for c in columns if wants(c)]
        why = missing() if asked else None
        reasons.update(dict.fromkeys(asked, why) if why else {})
    return reasons


def run_child(model, column, steps, trace_path, cudnn_benchmark):
    """Run one child process; its record, or ``{"error": ...}``."""
    env = dict(os.environ, **COLUMNS[column][1])
    env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", model, column,
           "--steps", str(steps)]
    if trace_path:
        cmd += ["--trace-path", trace_path]
    if cudnn_benchmark:
        cmd.append("--cudnn-benchmark")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"error": f"killed after {CHILD_TIMEOUT} s"}
    seconds = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = " | ".join(proc.stderr.strip().splitlines()[-4:])
        return {"error": f"rc={proc.returncode}: {tail}", "seconds": seconds}
    record = json.loads(lines[-1])
    record["seconds"] = seconds
    return record


def summarize(record):
    """The table's numbers of one run (bytes, ms)."""
    per = record["per_step"]
    steady = per["ms"][STEADY_FROM:] or per["ms"]
    return {"peak": record["peak_bytes"], "own_peak_reserved": record["allocator_peak_reserved"],
            "own_peak_in_use": record.get("allocator_peak_in_use"),
            "after_step3": per["used_after"][min(2, len(per["used_after"]) - 1)],
            "after_last": per["used_after"][-1], "ms": statistics.median(steady),
            "final_loss": per["loss"][-1],
            "growth_last_third": per["used_after"][-1]
            - per["used_after"][len(per["used_after"]) * 2 // 3]}


def _mib(nbytes):
    return "-" if nbytes is None else f"{nbytes / MiB:,.0f}"


def floor(summaries):
    """The floor of one model's runs ({column: summary}): ``(bytes, in use, outside,
    column)``, or None where no run has both of its allocator's own peaks.

    In use is the most bytes of blocks handed out at once, by the allocator's own counter;
    outside, the device memory used outside the allocator (the run's peak less its own peak
    reserved); their sum is what no allocator can go below on the same ruler. Taken from the
    first of :data:`FLOOR_FROM` that ran, else from the first run with both peaks.
    """
    have = [k for k, s in summaries.items()
            if s.get("own_peak_in_use") and s.get("own_peak_reserved")]
    if not have:
        return None
    key = next((k for k in FLOOR_FROM if k in have), have[0])
    s = summaries[key]
    outside = s["peak"] - s["own_peak_reserved"]
    return s["own_peak_in_use"] + outside, s["own_peak_in_use"], outside, key


def report(out):
    lines = []
    for model in out["models"]:
        runs = out["runs"][model]
        anchor = runs.get(ANCHOR, {}).get("summary")
        torch_ms = runs.get("torch", {}).get("summary", {}).get("ms")
        least = floor({k: r["summary"] for k, r in runs.items() if "summary" in r})
        rows = []
        for column, run in runs.items():
            s = run.get("summary")
            if s is None:
                rows.append([column, run.get("skipped") or run.get("error", "?")[:90]] +
                            [""] * 10)
                continue
            if run.get("torch_allocator") == "pluggable":     # use()'s fallback served
                column = f"{column} (pluggable)"
            rows.append([column, _mib(s["peak"]),
                         f"{s['peak'] / anchor['peak']:.3f}" if anchor else "-",
                         f"{(s['peak'] - least[0]) / MiB:+,.0f}" if least else "-",
                         f"{s['peak'] / least[0]:.3f}" if least else "-",
                         _mib(s["own_peak_reserved"]), _mib(s["own_peak_in_use"]),
                         _mib(s["after_step3"]),
                         _mib(s["after_last"]), f"{s['ms']:.1f}",
                         f"{s['ms'] / torch_ms:.3f}" if torch_ms else "-",
                         f"{s['final_loss']:.4f}"])
        where = (f"; floor {_mib(least[0])} MiB: {least[3]}'s peak in use + outside its "
                 f"allocator" if least else "; no floor: no run with its allocator's peaks")
        lines.append(format_table(
            ["allocator", "peak MiB", f"/ {ANCHOR}", "excess MiB", "/ floor",
             "own peak reserved", "own peak in use", "after step 3",
             "after last", "ms/step", "/ torch", "final loss"], rows,
            f"\n{model}: {_models.DESCRIPTIONS[model]}, {out['steps']} steps (MiB above the "
            f"post-init baseline, cuMemGetInfo{where})"))
    lines += ["", *targets_text(out), "", "columns:"]
    lines += [f"  {key:18} {COLUMNS[key][0]}" for key in out["columns"]]
    return "\n".join(lines)


def targets_text(out):
    """One line per target of the memory issue that this run can judge."""
    lines = ["targets:"]
    for model in out["models"]:
        s = {k: r["summary"] for k, r in out["runs"][model].items() if "summary" in r}
        least = floor(s)
        if least:
            total, in_use, outside, key = least
            ratio = total / s[key]["peak"]
            aim = (f": the aim 0.95 is {'within reach' if ratio <= 0.95 else 'below it'}"
                   if key == ANCHOR else "")
            lines.append(f"  {model:12} floor: {_mib(in_use)} MiB in use at once + "
                         f"{_mib(outside)} outside {key}'s allocator = {_mib(total)} MiB = "
                         f"{ratio:.3f} of its peak{aim}")
        for key in (k for k in s if k.startswith("gp")):
            if ANCHOR in s:
                ratio = s[key]["peak"] / s[ANCHOR]["peak"]
                lines.append(f"  {model:12} {key:16} peak / {ANCHOR} = {ratio:.3f} (target <= 1, "
                             f"aim 0.95): {'met' if ratio <= 1 else 'MISSED'}")
            if key.endswith(".region") and key[:-len(".region")] in s:
                base = s[key[:-len(".region")]]["peak"]
                lines.append(f"  {model:12} {key:16} peak / without region = "
                             f"{s[key]['peak'] / base:.3f} (target <= 1): "
                             f"{'met' if s[key]['peak'] <= base else 'MISSED'}")
            if "ms_least" in s[key] and "ms_least" in s.get(ANCHOR, {}):
                ratio = s[key]["ms_least"] / s[ANCHOR]["ms_least"]
                lines.append(f"  {model:12} {key:16} each step's least ms / {ANCHOR}'s = "
                             f"{ratio:.3f} over {len(s[key]['ms_runs'])} runs "
                             f"(target <= 1.02): {'met' if ratio <= 1.02 else 'MISSED'}")
            if "torch" in s:
                ratio = s[key]["ms"] / s["torch"]["ms"]
                lines.append(f"  {model:12} {key:16} ms / torch = {ratio:.3f} (target <= 1.02): "
                             f"{'met' if ratio <= 1.02 else 'MISSED'}")
    return lines


def plot(out, path):
    """Device memory after each step, per model and allocator; (path, None) or (None, why)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return None, f"matplotlib not importable: {exc}"
    fig, axes = plt.subplots(1, len(out["models"]), figsize=(6 * len(out["models"]), 4.5),
                             squeeze=False)
    for ax, model in zip(axes[0], out["models"], strict=True):
        for column, run in out["runs"][model].items():
            if "per_step" not in run:
                continue
            style = "-" if column.startswith("gp") else "--"
            steps = range(1, len(run["per_step"]["peak"]) + 1)
            ax.plot(steps, [b / MiB for b in run["per_step"]["peak"]], style, label=column)
        ax.set_title(model)
        ax.set_xlabel("step")
        ax.set_ylabel("peak device memory in the step, MiB")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path, None


def main(argv=None):
    p = _common.parser(__doc__.splitlines()[0], columns=True, no_simulated=NO_SIMULATED,
                       json_help="; written after every run too, with \"partial\": true "
                                 "until the last")
    p.add_argument("--steps", type=int, help=f"training steps (default {STEPS}; --quick: "
                                              f"{QUICK_STEPS})")
    p.add_argument("--models", default=",".join(_models.DEFAULT_MODELS),
                   help=f"comma-separated, among {', '.join(_models.MODELS)} (default: "
                        f"{','.join(_models.DEFAULT_MODELS)})")
    p.add_argument("--plot", metavar="PATH", help="PNG of memory over the steps")
    p.add_argument("--trace-dir", metavar="DIR",
                   help="also record each model's allocation trace on PyTorch's allocator")
    p.add_argument("--cudnn-benchmark", action="store_true",
                   help="torch.backends.cudnn.benchmark = True in every run")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "COLUMN"), help=argparse_hidden())
    p.add_argument("--trace-path", help=argparse_hidden())
    p.add_argument("--dry-run", action="store_true",
                   help="list the (model, allocator) runs and the skipped ones, run none")
    p.add_argument("--sampler", choices=_samplers.CHOICES, default="python",
                   help="what reads cuMemGetInfo every 0.5 ms beside the steps: a Python "
                        "thread (default) or a native one that never takes the GIL")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each (model, allocator), the columns interleaved (ABCABC): "
                        "ms/step is the median of the runs' medians (default %(default)s)")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be >= 1, not {args.steps}")
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    if args.child:
        model, column = args.child
        print(json.dumps(child(model, column, steps, args.trace_path, args.cudnn_benchmark)))
        return 0
    models = args.models.split(",")
    if set(models) - set(_models.MODELS):
        p.error(f"models must be among {_models.MODELS}")
    columns = _common.column_keys(
        p, ",".join(DEFAULT_COLUMNS) if args.columns is None else args.columns, COLUMNS)
    if args.repeat < 1:
        p.error(f"--repeat must be >= 1, not {args.repeat}")
    skipped = skip_reasons(columns)
    if args.dry_run:
        print(dry_run_text(models, columns, skipped, steps, args.trace_dir, args.repeat))
        torch, why = _common.cuda_torch()
        if torch is None:
            print(f"{SCRIPT} --dry-run: this machine would skip every run: {why}",
                  file=sys.stderr)
        return 0
    if args.simulated:
        _common.skip(SCRIPT, "--simulated: " + NO_SIMULATED, args.json)
    _common.cuda_torch_or_skip(SCRIPT, args.json)
    start = time.perf_counter()
    out = {"script": SCRIPT, "steps": steps, "models": models, "columns": columns,
           "unit": {"bytes": "bytes above the post-init baseline", "ms": "ms per step"},
           "cudnn_benchmark": args.cudnn_benchmark, "env": _common.environment(), "runs": {},
           "sampler": args.sampler}
    os.environ[_samplers.ENV] = args.sampler      # read by each run's process
    for model in models:
        runs = out["runs"][model] = {}
        if args.trace_dir:
            path = os.path.join(os.path.abspath(args.trace_dir), f"{model}.npz")
            record = run_child(model, "torch", steps, path, args.cudnn_benchmark)
            out.setdefault("traces", {})[model] = record.get("trace") or record
            print(f"  {model} trace: {record.get('trace') or record.get('error')}",
                  file=sys.stderr, flush=True)
        done = {column: [] for column in columns if column not in skipped}
        for _ in range(args.repeat):            # interleaved: every column once per round
            for column in done:
                record = run_child(model, column, steps, None, args.cudnn_benchmark)
                if "per_step" in record:
                    record["summary"] = summarize(record)
                done[column].append(record)
                s = record.get("summary")
                print(f"  {model} {column}: " + (
                    f"peak {_mib(s['peak'])} MiB (own reserved {_mib(s['own_peak_reserved'])}"
                    f", in use {_mib(s['own_peak_in_use'])}), {s['ms']:.1f} ms/step, "
                    f"{record['seconds']:.0f} s" + _run_line.planning(record)
                    + _run_line.phases(record, STEADY_FROM) if s else
                    record.get("error", "?")),
                    file=sys.stderr, flush=True)
                if args.json:       # the runs so far, should the call be cut before the end
                    runs.update({c: combine(r) for c, r in done.items() if r})
                    _common.write_json(args.json, dict(out, partial=True))
        runs.update({column: combine(done[column]) if column in done else
                     {"skipped": skipped[column]} for column in columns})
    if args.plot:
        out["plot"], out["plot_skipped"] = plot(out, args.plot)
    return _common.finish(out, start, report, args.json)


def combine(records):
    """One (model, allocator)'s record from its repeated runs: the run of the highest peak
    (memory is judged by the worst run), its ``summary["ms"]`` the median of every run's
    steady ms/step, ``summary["ms_runs"]`` those, ``summary["ms_least"]`` the mean over the
    steady steps of each step's least ms among the runs (the runs draw the same shapes at a
    step, and a shared machine's noise only adds time: the ruler for a ratio of a few
    percent), ``repeats`` the runs' records. A run that failed makes the whole a failure (its
    record)."""
    failed = [r for r in records if "summary" not in r]
    if failed or len(records) == 1:
        return failed[0] if failed else records[0]
    worst = dict(max(records, key=lambda r: r["summary"]["peak"]))
    ms = [r["summary"]["ms"] for r in records]
    least = [min(step) for step in zip(*(r["per_step"]["ms"] for r in records))]
    worst["summary"] = dict(worst["summary"], ms=statistics.median(ms), ms_runs=ms,
                            ms_least=statistics.fmean(least[STEADY_FROM:] or least))
    worst["repeats"] = records
    return worst


def dry_run_text(models, columns, skipped, steps, trace_dir, repeat=1):
    """The runs a call would make, one line each, and how many processes they take."""
    lines = [f"{SCRIPT} --dry-run: {steps} steps per run, each run a process of its own"
             + (f", {repeat} runs each, the columns interleaved" if repeat > 1 else "")]
    for model in models:
        if trace_dir:
            lines.append(f"  {model:14} trace      on torch -> {trace_dir}/{model}.npz")
        lines += [f"  {model:14} {column:16} " + (f"skipped: {skipped[column]}"
                                                   if column in skipped else "runs")
                  for column in columns]
    runs = len(models) * (repeat * len([c for c in columns if c not in skipped]) +
                          bool(trace_dir))
    lines.append(f"{runs} processes")
    return "\n".join(lines)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
