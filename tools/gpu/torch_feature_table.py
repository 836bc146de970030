"""The PyTorch feature table, filled in on a GPU: each PyTorch feature under PyTorch's
allocator, under ``gpupool.torch.mempool()``, under ``gpupool.torch.use()`` with gpupool's
allocator and with the pluggable fallback, each in a fresh process (tests/torch_child.py
FEATURE-MODE).

::

    python tools/gpu/torch_feature_table.py [--json PATH] [--jobs 8]

Prints the table (Markdown) and writes every child's result to ``--json``:
tests/adapters/test_torch.py reads it back when ``GPUPOOL_TORCH_CHILD_RESULTS`` names that
file, instead of running the same children again (tools/gpu/torch-alloc-check.sh does both).
Exit status 0 when every cell of the
native, mempool and use columns is ok (the pluggable column documents what the fallback
lacks), else 1.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHILD = REPO / "tests" / "torch_child.py"
ROWS = [
    ("cudnn-benchmark", "`torch.backends.cudnn.benchmark = True` (ResNet forward + backward)"),
    ("compile", "`torch.compile(model)`"),
    ("reduce-overhead", '`torch.compile(model, mode="reduce-overhead")` (CUDA graphs)'),
    ("graph", "`torch.cuda.graph` capture + replay of a Linear"),
    ("autocast-loader", "bf16 autocast, `DataLoader(pin_memory=True, num_workers=2)`"),
    ("stats", "`memory_allocated()`, `max_memory_allocated()`, `memory_reserved()`, "
              "`memory_stats()`, `reset_peak_memory_stats()`, `empty_cache()`, "
              "`mem_get_info()`"),
    ("record-stream", "`Tensor.record_stream` (slow kernel on a side stream)"),
    ("mempool-object", "`torch.cuda.MemPool` + `use_mem_pool`"),
]
# (heading, mode, GPUPOOL_TORCH_ALLOCATOR)
COLUMNS = [
    ("PyTorch's allocator", "native", "gpupool"),
    ("`gpupool.torch.mempool()`", "mempool", "gpupool"),
    ("`gpupool.torch.use()`", "use", "gpupool"),
    ("`use()`, pluggable fallback", "use", "pluggable"),
]
REQUIRED = ("native", "mempool", "use:gpupool")


def key(scenario, allocator):
    """The results file's key of a child (tests/adapters/test_torch.py looks it up the same way)."""
    return f"{scenario}|{allocator}"


def run(scenario, allocator, timeout=150):
    env = dict(os.environ, GPUPOOL_TORCH_ALLOCATOR=allocator)
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(CHILD), scenario], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": {"type": "Timeout", "message": f"over {timeout} s"}}
    lines = proc.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        out = {"ok": False, "error": {"type": f"exit {proc.returncode}",
                                      "message": " | ".join(tail)}}
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def cell(out):
    if out.get("ok"):
        return f"ok ({out['seconds']:.0f} s)"
    error = out.get("error") or {}
    message = str(error.get("message", "")).replace("|", "/").replace("\n", " ")
    return f"**{error.get('type', 'error')}**: {message[:160]}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="torch_features.json")
    p.add_argument("--jobs", type=int, default=8)
    args = p.parse_args(argv)
    jobs = [(f"{row}-{mode}", allocator) for row, _ in ROWS for _, mode, allocator in COLUMNS]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = dict(zip((key(*j) for j in jobs), pool.map(lambda j: run(*j), jobs),
                           strict=True))
    Path(args.json).write_text(json.dumps(results, indent=1))
    print("| feature | " + " | ".join(h for h, _, _ in COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    failed = []
    for row, title in ROWS:
        cells = []
        for _, mode, allocator in COLUMNS:
            out = results[key(f"{row}-{mode}", allocator)]
            cells.append(cell(out))
            column = mode if mode != "use" else f"use:{allocator}"
            if column in REQUIRED and not out.get("ok"):
                failed.append(f"{row} under {column}")
        print(f"| {title} | " + " | ".join(cells) + " |")
    use = [results[key(f"{row}-use", "gpupool")] for row, _ in ROWS]
    print(f"\nuse() allocator: {sorted({u.get('allocator', '?') for u in use})}; "
          f"failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
