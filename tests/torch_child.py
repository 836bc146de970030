"""Scenarios of tests/adapters/test_torch.py (and tests/api/test_memory_viz.py) that need a fresh
process (``gpupool.torch.use()`` must come before PyTorch initializes CUDA, and an
out-of-memory test should not leave its state behind).

``python tests/torch_child.py SCENARIO`` prints one JSON object on its last line of stdout.
Scenarios: ``train-native``, ``train-use``, ``train-mempool``, ``too-late``, ``oom-use``,
``oom-mempool``, ``region-ptr``, ``snapshot-use PATH``, ``sleep-use``, and ``FEATURE-MODE`` for each PyTorch
feature (``FEATURES``: cudnn-benchmark, compile, reduce-overhead, graph,
autocast-loader, stats, record-stream, mempool-object) under MODE ``use``
(``gpupool.torch.use()``), ``mempool`` (inside
``torch.cuda.use_mem_pool(gpupool.torch.mempool())``) or ``native`` (PyTorch's own allocator).
``GPUPOOL_TORCH_ALLOCATOR`` in the environment chooses ``use()``'s allocator. Needs a GPU and a
CUDA build of PyTorch.
"""

import contextlib
import json
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS

import torch  # noqa: E402
import torch.utils.data  # noqa: E402

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
    # 16 (x) + 40 (filler) + 2 (a shared segment for the scalars) MiB reserved: backward's 16 MiB
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


# The features' table: each PyTorch feature, under a mode ----------------------------------------

def routed(mode):
    """Start the mode (use() first of all); the context manager the feature's work runs in."""
    if mode == "use":
        gpupool.torch.use()
    if mode == "mempool":
        return torch.cuda.use_mem_pool(gpupool.torch.mempool())
    return contextlib.nullcontext()


def pool_info(mode):
    """Which allocator serves, and gpupool's counters where gpupool serves."""
    info = {"allocator": gpupool.torch.allocator() if mode == "use" else mode}
    if mode != "native":
        info["pool"] = gpupool.get_pool(0).stats().as_dict()
    return info


class Block(torch.nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm, and the shortcut."""

    def __init__(self, channels):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            torch.nn.BatchNorm2d(channels), torch.nn.ReLU(),
            torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            torch.nn.BatchNorm2d(channels))

    def forward(self, x):
        return torch.relu(self.body(x) + x)


def small_resnet():
    """A ResNet-18-like network (stem, basic blocks, pooling, classifier) for 32x32 images."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 3, padding=1, bias=False), torch.nn.BatchNorm2d(64),
        torch.nn.ReLU(), Block(64), Block(64), torch.nn.Conv2d(64, 128, 3, stride=2, padding=1),
        Block(128), Block(128), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(128, 10))


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def feature_cudnn_benchmark(mode):
    """ResNet forward and backward with cuDNN's autotuner (which asks cacheInfo and calls
    emptyCache), three SGD steps."""
    torch.backends.cudnn.benchmark = True
    with routed(mode):
        torch.manual_seed(0)
        model = small_resnet().cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        x = torch.randn(16, 3, 32, 32, device="cuda")
        y = torch.randint(0, 10, (16,), device="cuda")
        losses = []
        for _ in range(3):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return {"losses": losses, **pool_info(mode)}


def feature_compile(mode, compile_mode=None):
    """torch.compile of an MLP (compile_mode "reduce-overhead": CUDA graphs through cudagraph
    trees), inference and training, against eager."""
    with routed(mode):
        torch.manual_seed(0)
        model = mlp().cuda()
        compiled = torch.compile(model, mode=compile_mode)
        x = torch.randn(32, 64, device="cuda")
        errors = []
        with torch.no_grad():
            for _ in range(4):
                errors.append(float((compiled(x) - model(x)).abs().max()))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(4):
            if compile_mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()     # a new training step
            optimizer.zero_grad()
            loss = compiled(x).square().mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return {"errors": errors, "losses": losses, **pool_info(mode)}


def feature_reduce_overhead(mode):
    """As feature_compile with mode="reduce-overhead", then a second function first called
    while the first one's graph path executes, which makes cudagraph trees restore the
    private pool's checkpointed state (setCheckpointPoolState), counted here."""
    restores = []
    original = torch._C._cuda_setCheckpointPoolState

    def counting(*args):
        restores.append(1)
        return original(*args)

    torch._C._cuda_setCheckpointPoolState = counting
    out = feature_compile(mode, "reduce-overhead")
    with routed(mode):
        f = torch.compile(lambda t: t.sin() * 2, mode="reduce-overhead")
        g = torch.compile(lambda t: t.cos() + 1, mode="reduce-overhead")
        x = torch.randn(4096, device="cuda")
        for _ in range(3):
            a = f(x)
        b = g(a)
        out["second_function_error"] = float((b - (torch.cos(x.sin() * 2) + 1)).abs().max())
        out["checkpoint_restores"] = len(restores)
    return out


def feature_graph(mode):
    """torch.cuda.graph capture and replay of a Linear: replays match eager, the output keeps
    its address, memory allocated after the capture is not the graph's, the private pool's
    live allocations are the output, and the pool ends with the graph."""
    with routed(mode):
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256).cuda()
        x = torch.randn(64, 256, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(3):
                model(x)                                # warm-up, as PyTorch's docs do
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        allocs_before = gpupool.get_pool(0).stats().num_allocs if mode != "native" else 0
        with torch.cuda.graph(graph), torch.no_grad():
            y = model(x) * 2
        captured_allocs = (gpupool.get_pool(0).stats().num_allocs - allocs_before
                           if mode != "native" else None)
        # cuBLAS's workspace for the capture stream was allocated in the capture and is kept
        # by PyTorch: dropped, as cudagraph trees do (its memory stays the graph's).
        torch._C._cuda_clearCublasWorkspaces()
        address = y.data_ptr()
        pool_id = graph.pool()
        live = torch._C._cuda_checkPoolLiveAllocations(0, pool_id, {y.untyped_storage().data_ptr()})
        wrong = torch._C._cuda_checkPoolLiveAllocations(0, pool_id, set())
        after = torch.full((64, 256), 5.0, device="cuda")       # not the graph's memory
        errors = []
        for _ in range(3):
            x.copy_(torch.randn(64, 256, device="cuda"))
            graph.replay()
            with torch.no_grad():
                errors.append(float((y - model(x) * 2).abs().max()))
        torch.cuda.synchronize()
        intact = bool((after == 5.0).all())
        same_address = y.data_ptr() == address
        del graph, y
        torch.cuda.empty_cache()
    return {"errors": errors, "same_address": same_address, "after_intact": intact,
            "live_is_output": live, "live_is_not_empty": not wrong,
            "captured_allocs": captured_allocs, **pool_info(mode)}


def feature_autocast_loader(mode):
    """bf16 autocast training of an MLP fed by DataLoader(pin_memory=True, num_workers=2)."""
    data = torch.utils.data.TensorDataset(torch.randn(256, 64), torch.randint(0, 10, (256,)))
    loader = torch.utils.data.DataLoader(data, batch_size=32, num_workers=2, pin_memory=True)
    with routed(mode):
        torch.manual_seed(0)
        model = mlp().cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, pinned = [], []
        for inputs, labels in loader:
            pinned.append(inputs.is_pinned())
            inputs, labels = inputs.cuda(non_blocking=True), labels.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return {"losses": losses, "pinned": all(pinned), **pool_info(mode)}


STAT_KEYS = ("allocated_bytes.all.current", "allocated_bytes.all.peak",
             "reserved_bytes.all.current", "allocation.all.current", "num_ooms")


def feature_stats(mode):
    """torch.cuda's memory statistics and controls: memory_allocated, max_memory_allocated,
    memory_reserved, memory_stats, reset_peak_memory_stats, empty_cache, mem_get_info."""
    out = {}
    with routed(mode):
        base = torch.cuda.memory_allocated()
        x = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
        out["allocated"] = torch.cuda.memory_allocated() - base
        big = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        del big
        out["max_allocated"] = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        out["max_after_reset"] = torch.cuda.max_memory_allocated() - base
        out["reserved"] = torch.cuda.memory_reserved()
        stats = torch.cuda.memory_stats()
        out["stats"] = {k: stats[k] for k in STAT_KEYS if k in stats}
        if mode != "native":
            ours = gpupool.torch.memory_stats(0)            # the same moment
            out["gpupool_stats"] = {k: ours[k] for k in STAT_KEYS}
            out["in_use_bytes"] = gpupool.get_pool(0).stats().in_use_bytes
        free_before, total = torch.cuda.mem_get_info()
        del x
        torch.cuda.synchronize()
        reserved_before = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        out["released"] = reserved_before - torch.cuda.memory_reserved()
        free_after, _ = torch.cuda.mem_get_info()
        out["freed_device_memory"] = free_after - free_before
        out["total"] = total
        if mode != "native":
            out["gpupool_total"] = gpupool.get_pool(0).mem_info()[1]
        out["snapshot"] = type(torch.cuda.memory_snapshot()).__name__
        ptr = torch.cuda.memory.caching_allocator_alloc(MiB)     # raw_alloc, raw_delete
        torch.cuda.memory.caching_allocator_delete(ptr)
        out["raw_alloc"] = ptr != 0
    return {**out, **pool_info(mode)}


def feature_record_stream(mode):
    """A tensor read on a side stream behind a slow kernel, record_stream'ed and deleted: the
    next allocation on the default stream must not overwrite it before the side stream reads
    it (the side stream's sum stays that of ones)."""
    with routed(mode):
        n = 4 * MiB
        x = torch.ones(n, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)               # about 0.1 s of spinning
            total = x.sum()
        x.record_stream(side)
        address = x.data_ptr()
        del x
        y = torch.full((n,), 7.0, device="cuda")        # the default stream, at once
        reused = y.data_ptr() == address
        torch.cuda.synchronize()
    return {"sum": float(total), "expected": float(n), "reused_address": reused,
            **pool_info(mode)}


def feature_mempool_object(mode):
    """A torch.cuda.MemPool of gpupool's allocator's private pools: use_mem_pool routes this
    thread's allocations to it, use_count counts its users, its memory returns at its end."""
    # Under mode mempool, gpupool's MemPool is the one tested: PyTorch cannot free a MemPool
    # made inside another's use_mem_pool (an internal assert in its emptyCache).
    with routed(mode) if mode != "mempool" else contextlib.nullcontext():
        pool = gpupool.torch.mempool() if mode == "mempool" else torch.cuda.MemPool()
        counts = [pool.use_count()]
        with torch.cuda.use_mem_pool(pool):
            x = torch.ones(MiB, device="cuda")
            counts.append(pool.use_count())
        counts.append(pool.use_count())
        total = float(x.sum())
        del x, pool
        torch.cuda.empty_cache()
    return {"use_counts": counts, "sum": total, **pool_info(mode)}


FEATURES = {
    "cudnn-benchmark": feature_cudnn_benchmark,
    "compile": feature_compile,
    "reduce-overhead": feature_reduce_overhead,
    "graph": feature_graph,
    "autocast-loader": feature_autocast_loader,
    "stats": feature_stats,
    "record-stream": feature_record_stream,
    "mempool-object": feature_mempool_object,
}


def run_feature(name):
    feature, mode = name.rsplit("-", 1)
    try:
        return {"ok": True, **FEATURES[feature](mode)}
    except Exception as exc:                            # the table reports the error
        return {"ok": False, "error": describe(exc)}


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


def sleep_use():
    """Under use() on a pool of the expandable upstream: tensors allocated under tags, slept
    (``weights`` offloaded, ``scratch`` discarded) and woken. Returns their addresses and values
    kept, the pool's and the device's bytes, what allocating with the sleeping tag raised, and
    what freeing a tensor while asleep did. No tensor is used while asleep: a kernel on
    unmapped memory would fault the context."""
    pool = gpupool.Pool(device=0, upstream="vmm")
    gpupool.torch.use(pool)
    with gpupool.tag("weights"):
        w = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        gone = torch.ones(1 << 18, device="cuda")
    with gpupool.tag("scratch"):
        s = torch.full((1 << 18,), 7.0, device="cuda")
    ptrs, expected = (w.data_ptr(), s.data_ptr()), w.cpu()
    torch.cuda.synchronize()
    free_awake, reserved_awake = torch.cuda.mem_get_info()[0], pool.stats().reserved_bytes
    pool.sleep("weights", offload=True)
    pool.sleep("scratch")
    stats = pool.stats()
    out = {"released": reserved_awake - stats.reserved_bytes,
           "freed_on_device": torch.cuda.mem_get_info()[0] - free_awake,
           "asleep": stats.asleep_bytes, "offloaded": stats.offloaded_bytes}
    with gpupool.tag("weights"):
        out["refused"] = attempt(lambda: torch.empty(1000, device="cuda"))
    del gone                                    # freed while asleep
    out["asleep_after_free"] = pool.stats().asleep_bytes
    out["untagged"] = float(torch.ones(1000, device="cuda").sum())
    pool.wake(["weights", "scratch"])
    out["same_ptrs"] = (w.data_ptr(), s.data_ptr()) == ptrs
    out["same_values"] = torch.equal(w.cpu(), expected)
    out["scratch_after_wake"] = float(s.fill_(3).sum())
    with gpupool.tag("weights"):
        out["tagged_after_wake"] = float(torch.ones(1000, device="cuda").sum())
    out["verify"] = pool._verify()
    return out


SCENARIOS = {
    "train-native": lambda: train("native"),
    "train-use": lambda: train("use"),
    "train-mempool": lambda: train("mempool"),
    "too-late": too_late,
    "oom-use": oom_use,
    "oom-mempool": oom_mempool,
    "region-ptr": region_ptr,
    "snapshot-use": snapshot_use,
    "sleep-use": sleep_use,
}

if __name__ == "__main__":
    name = sys.argv[1]
    print(json.dumps(SCENARIOS[name]() if name in SCENARIOS else run_feature(name)))
