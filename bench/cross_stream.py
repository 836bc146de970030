"""Cross-stream reuse in gpupool: a block freed on stream A, then an allocation on stream B.

Each iteration allocates ``n`` bytes on A and frees it, then allocates ``n`` on B and frees it.
B takes A's block once an event recorded on A after the free reports complete, or behind a
GPU-side wait for it (``cuStreamWaitEvent``); frees never touch a stream, so that event is
recorded when A next allocates. Cases:

* ``same.legacy``: A = B = the legacy default stream (no events at all);
* ``same.A``:      A = B = one non-blocking stream;
* ``cross.idle``:  A and B two non-blocking streams, both idle;
* ``cross.busy``:  the same while a spin kernel keeps A busy for the whole batch: B may take
  A's block only behind a GPU-side wait, never by blocking the host.
* ``handoff.idle``: A = the legacy default stream, B = a non-blocking stream, and B's buffer
  is moved back to A (``buf.stream = A``) before it dies, so B never keeps a block of its own:
  every B allocation takes the block just freed on A (event recorded on A, then queried). In
  the cross cases above each stream soon keeps a block of its own and no hand-off happens.
* ``handoff.busy``: the same while a spin kernel keeps the legacy stream busy: every B
  allocation takes the block behind a GPU-side wait (``cuStreamWaitEvent``).

A batch op is one pair on A and one on B; the hand-off's extra cost per B allocation is twice
the difference between a handoff case's per-pair median and ``same.legacy``'s (the move back
to A, a stream setter call, is included).

Reported: ns per allocate + free pair (median), the fraction of B's allocations that got the
block A had just freed (``.ptr`` compared), and the pool's counters. Run::

    python bench/cross_stream.py [--json PATH] [--quick]
"""

import sys
import time

import _common
from _common import KiB, MiB, format_ns, format_size, format_table, measure_rounds

SCRIPT = "cross_stream"
SIZES = [4 * KiB, 1 * MiB, 16 * MiB]
CASES = ["same.legacy", "same.A", "cross.idle", "cross.busy", "handoff.idle", "handoff.busy"]
BUSY = ("cross.busy", "handoff.busy")
PLAN = {"reps": 30, "ops": 2000}          # ops = iterations of two allocate + free pairs
QUICK_PLAN = {"reps": 3, "ops": 200}
REUSE_ITERATIONS = 1000
SPIN_NS = 20_000_000                      # A's spin kernel: 20 ms, far longer than a batch

SPIN_SOURCE = r"""
extern "C" __global__ void gpupool_bench_spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""


class GpuStreams:
    """Two non-blocking CuPy streams and a spin kernel that keeps a stream busy."""

    def __init__(self, cupy):
        self.cupy = cupy
        self.a = cupy.cuda.Stream(non_blocking=True)
        self.b = cupy.cuda.Stream(non_blocking=True)
        self.handles = {"legacy": 0, "A": self.a.ptr, "B": self.b.ptr}
        self.spin, self.spin_error = None, None
        try:
            self.spin = cupy.RawKernel(SPIN_SOURCE, "gpupool_bench_spin")
            self.spin.compile()
        except Exception as exc:  # no NVRTC, say: the busy case is skipped
            self.spin, self.spin_error = None, f"{type(exc).__name__}: {exc}"
        self.busy_lost = 0

    def _stream(self, handle):
        return self.a if handle == self.a.ptr else self.cupy.cuda.Stream.null

    def make_busy(self, handle):
        """Enqueue the spin kernel on the stream with this handle (A or the legacy one)."""
        import numpy as np

        with self._stream(handle):
            self.spin((1,), (1,), (np.uint64(SPIN_NS),))

    def end_busy(self, handle):
        """Count it if the stream finished before the batch did, then wait for it."""
        stream = self._stream(handle)
        if stream.done:
            self.busy_lost += 1
        stream.synchronize()

    def new_pool(self, gpupool):
        return gpupool.Pool(device=0)


class SimulatedStreams:
    """The same on gpupool.testing.SimulatedDevice (checks the harness, not the GPU)."""

    def __init__(self):
        from gpupool.testing import SimulatedDevice

        self.sim = SimulatedDevice(capacity=4 << 30)
        self.handles = {"legacy": 0, "A": self.sim.create_stream(), "B": self.sim.create_stream()}
        self.spin, self.spin_error = True, None
        self.busy_lost = 0

    def make_busy(self, handle):
        self.sim.launch(handle)

    def end_busy(self, handle):
        if not self.sim.pending(handle):
            self.busy_lost += 1
        self.sim.complete(handle)

    def new_pool(self, gpupool):
        return gpupool.Pool(upstream=self.sim)


def case_streams(streams, case):
    """(handle of A, handle of B, B's buffers moved back to A?) for a case."""
    h = streams.handles
    return {
        "same.legacy": (h["legacy"], h["legacy"], False),
        "same.A": (h["A"], h["A"], False),
        "cross.idle": (h["A"], h["B"], False),
        "cross.busy": (h["A"], h["B"], False),
        "handoff.idle": (h["legacy"], h["B"], True),
        "handoff.busy": (h["legacy"], h["B"], True),
    }[case]


def make_batch(pool, n, a, b, back):
    """``ops`` iterations of: allocate on A, free, allocate on B, (back: move to A,) free."""
    alloc = pool.allocate

    def batch(ops):
        for _ in range(ops):
            buf = alloc(n, a)
            del buf
            buf = alloc(n, b)
            if back:
                buf.stream = a
            del buf

    return batch


def reuse_fraction(pool, n, a, b, back, iterations):
    """Fraction of B's allocations that got the block just freed on A."""
    alloc = pool.allocate
    reused = 0
    for _ in range(iterations):
        buf = alloc(n, a)
        ptr = buf.ptr
        del buf
        buf = alloc(n, b)
        reused += buf.ptr == ptr
        if back:
            buf.stream = a
        del buf
    return reused / iterations


def _per_pair(timing):
    """A batch op is two allocate + free pairs: ns per pair."""
    return {"median": timing.median / 2, "min": timing.min / 2, "max": timing.max / 2,
            "ops": timing.ops, "reps": timing.reps}


def run(gpupool, streams, plan):
    """Every case at every size, interleaved, each on a fresh pool; progress to stderr.

    Returns a dict: ``results[case][str(size)]`` (ns per pair, the reuse fraction, the
    pool's counters), ``skipped``, ``errors`` and ``busy_batches_lost`` (busy batches that
    outlasted A's spin kernel, so were not busy all along).
    """
    cases, skipped = list(CASES), {}
    if streams.spin is None:
        for case in BUSY:
            skipped[case] = f"no spin kernel: {streams.spin_error}"
            cases.remove(case)
    cells, pools = {}, {}
    for case in cases:
        a, b, back = case_streams(streams, case)
        hooks = {}
        if case in BUSY:
            hooks = {"before": lambda a=a: streams.make_busy(a),
                     "after": lambda a=a: streams.end_busy(a)}
        for n in SIZES:
            pool = pools[case, n] = streams.new_pool(gpupool)
            cells[case, n] = _common.Cell(make_batch(pool, n, a, b, back), ops=plan["ops"],
                                          **hooks)
    start = time.perf_counter()
    timings, errors = measure_rounds(cells, reps=plan["reps"])
    print(f"  {len(cells)} cells, {plan['reps']} rounds: {time.perf_counter() - start:.1f} s",
          file=sys.stderr)
    lost, streams.busy_lost = streams.busy_lost, 0
    results = {case: {} for case in cases}
    for (case, n), timing in timings.items():
        a, b, back = case_streams(streams, case)
        if case in BUSY:
            streams.make_busy(a)
        fraction = reuse_fraction(pools[case, n], n, a, b, back,
                                  min(REUSE_ITERATIONS, plan["ops"]))
        if case in BUSY:
            streams.end_busy(a)
        results[case][str(n)] = dict(_per_pair(timing), reuse_fraction=fraction,
                                     pool_stats=pools[case, n].stats().as_dict())
        pools[case, n].trim()
    errors = {f"{c} {format_size(n)}": f"{type(e).__name__}: {e}" for (c, n), e in errors.items()}
    return {"results": results, "skipped": skipped, "errors": errors,
            "busy_batches_lost": lost + streams.busy_lost}


def report(out):
    """The printed tables: ns per pair, spread, reuse fraction and upstream allocations."""
    res, cases = out["results"], list(out["results"])

    def rows(cell):
        return [[format_size(n)] + [cell(res[c][str(n)]) for c in cases] for n in SIZES]

    parts = [
        format_table(["size", *cases], rows(lambda r: format_ns(r["median"])),
                     "ns per allocate + free pair, median"),
        format_table(["size", *cases],
                     rows(lambda r: f"{format_ns(r['min'])}-{format_ns(r['max'])}"),
                     "spread: min-max of the repetitions, ns"),
        format_table(["size", *cases], rows(lambda r: f"{r['reuse_fraction']:.0%}"),
                     "B's allocations that got the block just freed on A"),
        format_table(["size", *cases],
                     rows(lambda r: f"{r['pool_stats']['upstream_allocs']}, "
                                    f"{format_size(r['pool_stats']['peak_reserved_bytes'])}"),
                     "upstream allocations, peak reserved bytes (whole case, fresh pool)"),
    ]
    notes = [f"  {c}: skipped: {why}" for c, why in out["skipped"].items()]
    notes += [f"  {cell}: error: {why}" for cell, why in out["errors"].items()]
    if out["busy_batches_lost"]:
        notes.append(f"  busy cases: A's spin kernel ended before {out['busy_batches_lost']} "
                     "batch(es) did; those were not busy all along")
    for case in ("handoff.idle", "handoff.busy"):
        if case in res and "same.legacy" in res:
            extra = [2 * (res[case][str(n)]["median"] - res["same.legacy"][str(n)]["median"])
                     for n in SIZES]
            notes.append(f"  {case}: extra ns per B allocation over same.legacy (target "
                         f"<= 2,000): " + ", ".join(f"{format_size(n)} {format_ns(x)}"
                                                     for n, x in zip(SIZES, extra, strict=True)))
    if notes:
        parts.append("\n".join(["notes:", *notes]))
    return "\n\n".join(parts)


def main(argv=None):
    args = _common.parser(__doc__.splitlines()[0]).parse_args(argv)
    import gpupool

    if args.simulated:
        streams = SimulatedStreams()
    else:
        _, reason = _common.gpu_pool()
        if reason is not None:
            _common.skip(SCRIPT, reason, args.json)
        cupy, reason = _common.optional_import("cupy")
        if cupy is None:
            print(f"{SCRIPT}: skipped: needs CuPy for its streams ({reason})")
            if args.json:
                _common.write_json(args.json, {"script": SCRIPT, "skipped": reason})
            return 0
        cupy.cuda.Device(0).use()
        streams = GpuStreams(cupy)
    start = time.perf_counter()
    plan = QUICK_PLAN if args.quick else PLAN
    out = {"script": SCRIPT, "unit": "ns per allocate+free pair", "sizes": SIZES,
           "plan": plan, "spin_ns": SPIN_NS, "simulated": args.simulated, "quick": args.quick,
           "env": _common.environment()}
    out.update(run(gpupool, streams, plan))
    return _common.finish(out, start, report, args.json)


if __name__ == "__main__":
    sys.exit(main())
