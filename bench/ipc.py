"""CUDA IPC of gpupool buffers: the time to export, open and close one handle.

A producer (this process) and a consumer (a process started with 'spawn'), per upstream that
exports: "driver" (``cuIpcGetMemHandle`` of the segment; ``cuIpcOpenMemHandle``) and "vmm"
(one POSIX file descriptor per 2 MiB page, ``cuMemExportToShareableHandle``; imported with
``cuMemImportFromShareableHandle`` and mapped). One buffer of 1 MiB. Columns, µs per op:

* ``export``: ``buf.ipc_handle()`` of a live buffer (its export slot and event reused: an
  event record and the handle; on "vmm" a ``dup`` of the page's descriptor);
* ``export.new``: ``pool.allocate`` + ``ipc_handle()`` + free: a new buffer each time (a new
  slot and IPC event; the segment's handle is kept);
* ``open+close``: in the consumer, ``gpupool.open_ipc(handle)`` + ``close()``: the mapping made
  and unmapped each time (``close`` waits for the device first: ``cuCtxSynchronize``);
* ``open+close.cached``: the same while another buffer of the allocation stays open ("driver":
  the mapping is cached, so only the export table's checks and the event wait remain; "vmm"
  maps each open, so it equals ``open+close``);
* ``round trip``: export + the handle through a ``multiprocessing`` pipe (the page
  descriptors by descriptor passing) + open + close + an answer back: one handle's whole
  hand-off.

Run::

    python bench/ipc.py [--json PATH] [--quick] [--simulated]

``--simulated`` runs on ``SimulatedDevice(shareable=True)`` (memfd host memory): it checks the
harness; its numbers are not GPU numbers.
"""

import multiprocessing
import sys
import time

import _common
from _common import MiB, format_table, measure

SCRIPT = "ipc"
NBYTES = 1 * MiB
COLUMNS = ["export", "export.new", "open+close", "open+close.cached", "round trip"]
PLAN = {"reps": 15, "ops": 200}
QUICK_PLAN = {"reps": 3, "ops": 20}


def make_pool(upstream, simulated):
    import gpupool
    from gpupool.testing import SimulatedDevice

    if simulated:
        return gpupool.Pool(upstream=SimulatedDevice(
            capacity="1GiB", shareable=True, virtual_memory=upstream == "vmm",
            page=64 << 10))
    return gpupool.Pool(device=0, upstream=upstream)


def consumer(conn, upstream, simulated, plan):
    """The consumer: time open + close of the handles it is sent; answer round trips."""
    import gpupool

    pool = make_pool(upstream, simulated)
    conn.send("ready")
    while True:
        message = conn.recv()
        if message is None:
            return
        what, handle, other = message
        if what == "round trip":
            gpupool.open_ipc(handle, pool=pool).close()
            conn.send(None)
            continue
        keep = gpupool.open_ipc(other, pool=pool) if what == "open+close.cached" else None

        def batch(ops, handle=handle):
            for _ in range(ops):
                gpupool.open_ipc(handle, pool=pool).close()

        timing = measure(batch, reps=plan["reps"], ops=plan["ops"])
        del keep
        conn.send(timing.as_dict())


def run(upstream, simulated, plan):
    """The columns of one upstream: {column: Timing dict}."""
    pool = make_pool(upstream, simulated)
    ctx = multiprocessing.get_context("spawn")
    conn, theirs = ctx.Pipe()
    worker = ctx.Process(target=consumer, args=(theirs, upstream, simulated, plan))
    worker.start()
    assert conn.recv() == "ready"
    buf, other = pool.allocate(NBYTES), pool.allocate(NBYTES)
    row = {}

    def export(ops):
        for _ in range(ops):
            buf.ipc_handle()

    def export_new(ops):
        for _ in range(ops):
            pool.allocate(NBYTES).ipc_handle()

    def round_trip(ops):
        for _ in range(ops):
            conn.send(("round trip", buf.ipc_handle(), None))
            conn.recv()

    row["export"] = measure(export, reps=plan["reps"], ops=plan["ops"]).as_dict()
    row["export.new"] = measure(export_new, reps=plan["reps"], ops=plan["ops"]).as_dict()
    for what in ("open+close", "open+close.cached"):
        conn.send((what, buf.ipc_handle(), other.ipc_handle()))
        row[what] = conn.recv()
    row["round trip"] = measure(round_trip, reps=plan["reps"], ops=plan["ops"]).as_dict()
    conn.send(None)
    worker.join(60)
    return row


def report(out):
    rows = [[upstream] + [f"{out['rows'][upstream][c]['median'] / 1e3:,.1f}" for c in COLUMNS]
            for upstream in out["rows"]]
    return format_table(["µs per op", *COLUMNS], rows,
                        title=f"CUDA IPC of one {NBYTES // MiB} MiB buffer (median of "
                              f"{out['plan']['reps']} batches)")


def main(argv=None):
    args = _common.parser(__doc__.splitlines()[0]).parse_args(argv)
    if not args.simulated:
        _, reason = _common.gpu_pool()
        if reason is not None:
            _common.skip(SCRIPT, reason, args.json)
    plan = QUICK_PLAN if args.quick else PLAN
    start = time.perf_counter()
    out = {"script": SCRIPT, "unit": "ns per op", "nbytes": NBYTES, "plan": plan,
           "simulated": args.simulated, "quick": args.quick, "env": _common.environment(),
           "rows": {upstream: run(upstream, args.simulated, plan)
                    for upstream in ("driver", "vmm")}}
    return _common.finish(out, start, report, args.json)


if __name__ == "__main__":
    sys.exit(main())
