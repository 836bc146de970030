"""The summaries, targets, report and plot of bench/region_memory.py: per way, the figures of
its table from its per-step record (median ms per step, peaks, flatness of reserved memory,
peak reserved over the working set of the step), the targets of the region ways, the text and
the PNG of reserved memory over the steps."""

import os
import statistics

from _common import MiB, format_table
from _region_ways import REGION_WAYS, WAYS

STEADY_FROM = 3          # steps 1-2 fill the caches: medians and the working set from step 3
RESERVED_TARGET = 1.1    # a region way's peak reserved / working set
TIME_TARGET = 1.0        # a region way's ms/step / cupy-default's


def _steady(values):
    return values[STEADY_FROM - 1:] or values


def working_set(ways, varying=False):
    """The working set of the step, from the first region way that ran (None if none did).

    The pool's peak bytes in use within a steady step: what was alive at the step's start
    (parameters, data) plus the step's own peak (``region.stats().peak_in_use_bytes``).
    Medians over the steps from :data:`STEADY_FROM`; with varying batches (``varying``), the
    largest step's.
    """
    pick = max if varying else statistics.median_low
    for name in REGION_WAYS:
        per_step = ways.get(name, {}).get("per_step")
        if per_step:
            return {"bytes": pick(_steady(per_step["peak_in_use"])),
                    "at_start_bytes": pick(_steady(per_step["in_use_at_start"])),
                    "step_peak_bytes": pick(_steady(per_step["region_peak"])),
                    "from": name}
    return None


def summarize(record, ws_bytes, flat_from=2):
    """Per-way figures of the table from its per-step record; flatness counts from step
    ``flat_from`` (the step after which every batch size was seen)."""
    p = record["per_step"]
    reserved = p["reserved"]
    peaks = p["peak_in_use"] if record["peak_measured"] else p["in_use"]
    peak_reserved = max(p["peak_reserved"])
    summary = {
        "steps": len(p["ms"]),
        "ms_median": statistics.median(_steady(p["ms"])),
        "ms_min": min(_steady(p["ms"])),
        "ms_max": max(_steady(p["ms"])),
        "peak_in_use": max(peaks),
        "peak_in_use_sampled": not record["peak_measured"],
        "peak_reserved": peak_reserved,
        "reserved_step2": reserved[1] if len(reserved) >= 2 else None,
        "reserved_last": reserved[-1],
        "flat_from": flat_from,         # reserved is flat after this step (1-based)
        "flat": None,
        "growth": None,
        "peak_reserved_over_working_set": peak_reserved / ws_bytes if ws_bytes else None,
    }
    if len(reserved) >= flat_from:
        k = flat_from - 1
        summary["flat"] = all(r == reserved[k] for r in reserved[k:])
        summary["growth"] = max(reserved[k:]) - reserved[k]
    return summary


def targets(summaries, ws_bytes):
    """The targets of the region ways: value, limit, ok."""
    checks = []
    base = summaries.get("cupy-default")
    for name in REGION_WAYS:
        s = summaries.get(name)
        if s is None:
            continue
        checks.append({"way": name, "target": f"reserved flat after step {s['flat_from']}",
                       "value": s["growth"], "limit": 0,
                       "ok": bool(s["flat"])})
        if ws_bytes:
            ratio = s["peak_reserved"] / ws_bytes
            checks.append({"way": name,
                           "target": f"peak reserved <= {RESERVED_TARGET}x working set",
                           "value": ratio, "limit": RESERVED_TARGET, "over": ws_bytes,
                           "ok": ratio <= RESERVED_TARGET})
        if base is not None:
            ratio = s["ms_median"] / base["ms_median"]
            checks.append({"way": name, "target": "ms/step <= cupy-default's",
                           "value": ratio, "limit": TIME_TARGET, "ok": ratio <= TIME_TARGET})
            ratio = s["peak_reserved"] / base["peak_reserved"]
            checks.append({"way": name, "target": "peak reserved <= cupy-default's",
                           "value": ratio, "limit": 1.0, "over": base["peak_reserved"],
                           "ok": ratio <= 1.0})
    return checks


def mib_text(nbytes):
    return "-" if nbytes is None else f"{nbytes / MiB:,.1f}"


def _flat(s):
    if s["flat"] is None:
        return "-"
    return "yes" if s["flat"] else f"no (+{mib_text(s['growth'])})"


def batch_text(out):
    """'batch 256', or 'batch drawn from 64,128,256' with varying batches."""
    if out.get("batches"):
        return "batch drawn from " + ",".join(str(b) for b in out["batches"])
    return f"batch {out['model']['batch']}"


def table(out):
    """The per-way table."""
    headers = ["way", "steps", "ms/step", "peak in use", "peak reserved", "reserved @2",
               "reserved @last", "flat after 2?", "peak res / WS"]
    rows = []
    for name, s in out["summaries"].items():
        ratio = s["peak_reserved_over_working_set"]
        rows.append([name, str(s["steps"]), f"{s['ms_median']:.3f}",
                     mib_text(s["peak_in_use"]) + ("*" if s["peak_in_use_sampled"] else ""),
                     mib_text(s["peak_reserved"]), mib_text(s["reserved_step2"]),
                     mib_text(s["reserved_last"]), _flat(s),
                     "-" if ratio is None else f"{ratio:.2f}x"])
    m = out["model"]
    title = (f"{m['depth']} x {m['width']} MLP, {batch_text(out)}, float32; bytes in MiB; "
             f"ms/step: median of steps {STEADY_FROM} to the last; WS = working set")
    return format_table(headers, rows, title)


def targets_text(out):
    lines = ["targets:"]
    for t in out["targets"]:
        if t["target"].startswith("reserved flat"):
            value = "flat" if t["ok"] else f"+{mib_text(t['value'])} MiB"
        elif t["target"].startswith("ms/step"):
            value = (f"{t['value']:.2f}x ({out['summaries'][t['way']]['ms_median']:.3f} vs "
                     f"{out['summaries']['cupy-default']['ms_median']:.3f} ms)")
        else:
            value = f"{t['value']:.2f}x ({mib_text(out['summaries'][t['way']]['peak_reserved'])} "
            value += f"/ {mib_text(t['over'])} MiB)"
        lines.append(f"  [{'ok' if t['ok'] else 'MISS'}] {t['way']}: {t['target']}: {value}")
    if len(lines) == 1:
        lines.append("  none judged (no region way ran)")
    return "\n".join(lines)


def notes_text(out):
    lines = ["notes:"]
    ws = out["working_set"]
    if ws is not None:
        lines.append(
            f"  working set: {mib_text(ws['bytes'])} MiB, the pool's peak in use within a step of "
            f"{ws['from']} (median from step {STEADY_FROM}) = {mib_text(ws['at_start_bytes'])} MiB "
            f"alive at the step's start (parameters, data) + {mib_text(ws['step_peak_bytes'])} MiB "
            "the step's own peak (region.stats().peak_in_use_bytes)")
    if any(s["peak_in_use_sampled"] for s in out["summaries"].values()):
        lines.append("  * CuPy's pool: used_bytes() sampled at the end of each step, not a true "
                     "peak (its reserved bytes only grow, so their peak is exact)")
    short = {n: s["steps"] for n, s in out["summaries"].items() if s["steps"] < out["steps"]}
    for name, n in short.items():
        lines.append(f"  {name} ran {n} steps, not {out['steps']} (--gc-steps: a full "
                     f"collection per step is slow); its 'reserved @last' is step {n}")
    torch = out["torch"]
    lines.append(f"  PyTorch {torch['version']} imported first" if torch["imported"] else
                 f"  PyTorch not imported ({torch['reason']}): fewer objects for the collector "
                 "to walk, so full collections are cheaper than in a real job")
    lines.append(f"  objects tracked by the garbage collector at the start: "
                 f"{out['gc_tracked_objects']:,}")
    firsts = {name: r["losses"].get("1") for name, r in out["ways"].items() if "losses" in r}
    if firsts and max(firsts.values()) - min(firsts.values()) > 1e-3 * abs(min(firsts.values())):
        lines.append(f"  the loss at step 1 differs between ways: {firsts}")
    for name, record in out["ways"].items():
        if "error" in record:
            lines.append(f"  {name}: error: {record['error']}")
    if out["plot"]:
        lines.append(f"  plot of reserved memory over the steps: {out['plot']}")
    else:
        lines.append(f"  plot skipped: {out['plot_skipped']}")
    return "\n".join(lines)


def legend_text():
    return "\n".join(["ways:", *(f"  {name:19} {label}" for name, label in WAYS.items())])


def report(out):
    parts = [table(out), targets_text(out), notes_text(out), legend_text()]
    return "\n\n".join(parts)


def plot(out, path):
    """Reserved MiB over the steps, every way, into a PNG; ``(path, None)`` or
    ``(None, reason)``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import LogFormatter
    except Exception as exc:  # any failure means no plot
        return None, f"matplotlib not importable ({type(exc).__name__}: {exc})"
    styles = ["-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1))]
    fig, ax = plt.subplots(figsize=(10, 5.5))
    for i, (name, record) in enumerate(out["ways"].items()):
        if "per_step" not in record:
            continue
        reserved = [r / MiB for r in record["per_step"]["reserved"]]
        ax.plot(range(1, len(reserved) + 1), reserved, label=name,
                linestyle=styles[i % len(styles)], linewidth=1.6)
    if out["working_set"] is not None:
        ax.axhline(out["working_set"]["bytes"] / MiB, color="grey", linewidth=0.8,
                   linestyle=":", label="working set")
    ax.set_yscale("log")
    for set_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        set_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.set_xlabel("step")
    ax.set_ylabel("reserved after the step (MiB, log scale)")
    m = out["model"]
    ax.set_title(f"region_memory: {m['depth']} x {m['width']} MLP, {batch_text(out)}, "
                 "tape in reference cycles")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path, None
