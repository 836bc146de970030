"""Where a C API allocate + free pair spends its time when threads run it together (issue 18).

Runs bench/_capi_loop.c's loop (the pairs of ``bench/threads.py``'s ``gp.capi`` column) on
``--threads`` threads, each on a stream of its own (created, or ``--per-thread``: each thread's
per-thread default stream), for ``--seconds``, and prints ns per pair and million pairs per
second. Meant to run under ``perf record -g`` (tools/gpu-check.sh, step ``profile``)::

    python tools/profile_threads.py --threads 8 [--per-thread] [--seconds 3]
"""

import argparse
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))

import _cext  # noqa: E402

SIZES = (256, 4 << 10, 64 << 10, 1 << 20, 16 << 20)
PER_THREAD_STREAM = 2


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--per-thread", action="store_true")
    args = p.parse_args(argv)

    from cuda.bindings import driver

    import gpupool
    pool = gpupool.Pool(device=0)
    gpupool.set_pool(pool)
    helper = _cext.build("gpupool_bench_loop", [os.path.join(HERE, "..", "bench",
                                                             "_capi_loop.c")])
    flags = driver.CUstream_flags.CU_STREAM_NON_BLOCKING
    streams = ([PER_THREAD_STREAM] * args.threads if args.per_thread else
               [int(driver.cuStreamCreate(flags)[1]) for _ in range(args.threads)])
    for s in streams:
        helper.loop(SIZES, 10_000, 0, s)                # warm: every size cached
    results = [0.0] * args.threads
    batch = 200_000

    def work(i):
        end, pairs, ns = time.perf_counter() + args.seconds, 0, 0.0
        while time.perf_counter() < end:
            ns += helper.loop(SIZES, batch, 0, streams[i]) * batch
            pairs += batch
        results[i] = ns / pairs

    threads = [threading.Thread(target=work, args=(i,)) for i in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ns = sorted(results)[len(results) // 2]
    kind = "per-thread default streams" if args.per_thread else "created streams"
    print(f"{args.threads} threads on {kind}: {ns:.1f} ns per pair per thread (median), "
          f"{args.threads * 1e3 / ns:.2f} M pairs/s together")


if __name__ == "__main__":
    main()
