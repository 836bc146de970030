"""Sleep and wake of a tagged pool beside a plain pinned copy of the same bytes.

A pool on upstream "vmm" holds ``--nbytes`` (default 10 GiB) of live tagged memory
(``gpupool.tag``) in ten buffers; each row times one operation on all of it, seconds per op:

* ``copy D2H``, ``copy H2D``: the plain copy, the bound an offload can reach:
  ``cuMemcpyDtoHAsync`` / ``cuMemcpyHtoDAsync`` of the whole size between a ``cuMemAlloc``
  buffer and ``cuMemHostAlloc`` (page-locked) memory on stream 0, then ``cuCtxSynchronize``
  (through ``cuda.bindings.driver``), timed with ``time.perf_counter`` around both;
* ``sleep offload``, ``wake offload``: ``pool.sleep(tag, offload=True)`` (synchronize, the
  bytes copied into the pool's page-locked chunk, the pages unmapped) and the ``pool.wake``
  after it (the pages mapped again, the bytes copied back, synchronize);
* ``sleep``, ``wake``: the same without offload (contents discarded): unmap and map alone.

The first offloading sleep and wake are reported apart (``first cycle``): that sleep pins the
chunk (``cuMemHostAlloc`` of the whole size, seconds for gigabytes) and gives back one physical
allocation per buffer's growth; every later cycle reuses the chunk (``Pool.release_pinned``
gives it back) and unmaps the one chunk wake mapped. Then ``--reps`` rounds, each running the
two copies, one offloading cycle and one plain cycle in shuffled order; medians, min and max.
GB/s are 10^9 bytes per second. Targets (issue "Sleep and wake", H200): wake offload at least
80% of the plain H2D copy's bandwidth, sleep offload likewise of D2H, sleep and wake without
offload each under 50 ms for 10 GiB.

The anchor. vLLM's sleep mode (``CuMemAllocator``, vllm/device_allocator/cumem.py) routes
PyTorch's allocations through a pluggable allocator that maps each allocation as its own
``cuMemCreate`` handle; its ``sleep(offload_tags=...)`` copies each tagged allocation into a
CPU tensor made at that sleep (pinned where the platform allows) with one ``cudaMemcpy`` per
allocation, then unmaps and releases every allocation; ``wake_up`` creates and maps each again
and copies the backups back. SGLang's ``torch_memory_saver`` hooks ``cudaMalloc`` inside its
region (an ``LD_PRELOAD`` library), one ``cuMemCreate`` handle per allocation, released on
``pause`` and made again on ``resume``. Neither installs on the benchmark machine (no network,
and both hook PyTorch), so the plain pinned copy stands for them: their offload moves the
same bytes over the same link, per allocation, so it cannot beat it, and their unmap and map
cost one driver round per allocation where gpupool's cost one per chunk.

Run::

    python bench/sleep_cycle.py [--nbytes 10GiB] [--reps 7] [--json PATH] [--quick] [--simulated]

Without a GPU the script prints a skip line and exits 0. ``--simulated`` runs the pool on
``SimulatedDevice(virtual_memory=True)`` and the plain copy as a host ``memmove`` (default
80 MiB): it checks the harness; its numbers are not GPU numbers and no target is judged.
"""

import ctypes
import os
import random
import statistics
import sys
import time

import _common
from _common import GiB, MiB, format_size, format_table

SCRIPT = "sleep_cycle"
TAG = "bench.sleep_cycle"
PIECES = 10                     # buffers, so growths: the first sleep gives back 10 chunks
ROWS = ["copy D2H", "copy H2D", "sleep offload", "wake offload", "sleep", "wake"]
AGAINST = {"sleep offload": "copy D2H", "wake offload": "copy H2D"}
BANDWIDTH_TARGET = 0.8          # of the plain copy's GB/s
NO_OFFLOAD_TARGET_S = 0.050     # for 10 GiB
GPU_NBYTES, SIM_NBYTES, QUICK_NBYTES = 10 * GiB, 80 * MiB, 1000 * MiB
PAGE = 2 * MiB


def _check(result, what):
    """A ``cuda.bindings.driver`` call's value after its CUresult, which must be success."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


class PinnedCopy:
    """The plain copy on the GPU: a ``cuMemAlloc`` buffer and ``cuMemHostAlloc`` memory of
    ``nbytes`` each, copied whole on stream 0 and synchronized."""

    def __init__(self, nbytes):
        from cuda.bindings import driver

        self.driver, self.nbytes = driver, nbytes
        _check(driver.cuInit(0), "cuInit")
        self.ctx = _check(driver.cuDevicePrimaryCtxRetain(_check(driver.cuDeviceGet(0),
                                                                 "cuDeviceGet")),
                          "cuDevicePrimaryCtxRetain")
        _check(driver.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self.dev = _check(driver.cuMemAlloc(nbytes), "cuMemAlloc")
        self.host = int(_check(driver.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc"))
        self.stream = driver.CUstream(0)
        _check(driver.cuMemsetD8(self.dev, 1, nbytes), "cuMemsetD8")
        ctypes.memset(self.host, 2, nbytes)         # the host pages touched before timing

    def d2h(self):
        d = self.driver
        _check(d.cuMemcpyDtoHAsync(self.host, self.dev, self.nbytes, self.stream),
               "cuMemcpyDtoHAsync")
        _check(d.cuCtxSynchronize(), "cuCtxSynchronize")

    def h2d(self):
        d = self.driver
        _check(d.cuMemcpyHtoDAsync(self.dev, self.host, self.nbytes, self.stream),
               "cuMemcpyHtoDAsync")
        _check(d.cuCtxSynchronize(), "cuCtxSynchronize")

    def close(self):
        _check(self.driver.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        _check(self.driver.cuMemFree(self.dev), "cuMemFree")
        _check(self.driver.cuMemFreeHost(self.host), "cuMemFreeHost")


class HostCopy:
    """The plain copy on the simulated device: a ``memmove`` between two host buffers."""

    def __init__(self, nbytes):
        self.nbytes = nbytes
        self.a, self.b = bytearray(b"\1" * nbytes), bytearray(nbytes)
        self.pa = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(self.a))
        self.pb = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(self.b))

    def d2h(self):
        ctypes.memmove(self.pb, self.pa, self.nbytes)

    def h2d(self):
        ctypes.memmove(self.pa, self.pb, self.nbytes)

    def close(self):
        pass


def fit(nbytes, free_device, host_total):
    """``nbytes`` rounded down to PIECES pieces of whole 2 MiB pages, and smaller where the
    device (twice it: the plain copy's buffer and the pool's) or the host (twice it pinned)
    lacks room; the bytes to use."""
    room = min(nbytes, (free_device - GiB) // 2, host_total * 3 // 10)
    return max(room // (PIECES * PAGE), 1) * PIECES * PAGE


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(nbytes, reps, simulated, seed=0):
    """The first cycle's and every round's seconds: ``(first, {row: [seconds]}, pool
    facts)``."""
    import gpupool
    from gpupool.testing import SimulatedDevice

    if simulated:
        pool = gpupool.Pool(upstream=SimulatedDevice(capacity=3 * nbytes, virtual_memory=True,
                                                     page=PAGE))
        copy = HostCopy(nbytes)
    else:
        pool = gpupool.Pool(device=0, upstream="vmm")
        copy = PinnedCopy(nbytes)
    try:
        with gpupool.tag(TAG):
            bufs = [pool.allocate(nbytes // PIECES) for _ in range(PIECES)]
        for i, buf in enumerate(bufs):
            buf.memset(i + 1)
        first = {"sleep offload": timed(lambda: pool.sleep(TAG, offload=True))}
        first["wake offload"] = timed(lambda: pool.wake(TAG))
        for i in (0, PIECES - 1):                   # the bytes came back
            head = bufs[i].copy_to_host()[:4096]
            if not (head == i + 1).all():
                raise RuntimeError(f"buffer {i}: bytes changed across sleep and wake")
        units = {"copy D2H": [("copy D2H", copy.d2h)], "copy H2D": [("copy H2D", copy.h2d)],
                 "offload": [("sleep offload", lambda: pool.sleep(TAG, offload=True)),
                             ("wake offload", lambda: pool.wake(TAG))],
                 "plain": [("sleep", lambda: pool.sleep(TAG)), ("wake", lambda: pool.wake(TAG))]}
        samples, order, rng = {row: [] for row in ROWS}, list(units), random.Random(seed)
        for _ in range(reps):
            rng.shuffle(order)
            for unit in order:
                for row, fn in units[unit]:
                    samples[row].append(timed(fn))
        stats = pool.stats()
        facts = {"pinned_bytes": stats.pinned_bytes, "in_use_bytes": stats.in_use_bytes,
                 "asleep_bytes": stats.asleep_bytes}
        del bufs
        pool.release_pinned()
        return first, samples, facts
    finally:
        copy.close()


def summarize(first, samples, nbytes, simulated):
    """Rows with median, min and max seconds, GB/s and the ratio to the plain copy; the
    targets (not judged on the simulated device)."""
    rows = {}
    for row, s in samples.items():
        med = statistics.median(s)
        rows[row] = {"median": med, "min": min(s), "max": max(s), "samples": s,
                     "gb_per_s": nbytes / med / 1e9}
    for row, plain in AGAINST.items():
        rows[row]["vs_plain"] = rows[row]["gb_per_s"] / rows[plain]["gb_per_s"]
    scale = nbytes / GPU_NBYTES                 # the 50 ms target is for 10 GiB
    targets = {}
    if not simulated:
        for row in AGAINST:
            targets[f"{row} >= {BANDWIDTH_TARGET:.0%} of {AGAINST[row]}"] = (
                rows[row]["vs_plain"] >= BANDWIDTH_TARGET)
        for row in ("sleep", "wake"):
            limit = NO_OFFLOAD_TARGET_S * max(scale, 1.0)
            targets[f"{row} (no offload) < {limit * 1e3:.0f} ms"] = rows[row]["median"] < limit
    return rows, targets


def report(out):
    rows = out["rows"]
    body = []
    for row in ROWS:
        r = rows[row]
        vs = f"{r['vs_plain']:.1%}" if "vs_plain" in r else "-"
        gbs = f"{r['gb_per_s']:.1f}" if row not in ("sleep", "wake") else "-"
        body.append([row, f"{r['median'] * 1e3:,.1f}", f"{r['min'] * 1e3:,.1f}",
                     f"{r['max'] * 1e3:,.1f}", gbs, vs])
    where = "simulated device, host memmove as the copy" if out["simulated"] else "GPU"
    lines = [format_table(
        ["row", "median ms", "min ms", "max ms", "GB/s", "vs plain copy"], body,
        title=f"sleep and wake of {format_size(out['nbytes'])} in {PIECES} tagged buffers "
              f"({where}; median of {out['reps']} rounds, steady state)")]
    f = out["first"]
    lines.append(f"first cycle (pins the chunk, gives back {PIECES} chunks): sleep offload "
                 f"{f['sleep offload'] * 1e3:,.1f} ms, wake offload "
                 f"{f['wake offload'] * 1e3:,.1f} ms")
    if out.get("reduced_from"):
        lines.append(f"nbytes reduced from {format_size(out['reduced_from'])} to fit the "
                     f"device and host")
    for name, ok in out["targets"].items():
        lines.append(f"target {name}: {'met' if ok else 'MISSED'}")
    if out["simulated"]:
        lines.append("simulated device: the numbers are not GPU numbers; targets not judged")
    return "\n".join(lines)


def main(argv=None):
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--nbytes", help="bytes to sleep and wake (default 10GiB; 1GiB with "
                                    "--quick; 80MiB with --simulated)")
    p.add_argument("--reps", type=int, help="rounds (default 7; 2 with --quick)")
    args = p.parse_args(argv)
    from gpupool.limits import parse_limit

    reps = args.reps or (2 if args.quick else 7)
    if reps < 1:
        p.error("--reps must be >= 1")
    asked = (parse_limit(args.nbytes) if args.nbytes else
             SIM_NBYTES if args.simulated else QUICK_NBYTES if args.quick else GPU_NBYTES)
    if args.simulated:
        nbytes = fit(asked, 1 << 62, 1 << 62)
    else:
        pool, reason = _common.gpu_pool()
        if reason is not None:
            _common.skip(SCRIPT, reason, args.json)
        free, _ = pool.mem_info()
        nbytes = fit(asked, free, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    start = time.perf_counter()
    first, samples, facts = run(nbytes, reps, args.simulated)
    rows, targets = summarize(first, samples, nbytes, args.simulated)
    out = {"script": SCRIPT, "unit": "seconds per op", "nbytes": nbytes, "pieces": PIECES,
           "reduced_from": asked if nbytes + PIECES * PAGE <= asked else None, "reps": reps,
           "simulated": args.simulated, "quick": args.quick, "env": _common.environment(),
           "first": first, "rows": rows, "targets": targets, "pool": facts}
    return _common.finish(out, start, report, args.json)


if __name__ == "__main__":
    sys.exit(main())
