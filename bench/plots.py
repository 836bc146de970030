"""PNG plots of a ``run_all.py`` run, from its ``results.json`` (matplotlib, optional).

* ``alloc_latency.png``: ns per cached allocate + free against the request size, one line per
  allocator column (log scales);
* ``threads.png``: allocate + free pairs per second, all threads together, against threads;
* ``trace_replay.png``: peak reserved / peak live bytes per trace and allocator.

A plot of a run on the simulated device (``--simulated``) says so in its title.

``run_all.py`` calls :func:`write_all` at its end; run alone::

    python bench/plots.py /tmp/gpupool-bench/results.json [--out DIR]
"""

import argparse
import json
import os
import sys


def _pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


MARKERS = "osD^v<>ph*Xd"


def _style(i, key):
    """Line style of column i: gpupool's columns solid, its peers' dashed; markers cycle, so
    lines that share a colour (more columns than colours) still differ."""
    ours = key.startswith("gp") or key.endswith(".gp")
    return {"marker": MARKERS[i % len(MARKERS)], "linestyle": "-" if ours else "--"}


def _title(res, text):
    """A plot's title; a run on the simulated device says so (its numbers are host memory's)."""
    return f"{text} (simulated device, not a GPU)" if res.get("simulated") else text


def _results(summary, name):
    return summary.get("scripts", {}).get(name, {}).get("results")


def alloc_latency(plt, res, path):
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, (key, column) in enumerate(res.get("columns", {}).items()):
        points = sorted((int(n), r["median"]) for n, r in column.get("results", {}).items())
        if points:
            ax.plot(*zip(*points, strict=True), label=key, **_style(i, key))
    ax.set(xscale="log", yscale="log", xlabel="request size (bytes)",
           ylabel="ns per allocate + free (median)",
           title=_title(res, "Cached allocate + free, legacy default stream"))
    ax.legend(fontsize=8, ncol=2)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def threads(plt, res, path):
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (key, column) in enumerate(res.get("columns", {}).items()):
        points = sorted((int(t), r["ops_per_s"]["median"] / 1e6)
                        for t, r in column.get("results", {}).items())
        if points:
            ax.plot(*zip(*points, strict=True), label=key, **_style(i, key))
    ax.set(xscale="log", xlabel="threads", ylabel="million pairs per second (all threads)",
           title=_title(res, "Allocate + free throughput from several threads"))
    ax.set_xticks(res.get("threads", [1, 2, 4, 8]), labels=res.get("threads", [1, 2, 4, 8]))
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def trace_replay(plt, res, path):
    traces = res.get("traces", {})
    keys = sorted({k for t in traces.values() for k in t.get("columns", {})})
    fig, ax = plt.subplots(figsize=(8, 5))
    width = 0.8 / max(len(keys), 1)
    for i, key in enumerate(keys):
        values = [t.get("columns", {}).get(key, {}).get("reserved_over_live", 0)
                  for t in traces.values()]
        ax.bar([j + i * width for j in range(len(traces))], values, width, label=key)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(traces))], labels=list(traces))
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(ylabel="peak reserved / peak live",
           title=_title(res, "Fragmentation on recorded traces"))
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


PLOTS = {"alloc_latency": alloc_latency, "threads": threads, "trace_replay": trace_replay}


def write_all(summary, out_dir):
    """Write every plot whose script ran; returns ``(paths written, reasons for the rest)``."""
    plt = _pyplot()
    if plt is None:
        return [], ["matplotlib is not installed: no plots"]
    written, missing = [], []
    for name, draw in PLOTS.items():
        res = _results(summary, name)
        if not res or isinstance(res.get("skipped"), str):     # the whole script skipped
            missing.append(f"{name}: no results")
            continue
        path = os.path.join(out_dir, f"{name}.png")
        draw(plt, res, path)
        written.append(path)
    return written, missing


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="results.json of a run_all.py run")
    p.add_argument("--out", help="folder for the PNGs (default: that of results.json)")
    args = p.parse_args(argv)
    with open(args.results) as f:
        summary = json.load(f)
    written, missing = write_all(summary, args.out or os.path.dirname(args.results) or ".")
    for line in written + missing:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
