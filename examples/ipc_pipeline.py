"""A producer and a consumer process sharing batches through gpupool's CUDA IPC, without copies.

What it shows
-------------
Data loaders feeding a trainer, inference servers with worker processes: one process makes
batches on the GPU, another uses them, and copying every batch through host memory costs more
than making it. Here the producer (this process) fills each batch in a gpupool buffer and sends
only its ``buf.ipc_handle()`` through a ``multiprocessing`` queue; the consumer (a process
started with the 'spawn' method) opens it with ``gpupool.open_ipc``, reads the batch where the
producer wrote it, and sends back the row sums. The producer keeps each buffer alive until the
consumer's answer for it has come back (the exporter's rule of CUDA IPC), then lets it go, so
its pool hands the same blocks out again: at most ``--depth`` batches are in flight, and the
producer's pool reserves no more than that many batches' memory however many batches run.

Every hand-off is stream-ordered without a host wait: the producer writes on a stream of its
own; the handle's IPC event, recorded there, makes the consumer's stream wait for the writes.

On a GPU the batches are CuPy arrays (``pip install 'gpupool[cupy]'``) on the producer's pool
(``--upstream vmm``, the default, shares virtual-memory pages through POSIX file
descriptors, which the queue passes along; ``driver`` shares ``cuMemAlloc`` segments through
``cuIpcGetMemHandle``). Without one, both processes run on ``gpupool.testing.SimulatedDevice``
(``shareable=True``: memfd host memory that both map) and NumPy: the same calls, the same
checks. The first line says which.

Running it
----------
::

    python examples/ipc_pipeline.py                       # GPU if there is one, else simulated
    python examples/ipc_pipeline.py --batches 64 --depth 3 --upstream driver
    python examples/ipc_pipeline.py --device simulated

Exit status: 0 when every batch's sums came back right, the consumer saw the producer's
addresses' bytes without a copy, and the producer's pool stayed within ``depth`` batches; 1
when a check failed; 2 when ``--device gpu`` finds no GPU or CuPy (one line on stderr).
"""

import argparse
import multiprocessing
import sys
import time

import _gpu
import numpy as np

ROWS, COLS = 256, 1024          # float32: 1 MiB a batch
RECEIPT = -1.0                  # the consumer writes it into each batch it has read


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "gpu", "simulated"), default="auto",
                   help="gpu: CuPy on the GPU; simulated: NumPy on gpupool's simulated device; "
                        "auto (default): the GPU when there is one")
    p.add_argument("--batches", type=int, default=16,
                   help="batches the producer makes and sends, 1 MiB each (default %(default)s)")
    p.add_argument("--depth", type=int, default=2,
                   help="batches in flight at most (default %(default)s)")
    p.add_argument("--upstream", choices=("vmm", "driver"),
                   help="the producer's pool on a GPU (default: vmm); ignored, with a line "
                        "saying so, on the simulated device")
    args = p.parse_args(argv)
    if args.batches < 1 or args.depth < 1:
        p.error("--batches and --depth must be at least 1")
    return args


class Setup(Exception):
    """A prerequisite is missing: exit status 2."""


def choose_device(wanted):
    """("gpu", cupy) or ("simulated", the reason for the simulated device)."""
    if wanted == "simulated":
        return "simulated", "--device simulated was asked for"
    try:
        import cupy
    except ImportError:
        cupy, library = None, "CuPy is not installed (pip install 'gpupool[cupy]')"
    else:
        library = None
    why = _gpu.missing(library)
    if why is None:
        return "gpu", cupy
    if wanted == "gpu":
        raise Setup(f"--device gpu needs an NVIDIA GPU and CuPy, but {why}")
    return "simulated", why


def make_pool(device, upstream, shareable):
    import gpupool
    from gpupool.testing import SimulatedDevice

    if device == "simulated":
        return gpupool.Pool(upstream=SimulatedDevice(capacity="256MiB", shareable=shareable))
    return gpupool.Pool(device=0, upstream=upstream)


def consumer(device, upstream, jobs, results):
    """The consumer process: open each batch, sum its rows on its own stream, answer."""
    import gpupool

    pool = make_pool(device, upstream, shareable=False)
    cp = None
    if device == "gpu":
        import cupy as cp

        stream = cp.cuda.Stream(non_blocking=True)
    while True:
        job = jobs.get()
        if job is None:
            break
        index, handle = job
        buf = gpupool.open_ipc(handle, stream=None if cp is None else stream, pool=pool)
        view = buf.view("float32", (ROWS, COLS))
        if cp is None:
            x = np.from_dlpack(view)
            sums = x.sum(axis=1, dtype=np.float64)
            x[0, 0] = RECEIPT
        else:
            with stream:
                x = cp.from_dlpack(view)
                sums = x.sum(axis=1, dtype=cp.float64).get(stream=stream)
                x[0, 0] = RECEIPT           # in the producer's memory, which it reads back
            stream.synchronize()
        results.put((index, sums))
        del x, view
        buf.close()             # done with it: the producer may reuse the memory now
    results.put(("stats", pool.stats().in_use_bytes))


def produce(args, device, cp):
    """Run the pipeline; returns the checks as (title, passed)."""
    import gpupool

    pool = make_pool(device, args.upstream, shareable=True)
    ctx = multiprocessing.get_context("spawn")
    jobs, results = ctx.Queue(), ctx.Queue()
    worker = ctx.Process(target=consumer, args=(device, args.upstream, jobs, results))
    worker.start()
    stream = cp.cuda.Stream(non_blocking=True) if cp is not None else None
    in_flight, addresses, wrong, receipts = {}, set(), [], []
    expected_row = np.arange(COLS, dtype=np.float64).sum()
    start = time.perf_counter()

    def collect_one():
        index, sums = results.get(timeout=120)
        buf = in_flight.pop(index)              # the consumer is done: let the buffer go
        want = expected_row + COLS * (index + np.arange(ROWS))
        if not np.allclose(sums, want):
            wrong.append(index)
        # The consumer's receipt, in this process's memory: no copy was made on the way.
        receipts.append(buf.copy_to_host()[:4].view(np.float32)[0] == RECEIPT)
        del buf

    for index in range(args.batches):
        while len(in_flight) >= args.depth:
            collect_one()
        buf = pool.allocate(ROWS * COLS * 4, stream=None if stream is None else stream.ptr)
        addresses.add(buf.ptr)
        view = buf.view("float32", (ROWS, COLS))
        if cp is None:
            x = np.from_dlpack(view)
            x[:] = np.arange(COLS, dtype=np.float32) + (index + np.arange(ROWS))[:, None]
        else:
            with stream:            # written on the producer's stream; the handle's event
                x = cp.from_dlpack(view)                # makes the consumer's wait for it
                x[:] = cp.arange(COLS, dtype=cp.float32) + \
                    (index + cp.arange(ROWS, dtype=cp.float32))[:, None]
        del x, view
        in_flight[index] = buf
        jobs.put((index, buf.ipc_handle()))
        del buf
    while in_flight:
        collect_one()
    jobs.put(None)
    _, consumer_in_use = results.get(timeout=120)
    worker.join(60)
    elapsed = time.perf_counter() - start
    stats = pool.stats()
    batch = ROWS * COLS * 4
    print(f"{args.batches} batches of {batch >> 20} MiB, {args.depth} in flight at most, "
          f"{elapsed * 1e3:.1f} ms ({elapsed * 1e3 / args.batches:.2f} ms a batch)")
    print(f"producer's pool: {len(addresses)} distinct addresses, peak in use "
          f"{stats.peak_in_use_bytes >> 20} MiB, reserved {stats.reserved_bytes >> 20} MiB")
    gpupool.pool_status(pool=pool)
    return [
        ("every batch's row sums came back right", not wrong),
        ("the consumer worked in the producer's memory (its receipts are there)",
         len(receipts) == args.batches and all(receipts)),
        (f"the producer's pool kept at most {args.depth} batches in use",
         stats.peak_in_use_bytes <= args.depth * batch),
        ("the producer's blocks were handed out again", len(addresses) <= args.depth + 1),
        ("the consumer process exited cleanly, holding nothing",
         worker.exitcode == 0 and consumer_in_use == 0),
    ]


def main(argv=None):
    args = parse(argv)
    try:
        device, cp_or_why = choose_device(args.device)
    except Setup as exc:
        print(f"ipc_pipeline: {exc}", file=sys.stderr)
        return 2
    if device == "simulated":
        print(f"ipc_pipeline: sharing batches on gpupool's simulated device (host memory), "
              f"because {cp_or_why}")
        if args.upstream is not None:
            print(f"ipc_pipeline: --upstream {args.upstream} is ignored: the simulated device "
                  f"shares memfd host memory, neither vmm pages nor driver segments")
        cp = None
    else:
        args.upstream = args.upstream or "vmm"
        print(f"ipc_pipeline: sharing batches on the GPU (upstream {args.upstream!r})")
        cp = cp_or_why
    checks = produce(args, device, cp)
    for title, passed in checks:
        print(f"[{'ok' if passed else 'FAIL'}] {title}")
    return 0 if all(passed for _, passed in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
