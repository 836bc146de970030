// gpupool's counters (the C API's gpupool_stats) as PyTorch's statistics of
// torch.cuda.memory_stats() (c10's DeviceStats), with the keys of gpupool.Pool.memory_stats()
// (stats.py) from the same counters. Part of torch_allocator.cc's translation unit.
#ifndef GP_TORCH_STATS_H
#define GP_TORCH_STATS_H

#include <gpupool.h>

#include <c10/cuda/CUDACachingAllocator.h>

#include <cstddef>
#include <cstdint>

namespace {

using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::Stat;
using c10::CachingDeviceAllocator::StatArray;
using c10::CachingDeviceAllocator::StatType;

// Cumulative counters at the last resetAccumulatedStats (gpupool's own counters are kept).
struct Accumulated {
  size_t num_allocs = 0, num_frees = 0, allocated_bytes = 0, freed_bytes = 0;
  size_t upstream_allocs = 0, upstream_frees = 0, oom_retries = 0, num_ooms = 0;
};

void set_stat(StatArray& stats, int64_t current, int64_t peak, int64_t allocated,
              int64_t freed) {
  Stat& s = stats[static_cast<size_t>(StatType::AGGREGATE)];
  s.current = current;
  s.peak = peak;
  s.allocated = allocated;
  s.freed = freed;
}

// The statistics of counters `s`, the cumulative ones counted from `base` (the counters at the
// last resetAccumulatedStats).
DeviceStats device_stats(const gpupool_stats& s, const Accumulated& base) {
  DeviceStats stats;
  auto count = [](size_t value, size_t since) { return static_cast<int64_t>(value - since); };
  int64_t live = static_cast<int64_t>(s.num_allocs - s.num_frees);
  int64_t segments = static_cast<int64_t>(s.upstream_allocs - s.upstream_frees);
  for (StatArray* bytes : {&stats.allocated_bytes, &stats.active_bytes,
                           &stats.requested_bytes}) {
    set_stat(*bytes, s.in_use_bytes, s.peak_in_use_bytes,
             count(s.allocated_bytes, base.allocated_bytes),
             count(s.freed_bytes, base.freed_bytes));
  }
  set_stat(stats.reserved_bytes, s.reserved_bytes, s.peak_reserved_bytes, 0, 0);
  for (StatArray* blocks : {&stats.allocation, &stats.active}) {
    set_stat(*blocks, live, live, count(s.num_allocs, base.num_allocs),
             count(s.num_frees, base.num_frees));
  }
  set_stat(stats.segment, segments, segments, count(s.upstream_allocs, base.upstream_allocs),
           count(s.upstream_frees, base.upstream_frees));
  stats.num_alloc_retries = count(s.oom_retries, base.oom_retries);
  stats.num_ooms = count(s.num_ooms, base.num_ooms);
  stats.num_device_alloc = count(s.upstream_allocs, base.upstream_allocs);
  stats.num_device_free = count(s.upstream_frees, base.upstream_frees);
  return stats;
}

}  // namespace

#endif  // GP_TORCH_STATS_H
