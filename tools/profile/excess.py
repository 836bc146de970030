"""Where a pool's reserved bytes above the run floor go, at the moment its peak is set.

Replays recorded traces (``bench/data/traces-real``) through a fresh ``gpupool.Pool`` on the
expandable simulated device (as ``bench/fragmentation.py``'s "vmm" column) and, just before the
allocation that last grows the pool to its peak reserved bytes, breaks the reserved bytes
down: live bytes (rounded to 512 B), and the free bytes by size, by whole pages and partial
pages, by whether the cold-page mover of the growth (core/growexpand.pxd, ``sg_reclaim``)
could take their pages (a free block is warm when one of the last ``COLD_ALLOCS``
allocations overlapped it), by region and by stream. It also names the step and the request
that set the peak, and the step and reserved bytes at the run floor's moment (the most bytes
live at once). Run from the repository root::

    PYTHONPATH=$PWD python tools/profile/excess.py [TRACE ...] [--region]

``TRACE``: names in ``bench/data/traces-real`` (default: gpt2-ckpt llama-ckpt); ``--region``
enters a plain ``gpupool.Region`` at each step start, as fragmentation.py's "vmm + region"
column. Output: one block of lines per trace, MiB.
"""

import argparse
import bisect
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import alloc_trace  # noqa: E402
import fragmentation  # noqa: E402
import numpy as np  # noqa: E402

import gpupool  # noqa: E402
from gpupool.core.pool import _snapshot_of  # noqa: E402

MiB = 1 << 20
PAGE = 2 << 20              # the expandable device's page (core/segments.pxd PAGE_BYTES)
COLD_ALLOCS = 128           # core/segments.pxd: a free block untouched this long is cold
SIZE_BINS = (PAGE, 20 * MiB, 100 * MiB)


def replay(trace, stop=None, region=False):
    """Replay ``trace`` through a fresh pool on the expandable simulated device up to event
    ``stop`` (excluded; None: all), as fragmentation.py does; returns (pool, live {id:
    buffer}, reserved bytes after each event, the last COLD_ALLOCS allocations [(ptr,
    nbytes)])."""
    n = len(trace) if stop is None else stop
    reserved, recent, pool, live = np.zeros(n, np.int64), [], None, {}
    for k, op, i, sim, pool, _, live in fragmentation.replay(gpupool, trace, "vmm", region,
                                                            stop=stop):
        if not op:
            recent.append((live[i].ptr, int(trace.nbytes[k])))
        reserved[k] = sim.device_bytes     # the pool's reserved bytes; reading them here
        # leaves the pool alone (pool.stats() would freeze and thaw the thread's magazine)
    return pool, live, reserved, recent[-COLD_ALLOCS:]


def step_of(trace, k):
    """The step (0-based; -1: before the first) that event k is in."""
    return bisect.bisect_right(trace.meta.get("step_starts", [0]), k) - 1


def whole_pages(lo, size):
    """Bytes of whole pages inside [lo, lo + size) (pages counted from address 0)."""
    a, b = -(-lo // PAGE) * PAGE, (lo + size) // PAGE * PAGE
    return max(b - a, 0)


def breakdown(trace, region=False):
    """The breakdown as a dict (bytes), see the module docstring."""
    _, _, reserved, _ = replay(trace, region=region)
    peak = int(reserved.max())
    k = int(np.argmax(reserved == peak))            # the event that set the peak
    ev = trace.events()
    live_curve = np.cumsum(np.where(trace.op == 0, (trace.nbytes + 511) // 512 * 512,
                                    -((trace.nbytes + 511) // 512 * 512)))
    floor_k = int(np.argmax(live_curve))
    pool, live, before, recent = replay(trace, stop=k, region=region)
    _, segments, _, _ = _snapshot_of(pool, {})
    op, _, n, s = ev[k]
    assert op == 0, "the peak is set by an allocation"
    live_bytes = sum((b.nbytes + 511) // 512 * 512 for b in live.values())
    free = [(r[0], r[1], r[4], seg[1]) for seg in segments for r in seg[4]
            if r[3] != "active_allocated"]
    out = {"trace": trace.name, "peak_reserved": peak, "peak_event": k,
           "peak_step": step_of(trace, k), "request": n,
           "reserved_before": int(before[-1]) if len(before) else 0,
           "live_before": live_bytes, "floor": int(live_curve[floor_k]),
           "floor_event": floor_k, "floor_step": step_of(trace, floor_k),
           "reserved_at_floor": int(reserved[floor_k]),
           "step_live_peaks": [], "step_reserved_peaks": []}
    bounds = [*trace.meta.get("step_starts", [0]), len(ev)]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        out["step_live_peaks"].append(int(live_curve[lo:hi].max()))
        out["step_reserved_peaks"].append(int(reserved[lo:hi].max()))
    free_bytes = sum(f[1] for f in free)
    out["free"] = free_bytes
    out["free_blocks"] = len(free)
    out["largest_free"] = max((f[1] for f in free), default=0)
    out["free_ge_request"] = sum(f[1] for f in free if f[1] >= n)
    out["free_by_size"] = {}
    for lo, hi in zip((0, *SIZE_BINS), (*SIZE_BINS, 1 << 62), strict=True):
        out["free_by_size"][f"[{lo // MiB},{hi // MiB if hi < 1 << 62 else 'inf'}) MiB"] = \
            sum(f[1] for f in free if lo <= f[1] < hi)
    whole = sum(whole_pages(f[0], f[1]) for f in free)
    out["free_whole_pages"] = whole
    out["free_partial_pages"] = free_bytes - whole

    def warm(f):
        return any(p < f[0] + f[1] and f[0] < p + m for p, m in recent)

    out["free_whole_pages_cold"] = sum(whole_pages(f[0], f[1]) for f in free if not warm(f))
    out["free_whole_pages_warm"] = whole - out["free_whole_pages_cold"]
    out["free_region_tagged"] = sum(f[1] for f in free if f[2])
    # the pages the growth for this request maps: the request less a free tail it joins
    last = max(free, key=lambda f: f[0] + f[1], default=None)
    ends = max((r[0] + r[1] for seg in segments for r in seg[4]), default=0)
    tail = last[1] if last is not None and last[0] + last[1] == ends else 0
    out["growth_tail_joined"] = tail if tail < n else 0
    out["growth_need"] = -(-(n - out["growth_tail_joined"]) // PAGE) * PAGE
    return out


def report(out):
    m = lambda b: f"{b / MiB:,.1f}"  # noqa: E731
    print(f"== {out['trace']}")
    print(f"peak reserved {m(out['peak_reserved'])}, set at event {out['peak_event']} "
          f"(step {out['peak_step']}) by a request of {m(out['request'])}")
    print(f"  run floor {m(out['floor'])} at event {out['floor_event']} (step "
          f"{out['floor_step']}), reserved then {m(out['reserved_at_floor'])}; excess "
          f"{m(out['peak_reserved'] - out['floor'])}")
    print(f"  before the request: reserved {m(out['reserved_before'])} = live "
          f"{m(out['live_before'])} + free {m(out['free'])} in {out['free_blocks']} blocks "
          f"(largest {m(out['largest_free'])}; >= request: {m(out['free_ge_request'])})")
    print("  free by size: " + ", ".join(f"{k} {m(v)}" for k, v in out["free_by_size"].items()))
    print(f"  free whole pages {m(out['free_whole_pages'])} (cold {m(out['free_whole_pages_cold'])}"
          f", warm {m(out['free_whole_pages_warm'])}), partial pages "
          f"{m(out['free_partial_pages'])}, region-tagged {m(out['free_region_tagged'])}")
    print(f"  the growth: joins a free tail of {m(out['growth_tail_joined'])}, maps "
          f"{m(out['growth_need'])}")
    print("  step live peaks:     " + " ".join(f"{v / MiB:7.0f}" for v in out["step_live_peaks"]))
    print("  step reserved peaks: " + " ".join(f"{v / MiB:7.0f}"
                                               for v in out["step_reserved_peaks"]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*", default=["gpt2-ckpt", "llama-ckpt"])
    ap.add_argument("--region", action="store_true")
    args = ap.parse_args(argv)
    d = os.path.join(ROOT, "bench", "data", "traces-real")
    for name in args.traces:
        report(breakdown(alloc_trace.load(os.path.join(d, name + ".npz")), args.region))


if __name__ == "__main__":
    main()
