"""Scenarios of tests/test_torch.py that need a fresh process (``gpupool.torch.use()`` must come
before PyTorch initializes CUDA, and an out-of-memory test should not leave its state behind).

``python tests/torch_child.py SCENARIO`` prints one JSON object on its last line of stdout.
Scenarios: ``train-native``, ``train-use``, ``train-mempool``, ``too-late``, ``oom-use``,
``oom-mempool``, ``region-ptr``, ``snapshot-use PATH``. Needs a GPU and a CUDA build of
PyTorch.
"""

import contextlib
import json
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS

import torch  # noqa: E402

import gpupool  # noqa: E402
import gpupool.torch  # noqa: E402

MiB = 1 << 20
STEPS = 8
LIMIT = 64 * MiB


def train(mode):
    """A 64-128-10 MLP, SGD with momentum, one batch per step, a region per step on gpupool.

    ``mode``: ``native`` (PyTorch's allocator), ``use`` or ``mempool``. Returns the losses,
    the bytes reserved after each step and the pool's allocation count.
    """
    torch.use_deterministic_algorithms(True)
    if mode == "use":
        gpupool.torch.use()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    data = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, 32, 64, generator=data)
    ys = torch.randint(0, 10, (STEPS, 32), generator=data)
    routed = (torch.cuda.use_mem_pool(gpupool.torch.mempool()) if mode == "mempool"
              else contextlib.nullcontext())
    losses, reserved = [], []
    with routed:
        model, xs, ys = model.cuda(), xs.cuda(), ys.cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        pool = gpupool.get_pool(0)
        region = (contextlib.nullcontext() if mode == "native"
                  else gpupool.Region(pool=pool, scope="process"))
        for step in range(STEPS):
            with region:
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(xs[step]), ys[step])
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                del loss
            torch.cuda.synchronize()
            reserved.append(torch.cuda.memory_reserved() if mode == "native"
                            else pool.stats().reserved_bytes)
    return {"losses": losses, "reserved": reserved,
            "num_allocs": None if mode == "native" else pool.stats().num_allocs}


def describe(exc):
    return {"type": type(exc).__qualname__, "module": type(exc).__module__,
            "torch_oom": isinstance(exc, torch.OutOfMemoryError),
            "gpupool_oom": isinstance(exc, gpupool.OutOfMemoryError), "message": str(exc)}


def attempt(action):
    """Run action(); None if it returned, else what it raised, described."""
    try:
        action()
    except Exception as exc:
        return describe(exc)
    return None


def too_late():
    torch.zeros(1, device="cuda")
    error = attempt(gpupool.torch.use)
    return {"error": error, "backend": torch.cuda.memory.get_allocator_backend()}


def oom_use():
    """Out of memory under use(): in a forward op, then in backward (PyTorch's own thread)."""
    pool = gpupool.Pool(device=0, hard_limit=LIMIT)
    gpupool.torch.use(pool)
    out = {"forward": attempt(lambda: torch.empty(2 * LIMIT, dtype=torch.uint8, device="cuda"))}
    x = torch.zeros(16 * MiB // 4, device="cuda", requires_grad=True)
    y = (x * 2).sum()                       # its 16 MiB temporary goes back to the pool
    filler = torch.empty(40 * MiB, dtype=torch.uint8, device="cuda")
    # 16 (x) + 40 (filler) + 2 (a slab for the scalars) MiB reserved: backward's 16 MiB
    # gradient of x cannot fit under the 64 MiB limit.
    out["backward"] = attempt(y.backward)
    del filler, y
    out["after"] = float(torch.ones(1000, device="cuda").sum())
    out["last_error"] = gpupool.torch.last_error()
    out["num_ooms"] = pool.memory_stats()["num_ooms"]
    return out


def oom_mempool():
    pool = gpupool.Pool(device=0, hard_limit=LIMIT)
    with torch.cuda.use_mem_pool(gpupool.torch.mempool(pool)):
        out = {"forward": attempt(
            lambda: torch.empty(2 * LIMIT, dtype=torch.uint8, device="cuda"))}
        out["after"] = float(torch.ones(1000, device="cuda").sum())
    out["last_error"] = gpupool.torch.last_error()
    out["num_ooms"] = pool.memory_stats()["num_ooms"]
    return out


def region_ptr():
    """Under use(), a step's tensors come back at the same addresses from the region."""
    gpupool.torch.use()
    torch.ones(1, device="cuda")
    pool = gpupool.get_pool(0)
    region = gpupool.Region(pool=pool, scope="process")
    ptrs, reserved = [], []
    for _ in range(5):
        with region:
            x = torch.empty(MiB, device="cuda")              # 4 MiB of float32
            y = x.fill_(1) * 2
            ptrs.append([x.data_ptr(), y.data_ptr()])
            del x, y
        reserved.append(pool.stats().reserved_bytes)
    stats = region.stats()
    return {"ptrs": ptrs, "reserved": reserved, "hits": stats.cache_hits,
            "misses": stats.cache_misses, "cached": stats.cached_bytes}


def snapshot_use():
    """Under use(), with the memory history recording: tensors kept and freed, a matmul (cuBLAS
    workspace), a backward pass (PyTorch's autograd thread); the snapshot pickle written to
    sys.argv[2]. Returns the kept and freed tensors' (pointer, bytes)."""
    gpupool.torch.use()
    gpupool.record_memory_history(max_entries=100_000)
    kept = [torch.empty(1000, dtype=torch.uint8, device="cuda"),
            torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")]
    z = torch.ones(256, 256, device="cuda", requires_grad=True)
    w = (z @ z).sum()
    w.backward()
    freed = [(t.data_ptr(), t.untyped_storage().nbytes()) for t in (z, w)]
    del z, w
    torch.cuda.synchronize()
    gpupool.dump_snapshot(sys.argv[2])
    pool = gpupool.get_pool(0)
    return {"kept": [(t.data_ptr(), t.untyped_storage().nbytes()) for t in kept],
            "freed": freed, "expandable": pool.upstream.expandable,
            "reserved_bytes": pool.stats().reserved_bytes}


SCENARIOS = {
    "train-native": lambda: train("native"),
    "train-use": lambda: train("use"),
    "train-mempool": lambda: train("mempool"),
    "too-late": too_late,
    "oom-use": oom_use,
    "oom-mempool": oom_mempool,
    "region-ptr": region_ptr,
    "snapshot-use": snapshot_use,
}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]]()))
