"""bench/region_memory.py's pieces on CPU: the varying batches and when reserved memory may
be flat, and the text of its targets."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench"))

import _region_report  # noqa: E402
import region_memory  # noqa: E402
from _common import MiB  # noqa: E402


def test_region_memory_varying_batches_are_the_same_for_every_way_and_flatness_waits_for_them():
    sizes = region_memory.batch_sizes(40, [64, 128, 256])
    assert sizes == region_memory.batch_sizes(40, [64, 128, 256]) and set(sizes) == {64, 128, 256}
    assert region_memory.batch_sizes(3) == [region_memory.BATCH] * 3
    seen = region_memory.all_seen_step(sizes)
    assert set(sizes[:seen]) == {64, 128, 256} and len(set(sizes[:seen - 1])) == 2
    # Reserved grows until every size was seen, then stays: flat from the step after.
    reserved = [10, 20, 20, 30] + [30] * 6
    record = {"peak_measured": True, "per_step": {
        "ms": [1.0] * 10, "peak_in_use": [5] * 10, "in_use": [5] * 10, "reserved": reserved,
        "peak_reserved": reserved}}
    assert not _region_report.summarize(record, None)["flat"]
    assert _region_report.summarize(record, None, flat_from=4)["flat"]


def test_region_memory_targets_name_what_each_ratio_is_over():
    summaries = {"cupy-default": {"peak_reserved": 400 * MiB, "ms_median": 2.0},
                 "gpupool-region": {"peak_reserved": 100 * MiB, "ms_median": 1.0,
                                    "flat_from": 2, "growth": 0, "flat": True}}
    out = {"summaries": summaries, "batches": [64, 256], "model": {"batch": 256},
           "targets": _region_report.targets(summaries, 80 * MiB)}
    text = _region_report.targets_text(out)
    assert "1.25x (100.0 / 80.0 MiB)" in text and "0.25x (100.0 / 400.0 MiB)" in text
    assert _region_report.batch_text(out) == "batch drawn from 64,256"
