"""Per-thread magazine miss rates of bench/threads.py's C API loop, on the simulated device.

Each of ``--threads`` threads runs the loop of ``bench/_capi_loop.c`` (allocate + free of 256 B,
4 KiB, 64 KiB, 1 MiB and 16 MiB in turn) on a stream of its own, created or (``--per-thread``)
its per-thread default stream, for ``--pairs`` pairs; then, while the threads are still alive,
it prints the share of each thread's requests that its magazine could not serve
(``Pool._magazines_info()``'s ``misses``). A thread whose share stays high takes the pool's
lock at almost every request: the reason, found on 2026-12-01, why 8 threads move fewer pairs
per second than 4 on the H200 (issue 18). Run several times: which thread, if any, falls into
that state changes from run to run::

    python tools/magazine_misses.py [--threads 8] [--per-thread] [--pairs 50000] [--runs 5]
"""

import argparse
import os
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))

import _cext  # noqa: E402

import gpupool  # noqa: E402
from gpupool.testing import SimulatedDevice  # noqa: E402

SIZES = (256, 4 << 10, 64 << 10, 1 << 20, 16 << 20)
PER_THREAD_STREAM = 2


def run(helper, threads, pairs, per_thread):
    """One run in a fresh pool; the miss share of each thread's magazine, in percent."""
    sim = SimulatedDevice(capacity=8 << 30)
    pool = gpupool.Pool(upstream=sim, device=0)
    gpupool.set_pool(pool)
    streams = ([PER_THREAD_STREAM] * threads if per_thread else
               [sim.create_stream() for _ in range(threads)])
    done, go = threading.Barrier(threads + 1), threading.Event()

    def work(i):
        helper.loop(SIZES, pairs, 0, streams[i])
        done.wait()
        go.wait()                       # alive: its magazine is not yet an exited thread's

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    done.wait()
    shares = [100 * m["misses"] / pairs for m in pool._magazines_info()]
    go.set()
    for w in workers:
        w.join()
    return shares


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--pairs", type=int, default=50_000)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--per-thread", action="store_true")
    args = p.parse_args(argv)
    helper = _cext.build("gpupool_bench_loop", [os.path.join(HERE, "..", "bench",
                                                             "_capi_loop.c")])
    bad = 0
    for r in range(args.runs):
        shares = run(helper, args.threads, args.pairs, args.per_thread)
        bad += max(shares) > 1
        print(f"run {r + 1}: misses per thread, % of its requests: "
              + " ".join(f"{s:.2f}" for s in shares))
    print(f"{bad} of {args.runs} runs had a thread missing more than 1% of its requests")


if __name__ == "__main__":
    main()
