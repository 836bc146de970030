"""Where a C API allocate + free pair goes when threads run it together.

Each of ``--threads`` threads runs the loop of ``bench/_capi_loop.c`` (the pairs of
``bench/threads.py``'s ``gp.capi`` column: 256 B, 4 KiB, 64 KiB, 1 MiB and 16 MiB in turn) on a
stream of its own, created or (``--per-thread``) its per-thread default stream, for
``--seconds``, in a fresh pool. Each run prints the pairs per second of all threads together
and, read while the threads are still alive, the share of each thread's requests that its
magazine could not serve (``Pool._magazines_info()``'s ``misses``): a thread whose share stays
high takes the pool's lock at almost every request.
``--idle N`` first has N more threads run a short loop each on a stream of its own and then
wait, alive, with their magazines in the pool, as ``bench/threads.py``'s other teams do.
Meant to run under ``perf record -g`` too (tools/gpu/gpu-check.sh, step ``profile``)::

    python tools/profile/profile_threads.py [--simulated] [--threads 8] [--per-thread]
                                            [--seconds 3] [--runs 1] [--idle 0]
"""

import argparse
import os
import sys
import threading
import time

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
sys.path.insert(0, BENCH)

import _cext  # noqa: E402
import _peers  # noqa: E402
import threads  # noqa: E402

SIZES = (256, 4 << 10, 64 << 10, 1 << 20, 16 << 20)
PER_THREAD_STREAM = 2
BATCH = 20_000
IDLE_PAIRS = 2_000           # each idle thread's one loop
# Per working thread, % of its pairs (Pool._magazines_info(), labelled as bench/threads.py
# labels them): misses, short of credit, an empty magazine, and requests and frees that waited
# for a sweep of the pool.
SHARES = {k: threads.MAGAZINE_COUNTS[k] for k in ("misses", "no_credit", "empty", "waits",
                                                  "free_waits")}


def run(helper, ctx, args):
    """One run in a fresh pool: (million pairs per second together, each thread's miss %)."""
    pool = ctx.new_pool()
    ctx.gpupool.set_pool(pool)
    count = args.threads + args.idle
    streams = [PER_THREAD_STREAM] * count if args.per_thread else ctx.streams(count)
    done, go = threading.Barrier(args.threads + 1), threading.Event()
    pairs = [0] * args.threads
    idled = threading.Barrier(args.idle + 1)

    def idle(i):
        helper.loop(SIZES, IDLE_PAIRS, 0, streams[args.threads + i])
        idled.wait()
        go.wait()                       # alive, its magazine in the pool, until the run ends

    idlers = [threading.Thread(target=idle, args=(i,)) for i in range(args.idle)]
    for t in idlers:
        t.start()
    idled.wait()                        # their magazines come first in _magazines_info()

    def work(i):
        end = time.perf_counter() + args.seconds
        while time.perf_counter() < end:
            helper.loop(SIZES, BATCH, 0, streams[i])
            pairs[i] += BATCH
        done.wait()
        go.wait()                       # alive: its magazine is not yet an exited thread's

    workers = [threading.Thread(target=work, args=(i,)) for i in range(args.threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    done.wait()
    seconds = time.perf_counter() - start
    per = max(sum(pairs) / args.threads, 1)
    info = pool._magazines_info()[args.idle:]
    shares = {k: [100 * m[k] / per for m in info] for k in SHARES}
    sweeps = pool._sweep_counts()
    go.set()
    for w in workers + idlers:
        w.join()
    return sum(pairs) / seconds / 1e6, shares, sweeps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--per-thread", action="store_true")
    p.add_argument("--idle", type=int, default=0,
                   help="threads that run one short loop first, then wait alive")
    p.add_argument("--simulated", action="store_true",
                   help="on gpupool's simulated device (no GPU; miss shares, not GPU speed)")
    args = p.parse_args(argv)
    ctx, reason = _peers.make_context(args.simulated, ())
    if ctx is None:
        sys.exit(f"profile_threads: {reason}")
    helper = _cext.build("gpupool_bench_loop", [os.path.join(BENCH, "_capi_loop.c")])
    kind = "per-thread default streams" if args.per_thread else "created streams"
    stuck = 0
    for _ in range(args.runs):
        rate, shares, sweeps = run(helper, ctx, args)
        stuck += max(shares["misses"], default=0) > 1
        threads = f"{args.threads} thread{'s' if args.threads > 1 else ''}" + \
            (f" (and {args.idle} idle)" if args.idle else "")
        print(f"{threads} on {kind}: {rate:.2f} M pairs/s together; per thread, % of its "
              "pairs: " + "; ".join(f"{label} {' '.join(f'{v:.2f}' for v in shares[key])}"
                                    for key, label in SHARES.items()))
        print("  sweeps over every magazine: " +
              ", ".join(f"{key} {count}" for key, count in sweeps.items()))
    print(f"{stuck} of {args.runs} runs had a thread missing more than 1% of its requests")

if __name__ == "__main__":
    main()
