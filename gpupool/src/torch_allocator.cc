// gpupool's allocator for PyTorch: a c10::cuda::CUDACachingAllocator::CUDAAllocator whose
// memory comes from gpupool's C API (gpupool.h), installed by gpupool.torch.use().
//
// It is compiled on first use, against the installed PyTorch's headers and libraries
// (gpupool/adapters/torch_allocator.py), never shipped built: its virtual functions must be laid out
// as the installed PyTorch's CUDAAllocator lays them out. Where PyTorch versions differ, the
// TORCH_VERSION_* macros choose (2.11 and 2.13 are compiled in the tests).
//
// What it adds to PyTorch's pluggable allocator (which offers malloc and free only):
// - malloc and free go straight to the C API's table: no Python, no GIL, no lock of its own
//   (gpupool's pool is thread-safe); a free finds its block by pointer (free_ptr);
// - the statistics of torch.cuda.memory_stats() from gpupool's counters (getDeviceStats),
//   their resets, empty_cache() (a trim), cacheInfo (cuDNN's workspace limit),
//   Tensor.record_stream (the C API's record_stream), getBaseAllocation;
// - private memory pools for CUDA graphs and torch.cuda.MemPool (beginAllocateToPool and
//   the rest): each is a gpupool private pool (the C API's private_* functions), so a
//   captured graph's memory stays its own until the graph is gone, at the same addresses
//   for every replay. During a capture, gpupool's calls run in the relaxed capture mode, as
//   PyTorch's own cudaMalloc does there, and the free of a block with record_stream uses is
//   held until no capture routes allocations (its events would be recorded on a capturing
//   stream);
// - out of memory throws c10::OutOfMemoryError (torch.OutOfMemoryError in Python, which
//   cuDNN's and others' fallbacks catch) with gpupool's message.
#include <gpupool.h>  // first: it includes Python.h

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/version.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

// CUDAAllocator::attachOomRejectionObserver is pure virtual from PyTorch 2.13 on.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
#define GPUPOOL_TORCH_OOM_REJECTION 1
#endif

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::MempoolId_t;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::Stat;
using c10::CachingDeviceAllocator::StatArray;
using c10::CachingDeviceAllocator::StatType;

constexpr int kMaxDevices = 64;  // the devices gpupool's C-level pool table covers

// gpupool.torch's message for a failed allocation (gpupool_torch_failure_message in
// adapters/torch_entry.pyx): writes it to out, counts an out-of-memory failure, returns 1 for one. Takes
// the GIL.
using DescribeFn = int (*)(int status, int device, size_t size, char* out, size_t capacity);

// gpupool.torch's allocate that gathers the calling thread's Python frames first while the
// memory history records (gpupool_torch_allocate_gathering in adapters/torch_entry.pyx), and the history's
// switch (gpupool_torch_recording: nonzero while it records).
using GatheringFn = int (*)(int device, size_t size, uintptr_t stream, void** ptr);
struct Hooks {
  DescribeFn describe = nullptr;
  GatheringFn allocate_gathering = nullptr;
  const int* recording = nullptr;
};

// A private memory pool of PyTorch's (a CUDA graph's, a MemPool's) on one device.
struct PrivatePool {
  void* handle = nullptr;  // the C API's private pool
  int use_count = 0;       // graphs, MemPools and allocation routes that use it
};

// beginAllocateToPool's routing: allocations whose stream `filter` accepts go to pool `id`.
struct Route {
  MempoolId_t id;
  std::function<bool(cudaStream_t)> filter;
};

// getCheckpointState's record of a private pool: its live allocations (pointer, bytes).
struct Checkpoint : cca::AllocatorState {
  c10::DeviceIndex device = 0;
  MempoolId_t id{0, 0};
  std::vector<std::pair<uintptr_t, size_t>> live;
};

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

void gp_delete(void* ptr);

class GpupoolAllocator final : public cca::CUDAAllocator {
 public:
  GpupoolAllocator(const gpupool_api* api, const Hooks& hooks)
      : api_(api), describe_(hooks.describe), allocate_gathering_(hooks.allocate_gathering),
        recording_(hooks.recording != nullptr ? hooks.recording : &kNotRecording) {
    for (auto& seen : seen_) seen.store(false, std::memory_order_relaxed);
  }

  // Allocation ----------------------------------------------------------------------------

  void* malloc(c10::DeviceIndex device, size_t size, cudaStream_t stream) {
    if (size == 0) return nullptr;
    note_device(device);
    void* ptr = nullptr;
    auto s = reinterpret_cast<uintptr_t>(stream);
    int status = C10_UNLIKELY(routes_.load(std::memory_order_acquire) != 0)
        ? malloc_routed(device, size, stream, &ptr)
        : C10_UNLIKELY(*recording_ != 0 && allocate_gathering_ != nullptr)
        ? allocate_gathering_(device, size, s, &ptr)
        : api_->allocate(device, size, s, &ptr);
    if (C10_UNLIKELY(status != GPUPOOL_OK)) ptr = retry_or_throw(status, device, size, stream);
    return ptr;
  }

  // Frees a pointer from malloc; false if gpupool did not hand it out.
  bool free(void* ptr) {
    if (ptr == nullptr) return true;
    if (C10_UNLIKELY(recorded_.load(std::memory_order_acquire) != 0) && defer(ptr)) return true;
    return api_->free_ptr(last_device_.load(std::memory_order_relaxed), ptr) == GPUPOOL_OK;
  }

  c10::DataPtr allocate(size_t size) override {
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    void* ptr = malloc(device, size, c10::cuda::getCurrentCUDAStream(device).stream());
    return {ptr, ptr, &gp_delete, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &gp_delete; }

  void* raw_alloc(size_t nbytes) override {
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return malloc(device, nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return malloc(device, nbytes, stream);
  }

  void raw_delete(void* ptr) override {
    TORCH_CHECK(free(ptr), "gpupool: raw_delete of ", ptr,
                ", which gpupool's allocator did not hand out (or freed already)");
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // Lifecycle and settings ----------------------------------------------------------------

  void init(int device_count) override {
    device_count_ = device_count;
    initialized_ = true;
  }

  bool initialized() override { return initialized_; }

  double getMemoryFraction(c10::DeviceIndex /*device*/) override { return 1.0; }

  void setMemoryFraction(double /*fraction*/, c10::DeviceIndex /*device*/) override {
    TORCH_WARN_ONCE(
        "gpupool's allocator ignores torch.cuda.set_per_process_memory_fraction: give gpupool's "
        "pool a hard limit instead (gpupool.torch.use(gpupool.Pool(hard_limit='50%')), or "
        "GPUPOOL_HARD_LIMIT=50% in the environment)");
  }

  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex /*device*/) override {
    return {};
  }

  void enable(bool /*value*/) override {}
  bool isEnabled() const override { return true; }

  std::string name() override { return "gpupool"; }

  // Memory held and statistics --------------------------------------------------------------

  void emptyCache(MempoolId_t mempool_id) override {
    if (mempool_id != MempoolId_t{0, 0}) {
      // A MemPool's end (after releasePool): its memory back once nothing uses it.
      release_freeable(&mempool_id);
      return;
    }
    if (!any_device()) return;
    // A trim synchronizes the device, which a capture on this stream would not survive.
    if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
      return;
    }
    release_freeable(nullptr);
    for (int device = 0; device < kMaxDevices; ++device) {
      if (seen_[device].load(std::memory_order_relaxed)) api_->trim(device, nullptr);
    }
  }

  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    // As PyTorch's allocator: the device's free memory as the first guess (when 0 is passed),
    // within what gpupool's hard limit leaves, or the largest cached block if larger.
    size_t largest = 0, headroom = SIZE_MAX;
    if (*largestBlock == 0) {
      c10::cuda::CUDAGuard guard(device);
      size_t total = 0;
      C10_CUDA_CHECK(cudaMemGetInfo(largestBlock, &total));
    }
    note_device(device);
    if (api_->cache_info(device, &largest, &headroom) == GPUPOOL_OK) {
      *largestBlock = std::max(std::min(*largestBlock, headroom), largest);
    }
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
    uintptr_t base = 0;
    size_t nbytes = 0;
    for (int device = 0; device < kMaxDevices; ++device) {
      if (seen_[device].load(std::memory_order_relaxed) &&
          api_->base_allocation(device, ptr, &base, &nbytes) == GPUPOOL_OK) {
        if (size != nullptr) *size = nbytes;
        return reinterpret_cast<void*>(base);
      }
    }
    TORCH_CHECK(false, "gpupool: getBaseAllocation of ", ptr,
                ", which gpupool's allocator did not hand out");
  }

  using cca::CUDAAllocator::recordStream;  // the c10::Stream overload calls this one
  void recordStream(const c10::DataPtr& data_ptr, c10::cuda::CUDAStream stream) override {
    void* ptr = data_ptr.get();
    if (ptr == nullptr || data_ptr.get_deleter() != &gp_delete) return;  // not ours
    int status = api_->record_stream(data_ptr.device().index(), ptr,
                                     reinterpret_cast<uintptr_t>(stream.stream()));
    TORCH_CHECK(status == GPUPOOL_OK, "gpupool: record_stream failed: ",
                api_->error_string(status), " (status ", status, ")");
    std::lock_guard<std::mutex> lock(mutex_);
    if (recorded_ptrs_.insert(ptr).second) recorded_.fetch_add(1, std::memory_order_release);
  }

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    // The keys of gpupool.Pool.memory_stats() (stats.py), from the same counters.
    DeviceStats stats;
    gpupool_stats s{};
    if (!seen(device) || api_->get_stats(device, &s) != GPUPOOL_OK) return stats;
    Accumulated base = accumulated(device);
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

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    gpupool_stats s{};
    if (!seen(device) || api_->get_stats(device, &s) != GPUPOOL_OK) return;
    std::lock_guard<std::mutex> lock(mutex_);
    accumulated_[device] = {s.num_allocs, s.num_frees, s.allocated_bytes, s.freed_bytes,
                            s.upstream_allocs, s.upstream_frees, s.oom_retries, s.num_ooms};
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    if (seen(device)) api_->reset_peaks(device);
  }

  cca::SnapshotInfo snapshot(MempoolId_t /*mempool_id*/, bool /*include_traces*/) override {
    return cca::SnapshotInfo{};  // gpupool.pool_status() and gpupool's stats describe it
  }

  // Private memory pools (CUDA graphs, torch.cuda.MemPool) ----------------------------------

  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    TORCH_CHECK(allocator == nullptr || allocator.get() == this,
                "gpupool's allocator serves torch.cuda.MemPool itself: a MemPool with an "
                "allocator of its own needs PyTorch's caching allocator (run without "
                "gpupool.torch.use(), and use gpupool.torch.mempool() for gpupool's memory)");
    incref(device, mempool_id);
  }

  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override {
    check_device(device);
    incref(device, mempool_id);
    std::lock_guard<std::mutex> lock(mutex_);
    routes_by_device_[device].push_back({mempool_id, std::move(filter)});
    routes_.fetch_add(1, std::memory_order_release);
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    check_device(device);
    std::vector<void*> held;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& routes = routes_by_device_[device];
      auto it = std::find_if(routes.begin(), routes.end(),
                             [&](const Route& r) { return r.id == mempool_id; });
      TORCH_CHECK(it != routes.end(), "gpupool: endAllocateToPool without beginAllocateToPool");
      routes.erase(it);
      if (routes_.fetch_sub(1, std::memory_order_acq_rel) == 1) held.swap(deferred_);
    }
    for (void* ptr : held) api_->free_ptr(last_device_.load(std::memory_order_relaxed), ptr);
  }

  void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    // At 0 uses the pool stays until the device is synchronized (emptyCache, or an
    // out-of-memory retry): a graph's last replay may still be running on its memory.
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pools_.find({device, mempool_id});
    TORCH_CHECK(it != pools_.end() && it->second.use_count > 0,
                "gpupool: releasePool of a pool that is not in use");
    --it->second.use_count;
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pools_.find({device, mempool_id});
    return it == pools_.end() ? 0 : it->second.use_count;
  }

  void setUseOnOOM(c10::DeviceIndex /*device*/, MempoolId_t /*mempool_id*/,
                   bool use_on_oom) override {
    // A MemPool's memory serves only its own allocations (what use_on_oom=False asks; its
    // destructor asks it too). Its free blocks go back to the pool at emptyCache.
    TORCH_CHECK(!use_on_oom,
                "gpupool: a MemPool's memory does not serve other allocations on out of memory "
                "(MemPool(use_on_oom=True)); torch.cuda.empty_cache() returns its free memory");
  }

  bool checkPoolLiveAllocations(
      c10::DeviceIndex device, MempoolId_t mempool_id,
      const std::unordered_set<void*>& expected_live_allocations) override {
    auto live = live_of(pool_handle(device, mempool_id));
    if (live.size() != expected_live_allocations.size()) return false;
    return std::all_of(live.begin(), live.end(), [&](const auto& block) {
      return expected_live_allocations.count(reinterpret_cast<void*>(block.first)) != 0;
    });
  }

  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          MempoolId_t id) override {
    auto state = std::make_shared<Checkpoint>();
    state->device = device;
    state->id = id;
    state->live = live_of(pool_handle(device, id));
    return state;
  }

  cca::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device, std::shared_ptr<cca::AllocatorState> pps) override {
    // As PyTorch's: every allocation of the pool is freed, then those of the checkpoint are
    // allocated again at their addresses (their memory stayed the pool's).
    auto state = std::dynamic_pointer_cast<Checkpoint>(pps);
    TORCH_CHECK(state != nullptr && state->device == device,
                "gpupool: setCheckpointPoolState needs a state from its getCheckpointState");
    void* handle = pool_handle(device, state->id);
    cca::CheckpointDelta delta;
    for (const auto& block : live_of(handle)) {
      void* ptr = reinterpret_cast<void*>(block.first);
      free(ptr);
      delta.ptrs_freed.push_back(ptr);
    }
    auto stream = reinterpret_cast<uintptr_t>(c10::cuda::getCurrentCUDAStream(device).stream());
    for (const auto& block : state->live) {
      void* ptr = reinterpret_cast<void*>(block.first);
      int status = api_->private_allocate_at(handle, ptr, block.second, stream);
      TORCH_CHECK(status == GPUPOOL_OK, "gpupool: the checkpointed allocation at ", ptr,
                  " could not be made again (status ", status, ")");
      delta.dataptrs_allocd.emplace_back(ptr, ptr, &gp_delete,
                                         c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }

  // What gpupool's allocator does not offer -------------------------------------------------

  cca::ShareableHandle shareIpcHandle(void* /*ptr*/) override {
    TORCH_CHECK(false, kNoIpc);
  }

  std::shared_ptr<void> getIpcDevPtr(std::string /*handle*/) override {
    // "getIpcDevPtr" names the failure as the pluggable allocator's does: gpupool.torch turns
    // either into an IpcError saying what to do (_refusing_rebuild).
    TORCH_CHECK(false, "getIpcDevPtr: ", kNoIpc);
  }

  void recordHistory(bool enabled, cca::CreateContextFn /*context_recorder*/,
                     size_t /*alloc_trace_max_entries*/, cca::RecordContext /*when*/,
                     bool /*clearHistory*/,
                     const std::vector<std::string>& /*skip_actions*/) override {
    TORCH_CHECK(!enabled,
                "gpupool's allocator keeps no history of allocations "
                "(torch.cuda.memory._record_memory_history): torch.cuda.memory_stats() and "
                "gpupool.pool_status() report its counters");
  }

  bool isHistoryEnabled() override { return false; }

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(mutex_);
    oom_observers_.push_back(std::move(observer));
  }

  // Trace trackers (PyTorch's internal users, such as NCCL's memory registration) see
  // PyTorch's own allocator's events; gpupool's has none to give them.
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker /*tracker*/) override {}

#ifdef GPUPOOL_TORCH_OOM_REJECTION
  // No allocation is rejected ahead of an out-of-memory failure (gpupool's hard limit is a
  // failure like any other).
  void attachOomRejectionObserver(cca::OomRejectionObserver /*observer*/) override {}
#endif

  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      C10_CUDA_CHECK(err);
    }
  }

  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                          size_t count, cudaStream_t stream, bool p2p_enabled) override {
    // Mapped pages (gpupool's vmm upstream) need the peer copy across devices without P2P.
    if (p2p_enabled || dstDevice == srcDevice) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

 private:
  static constexpr const char* kNoIpc =
      "gpupool's allocator cannot share CUDA tensors between processes (CUDA IPC): send "
      "them through host memory, or run the sharing process without gpupool.torch.use()";

  static void check_device(c10::DeviceIndex device) {
    TORCH_CHECK(device >= 0 && device < kMaxDevices, "gpupool: device ", static_cast<int>(device),
                " is beyond the ", kMaxDevices, " devices gpupool's pools cover");
  }

  void note_device(c10::DeviceIndex device) {
    check_device(device);
    last_device_.store(device, std::memory_order_relaxed);
    if (C10_UNLIKELY(!seen_[device].load(std::memory_order_relaxed))) {
      seen_[device].store(true, std::memory_order_relaxed);
    }
  }

  bool seen(c10::DeviceIndex device) const {
    return device >= 0 && device < kMaxDevices && seen_[device].load(std::memory_order_relaxed);
  }

  bool any_device() const {
    return std::any_of(std::begin(seen_), std::end(seen_),
                       [](const auto& s) { return s.load(std::memory_order_relaxed); });
  }

  Accumulated accumulated(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mutex_);
    return accumulated_[device];
  }

  // An allocation while some private pool takes allocations: to the pool whose filter
  // accepts the stream (PyTorch's rule: the first route of the device), else to the device's
  // pool; in the relaxed capture mode either way (a capture may be under way on any thread).
  int malloc_routed(c10::DeviceIndex device, size_t size, cudaStream_t stream, void** ptr) {
    void* handle = route(device, stream);
    c10::cuda::CUDAStreamCaptureModeGuard relaxed{cudaStreamCaptureModeRelaxed};
    auto s = reinterpret_cast<uintptr_t>(stream);
    return handle != nullptr ? api_->private_allocate(handle, size, s, ptr)
                             : api_->allocate(device, size, s, ptr);
  }

  void* route(c10::DeviceIndex device, cudaStream_t stream) {
    std::vector<Route> routes;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      routes = routes_by_device_[device];
    }
    for (const Route& r : routes) {  // filters query the stream: called without the lock
      if (r.filter(stream)) return pool_handle(device, r.id);
    }
    return nullptr;
  }

  void* retry_or_throw(int status, c10::DeviceIndex device, size_t size, cudaStream_t stream) {
    // Private pools no one uses any more give their memory back, then the request is
    // retried once (not during a capture: that needs a device synchronize).
    if (status == GPUPOOL_ERROR_OUT_OF_MEMORY && routes_.load() == 0 &&
        release_freeable(nullptr)) {
      void* ptr = nullptr;
      status = api_->allocate(device, size, reinterpret_cast<uintptr_t>(stream), &ptr);
      if (status == GPUPOOL_OK) return ptr;
    }
    fail(status, device, size);
  }

  [[noreturn]] void fail(int status, c10::DeviceIndex device, size_t size) {
    char message[4096];
    int oom = 0;
    if (describe_ != nullptr) {
      oom = describe_(status, device, size, message, sizeof message);
    } else {
      std::snprintf(message, sizeof message, "gpupool: allocating %zu B on device %d failed: %s",
                    size, static_cast<int>(device), api_->error_string(status));
      oom = status == GPUPOOL_ERROR_OUT_OF_MEMORY;
    }
    if (!oom) TORCH_CHECK(false, message);
    size_t free_bytes = 0, total_bytes = 0;
    {
      c10::cuda::CUDAGuard guard(device);
      if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) (void)cudaGetLastError();
    }
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      observers = oom_observers_;
    }
    for (const auto& observer : observers) observer(device, size, total_bytes, free_bytes);
    TORCH_CHECK_WITH(OutOfMemoryError, false, message);
  }

  // Holds back the free of a block with record_stream uses while a private pool takes
  // allocations (a capture may be under way); true if it was held.
  bool defer(void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (recorded_ptrs_.erase(ptr) == 0) return false;
    recorded_.fetch_sub(1, std::memory_order_release);
    if (routes_.load(std::memory_order_acquire) == 0) return false;
    deferred_.push_back(ptr);
    return true;
  }

  void incref(c10::DeviceIndex device, MempoolId_t id) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = pools_.find({device, id});
      if (it != pools_.end()) {
        ++it->second.use_count;
        return;
      }
    }
    // Made without the lock: private_new takes the GIL, which a thread freeing a tensor holds
    // while it waits for the lock.
    note_device(device);
    void* handle = nullptr;
    int status = api_->private_new(device, &handle);
    TORCH_CHECK(status == GPUPOOL_OK, "gpupool: no private pool could be made on device ",
                static_cast<int>(device), ": ", api_->error_string(status));
    bool made = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& pool = pools_[{device, id}];
      if (pool.handle == nullptr) {
        pool.handle = handle;
        made = true;
      }
      ++pool.use_count;
    }
    if (!made) api_->private_destroy(handle);  // another thread made it first
  }

  void* pool_handle(c10::DeviceIndex device, MempoolId_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pools_.find({device, id});
    TORCH_CHECK(it != pools_.end(), "gpupool: no private memory pool (", id.first, ", ",
                id.second, ") on device ", static_cast<int>(device));
    return it->second.handle;
  }

  std::vector<std::pair<uintptr_t, size_t>> live_of(void* handle) {
    std::vector<std::pair<uintptr_t, size_t>> live;
    size_t count = 0;
    std::vector<uintptr_t> ptrs;
    std::vector<size_t> sizes;
    do {  // the count may grow between the two calls (another thread allocating)
      ptrs.resize(count);
      sizes.resize(count);
      TORCH_CHECK(api_->private_live(handle, ptrs.data(), sizes.data(), ptrs.size(), &count) ==
                  GPUPOOL_OK, "gpupool: private_live failed");
    } while (count > ptrs.size());
    for (size_t i = 0; i < count; ++i) live.emplace_back(ptrs[i], sizes[i]);
    return live;
  }

  // The private pools no one uses (one, if `only` names it) give their memory back once
  // their devices are synchronized; whether there were any.
  bool release_freeable(const MempoolId_t* only) {
    std::vector<std::pair<c10::DeviceIndex, void*>> ended;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = pools_.begin(); it != pools_.end();) {
        if (it->second.use_count == 0 && (only == nullptr || it->first.second == *only)) {
          ended.emplace_back(it->first.first, it->second.handle);
          it = pools_.erase(it);
        } else {
          ++it;
        }
      }
    }
    std::vector<bool> synchronized(kMaxDevices, false);
    for (const auto& [device, handle] : ended) {
      if (!synchronized[device]) {
        c10::cuda::CUDAGuard guard(device);
        C10_CUDA_CHECK(cudaDeviceSynchronize());
        synchronized[device] = true;
      }
      api_->private_destroy(handle);
    }
    return !ended.empty();
  }

  static constexpr int kNotRecording = 0;
  const gpupool_api* api_;
  DescribeFn describe_;
  GatheringFn allocate_gathering_;
  const int* recording_;
  int device_count_ = 0;
  bool initialized_ = false;
  std::atomic<int> routes_{0};         // allocation routes to private pools, every device
  std::atomic<int> recorded_{0};       // pointers in recorded_ptrs_
  std::atomic<int> last_device_{0};    // where a free looks first
  std::atomic<bool> seen_[kMaxDevices];  // devices allocated on (their pools exist)
  std::mutex mutex_;                   // the members below
  std::map<std::pair<c10::DeviceIndex, MempoolId_t>, PrivatePool> pools_;
  std::vector<Route> routes_by_device_[kMaxDevices];
  std::unordered_set<void*> recorded_ptrs_;   // blocks with record_stream uses
  std::vector<void*> deferred_;               // their frees held during routing
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
  Accumulated accumulated_[kMaxDevices];
};

// The installed allocator: made once, never destroyed (tensors may be freed at exit).
GpupoolAllocator* installed = nullptr;

void gp_delete(void* ptr) { installed->free(ptr); }

void copy_message(const char* text, char* out, size_t capacity) {
  if (capacity == 0) return;
  std::strncpy(out, text, capacity - 1);
  out[capacity - 1] = '\0';
}

}  // namespace

// Makes gpupool's allocator PyTorch's current CUDA allocator. Called with the GIL held
// (ctypes.PyDLL); `describe`, `allocate_gathering` and `recording` are adapters/torch_entry.pyx's
// gpupool_torch_failure_message, gpupool_torch_allocate_gathering and gpupool_torch_recording
// (NULL: none). Returns 0, or 1 with the reason in `error`.
extern "C" __attribute__((visibility("default"))) int gpupool_torch_install(
    void* describe, void* allocate_gathering, const int* recording, char* error,
    size_t capacity) {
  try {
    if (installed != nullptr) return 0;
    const gpupool_api* api = gpupool_import();
    if (api == nullptr) {
      PyErr_Clear();
      copy_message("gpupool's C API could not be imported (rebuild gpupool)", error, capacity);
      return 1;
    }
    Hooks hooks;
    hooks.describe = reinterpret_cast<DescribeFn>(describe);
    hooks.allocate_gathering = reinterpret_cast<GatheringFn>(allocate_gathering);
    hooks.recording = recording;
    auto* allocator = new GpupoolAllocator(api, hooks);
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(
        std::shared_ptr<cca::CUDAAllocator>(allocator, [](cca::CUDAAllocator*) {}));
    installed = allocator;
    return 0;
  } catch (const std::exception& e) {
    copy_message(e.what(), error, capacity);
    return 1;
  }
}

// The PyTorch version the allocator was compiled against, as TORCH_VERSION says.
extern "C" __attribute__((visibility("default"))) const char* gpupool_torch_built_for() {
  return TORCH_VERSION;
}
