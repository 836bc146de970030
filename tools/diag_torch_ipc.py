"""What PyTorch's own CUDA IPC does with a tensor of a ``gpupool.torch.mempool()`` (GPU only).

``gpupool.torch`` sends such tensors as gpupool IPC handles; this bypasses that reducer and calls
PyTorch's (``torch.multiprocessing.reductions.reduce_tensor``), to record what users would get
without it. From PyTorch's source (c10/cuda/CUDACachingAllocator.cpp, ``shareIpcHandle``): the
handle is ``cudaIpcGetMemHandle`` of PyTorch's segment start, which here is a gpupool block, and
the offset is counted from that start. A gpupool block is not a whole ``cudaMalloc``
allocation: on upstream "driver" it may sit inside a larger ``cuMemAlloc`` segment (the
receiver then maps that segment's start and adds the offset from the block: wrong bytes, or a
refused handle, whichever the driver does with an interior pointer), on "vmm" it is
virtual-memory pages, which ``cudaIpcGetMemHandle`` refuses.

    python tools/diag_torch_ipc.py            # both upstreams, one line each

Each line: the upstream, the tensor's offset in its ``cuMemAlloc`` allocation, and the outcome
("right bytes", "WRONG bytes: ...", or the error).
"""

import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys
import torch, torch.multiprocessing as mp
from torch.multiprocessing import reductions
import gpupool, gpupool.torch

def consumer(rebuild, args, results):
    try:
        t = rebuild(*args)
        results.put(("ok", t[:4].tolist()))
    except Exception as exc:
        results.put(("error", f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"))

if __name__ == "__main__":
    pool = gpupool.get_pool(0)
    big = pool.allocate(160 << 20)          # reserved 160 MiB: shared segments of 20 MiB
    first = pool.allocate(1 << 20)          # the start of a shared segment
    first.memset(0)
    with torch.cuda.use_mem_pool(gpupool.torch.mempool()):
        t = torch.arange(1024, dtype=torch.float32, device="cuda") + 1
    torch.cuda.synchronize()
    ptr = t.untyped_storage().data_ptr()
    from cuda.bindings import driver
    _, base, _ = driver.cuMemGetAddressRange(ptr)
    offset = ptr - int(base)
    try:
        rebuild, args = reductions.reduce_tensor(t)     # PyTorch's own, not gpupool's
    except Exception as exc:
        print(json.dumps([offset, f"refused at the sender: {type(exc).__name__}: "
                                  f"{' '.join(str(exc).split())[:200]}"]))
        sys.exit(0)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=consumer, args=(rebuild, args, results))
    p.start()
    kind, value = results.get(timeout=120)
    p.join(60)
    if kind == "ok":
        value = "right bytes" if value == [1.0, 2.0, 3.0, 4.0] else f"WRONG bytes: {value}"
    print(json.dumps([offset, value]))
"""


def main():
    for upstream in ("driver", "vmm"):
        proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "GPUPOOL_UPSTREAM": upstream})
        lines = proc.stdout.splitlines()
        if proc.returncode or not lines:
            print(f"{upstream}: failed (rc {proc.returncode}): {proc.stderr.strip()[-400:]}")
            continue
        offset, outcome = json.loads(lines[-1])
        print(f"{upstream}: tensor at offset {offset} of its cuMemAlloc allocation: {outcome}")


if __name__ == "__main__":
    main()
