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
//
// This header declares the allocator; torch_allocator.cc defines what is not defined here
// and the two entry points, torch_stats.h converts gpupool's counters into PyTorch's
// statistics. They compile as one translation unit (torch_allocator.cc).
#ifndef GP_TORCH_ALLOCATOR_H
#define GP_TORCH_ALLOCATOR_H

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

#include "torch_stats.h"

// CUDAAllocator::attachOomRejectionObserver is pure virtual from PyTorch 2.13 on.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
#define GPUPOOL_TORCH_OOM_REJECTION 1
#endif
namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::MempoolId_t;

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

  void init(int device_count) override;

  bool initialized() override { return initialized_; }

  double getMemoryFraction(c10::DeviceIndex /*device*/) override { return 1.0; }

  void setMemoryFraction(double /*fraction*/, c10::DeviceIndex /*device*/) override;

  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex /*device*/) override;

  void enable(bool /*value*/) override {}
  bool isEnabled() const override { return true; }

  std::string name() override { return "gpupool"; }

  // Memory held and statistics --------------------------------------------------------------

  void emptyCache(MempoolId_t mempool_id) override;

  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override;

  void* getBaseAllocation(void* ptr, size_t* size) override;

  using cca::CUDAAllocator::recordStream;  // the c10::Stream overload calls this one
  void recordStream(const c10::DataPtr& data_ptr, c10::cuda::CUDAStream stream) override;

  DeviceStats getDeviceStats(c10::DeviceIndex device) override;

  void resetAccumulatedStats(c10::DeviceIndex device) override;

  void resetPeakStats(c10::DeviceIndex device) override;

  cca::SnapshotInfo snapshot(MempoolId_t /*mempool_id*/, bool /*include_traces*/) override;

  // Private memory pools (CUDA graphs, torch.cuda.MemPool) ----------------------------------

  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override;

  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override;

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) override;

  void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) override;

  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) override;

  void setUseOnOOM(c10::DeviceIndex /*device*/, MempoolId_t /*mempool_id*/,
                   bool use_on_oom) override;

  bool checkPoolLiveAllocations(
      c10::DeviceIndex device, MempoolId_t mempool_id,
      const std::unordered_set<void*>& expected_live_allocations) override;

  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          MempoolId_t id) override;

  cca::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device, std::shared_ptr<cca::AllocatorState> pps) override;

  // What gpupool's allocator does not offer -------------------------------------------------

  cca::ShareableHandle shareIpcHandle(void* /*ptr*/) override;

  std::shared_ptr<void> getIpcDevPtr(std::string /*handle*/) override;

  void recordHistory(bool enabled, cca::CreateContextFn /*context_recorder*/,
                     size_t /*alloc_trace_max_entries*/, cca::RecordContext /*when*/,
                     bool /*clearHistory*/,
                     const std::vector<std::string>& /*skip_actions*/) override;

  bool isHistoryEnabled() override { return false; }

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override;

  // Trace trackers (PyTorch's internal users, such as NCCL's memory registration) see
  // PyTorch's own allocator's events; gpupool's has none to give them.
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker /*tracker*/) override {}

#ifdef GPUPOOL_TORCH_OOM_REJECTION
  // No allocation is rejected ahead of an out-of-memory failure (gpupool's hard limit is a
  // failure like any other).
  void attachOomRejectionObserver(cca::OomRejectionObserver /*observer*/) override {}
#endif

  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override;

  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                          size_t count, cudaStream_t stream, bool p2p_enabled) override;

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

  Accumulated accumulated(c10::DeviceIndex device);

  // An allocation while some private pool takes allocations: to the pool whose filter
  // accepts the stream (PyTorch's rule: the first route of the device), else to the device's
  // pool; in the relaxed capture mode either way (a capture may be under way on any thread).
  int malloc_routed(c10::DeviceIndex device, size_t size, cudaStream_t stream, void** ptr);

  void* route(c10::DeviceIndex device, cudaStream_t stream);

  void* retry_or_throw(int status, c10::DeviceIndex device, size_t size, cudaStream_t stream);

  [[noreturn]] void fail(int status, c10::DeviceIndex device, size_t size);

  // Holds back the free of a block with record_stream uses while a private pool takes
  // allocations (a capture may be under way); true if it was held.
  bool defer(void* ptr);

  void incref(c10::DeviceIndex device, MempoolId_t id);

  void* pool_handle(c10::DeviceIndex device, MempoolId_t id);

  std::vector<std::pair<uintptr_t, size_t>> live_of(void* handle);

  // The private pools no one uses (one, if `only` names it) give their memory back once
  // their devices are synchronized; whether there were any.
  bool release_freeable(const MempoolId_t* only);

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

}  // namespace

#endif  // GP_TORCH_ALLOCATOR_H
