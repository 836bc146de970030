"""GPU scenarios of tests/ipc/test_ipc_torch.py for torch.multiprocessing under gpupool.torch, each in
fresh processes (``gpupool.torch.use()`` must come before PyTorch initializes CUDA).

``python tests/ipc/ipc_torch_child.py SCENARIO`` runs a producer (this process), which sends CUDA
tensors through a ``torch.multiprocessing`` queue, and a consumer (spawned), which checks them
and writes into one; it prints one JSON object on its last line of stdout: ``{"checks": [4
booleans], "error": null or [exception type, message]}``. SCENARIO is ``PRODUCER-CONSUMER``,
each one of ``native`` (PyTorch's allocator), ``use`` (``gpupool.torch.use()``), ``mempool``
(the tensors made under ``torch.cuda.use_mem_pool(gpupool.torch.mempool())``), or ``resend``
(a consumer under ``use()`` that tries to send a received tensor on). ``GPUPOOL_UPSTREAM``
chooses gpupool's upstream. Needs a GPU and a CUDA build of PyTorch.
"""

import contextlib
import json
import sys

import torch
import torch.multiprocessing as mp

import gpupool
import gpupool.torch

N = 1 << 20


def setup(mode):
    if mode == "use":
        gpupool.torch.use()


def make(mode):
    """(tensors to send, the base tensor they view) of the producer."""
    place = (torch.cuda.use_mem_pool(gpupool.torch.mempool()) if mode == "mempool"
             else contextlib.nullcontext())
    with place:
        pad = torch.empty(3 << 10, dtype=torch.uint8, device="cuda")   # blocks before ours
        base = torch.arange(N, dtype=torch.float32, device="cuda")
        param = torch.nn.Parameter(torch.ones(10, device="cuda"))
    return (base[7:], base.view(512, 2048)[:, ::2], param), (pad, base)


def consumer(mode, jobs, results):
    try:
        setup("use" if mode == "resend" else mode)
        x, y, param = jobs.get(timeout=120)
        expected = torch.arange(N, dtype=torch.float32)
        checks = [
            x.is_cuda and x.shape == (N - 7,) and torch.equal(x.cpu(), expected[7:]),
            y.stride() == (2048, 2) and torch.equal(y.cpu(), expected.view(512, 2048)[:, ::2]),
            isinstance(param, torch.nn.Parameter) and param.requires_grad
            and bool((param == 1).all()),
        ]
        if mode == "resend":
            from multiprocessing.reduction import ForkingPickler

            ForkingPickler.dumps(x)             # refused: received memory
        x[0] = -1                               # in the producer's memory
        torch.cuda.synchronize()
        results.put({"checks": checks, "error": None})
    except Exception as exc:
        results.put({"checks": [], "error": [type(exc).__name__, str(exc)]})


def main(scenario):
    produced, consumed = ("use", "use") if scenario == "resend" else scenario.split("-")
    setup(produced)
    tensors, (pad, base) = make(produced)
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    jobs, results = ctx.Queue(), ctx.Queue()
    worker = ctx.Process(target=consumer,
                         args=("resend" if scenario == "resend" else consumed, jobs, results))
    worker.start()
    jobs.put(tensors)
    try:
        result = results.get(timeout=180)
    except Exception as exc:                    # the producer's reducer failed in the feeder
        result = {"checks": [], "error": [type(exc).__name__, "no answer from the consumer"]}
    if result["error"] is None:                 # the consumer's write, seen here: shared
        result["checks"].append(base[7].item() == -1)
    del tensors                                 # only now: PyTorch's rule
    worker.join(60)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
