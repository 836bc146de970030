// gpupool's allocator for PyTorch (torch_allocator.h declares it): the definitions of its
// member functions that the class does not define inline, and the two entry points that
// gpupool.torch calls through ctypes (gpupool/adapters/torch_allocator.py builds this file).
#include "torch_allocator.h"

namespace {

void GpupoolAllocator::init(int device_count) {
  device_count_ = device_count;
  initialized_ = true;
}

void GpupoolAllocator::setMemoryFraction(double /*fraction*/, c10::DeviceIndex /*device*/) {
  TORCH_WARN_ONCE(
      "gpupool's allocator ignores torch.cuda.set_per_process_memory_fraction: give gpupool's "
      "pool a hard limit instead (gpupool.torch.use(gpupool.Pool(hard_limit='50%')), or "
      "GPUPOOL_HARD_LIMIT=50% in the environment)");
}

std::vector<cca::StreamSegmentSize> GpupoolAllocator::getExpandableSegmentSizes(
    c10::DeviceIndex /*device*/) {
  return {};
}

void GpupoolAllocator::emptyCache(MempoolId_t mempool_id) {
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

void GpupoolAllocator::cacheInfo(c10::DeviceIndex device, size_t* largestBlock) {
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

void* GpupoolAllocator::getBaseAllocation(void* ptr, size_t* size) {
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

void GpupoolAllocator::recordStream(const c10::DataPtr& data_ptr, c10::cuda::CUDAStream stream) {
  void* ptr = data_ptr.get();
  if (ptr == nullptr || data_ptr.get_deleter() != &gp_delete) return;  // not ours
  int status = api_->record_stream(data_ptr.device().index(), ptr,
                                   reinterpret_cast<uintptr_t>(stream.stream()));
  TORCH_CHECK(status == GPUPOOL_OK, "gpupool: record_stream failed: ",
              api_->error_string(status), " (status ", status, ")");
  std::lock_guard<std::mutex> lock(mutex_);
  if (recorded_ptrs_.insert(ptr).second) recorded_.fetch_add(1, std::memory_order_release);
}

DeviceStats GpupoolAllocator::getDeviceStats(c10::DeviceIndex device) {
  gpupool_stats s{};
  if (!seen(device) || api_->get_stats(device, &s) != GPUPOOL_OK) return DeviceStats{};
  return device_stats(s, accumulated(device));
}

void GpupoolAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  gpupool_stats s{};
  if (!seen(device) || api_->get_stats(device, &s) != GPUPOOL_OK) return;
  std::lock_guard<std::mutex> lock(mutex_);
  accumulated_[device] = {s.num_allocs, s.num_frees, s.allocated_bytes, s.freed_bytes,
                          s.upstream_allocs, s.upstream_frees, s.oom_retries, s.num_ooms};
}

void GpupoolAllocator::resetPeakStats(c10::DeviceIndex device) {
  if (seen(device)) api_->reset_peaks(device);
}

cca::SnapshotInfo GpupoolAllocator::snapshot(MempoolId_t /*mempool_id*/, bool /*include_traces*/) {
  return cca::SnapshotInfo{};  // gpupool.pool_status() and gpupool's stats describe it
}

void GpupoolAllocator::createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                        std::shared_ptr<cca::CUDAAllocator> allocator) {
  TORCH_CHECK(allocator == nullptr || allocator.get() == this,
              "gpupool's allocator serves torch.cuda.MemPool itself: a MemPool with an "
              "allocator of its own needs PyTorch's caching allocator (run without "
              "gpupool.torch.use(), and use gpupool.torch.mempool() for gpupool's memory)");
  incref(device, mempool_id);
}

void GpupoolAllocator::beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                         std::function<bool(cudaStream_t)> filter) {
  check_device(device);
  incref(device, mempool_id);
  std::lock_guard<std::mutex> lock(mutex_);
  routes_by_device_[device].push_back({mempool_id, std::move(filter)});
  routes_.fetch_add(1, std::memory_order_release);
}

void GpupoolAllocator::endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) {
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

void GpupoolAllocator::releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) {
  // At 0 uses the pool stays until the device is synchronized (emptyCache, or an
  // out-of-memory retry): a graph's last replay may still be running on its memory.
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = pools_.find({device, mempool_id});
  TORCH_CHECK(it != pools_.end() && it->second.use_count > 0,
              "gpupool: releasePool of a pool that is not in use");
  --it->second.use_count;
}

int GpupoolAllocator::getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = pools_.find({device, mempool_id});
  return it == pools_.end() ? 0 : it->second.use_count;
}

void GpupoolAllocator::setUseOnOOM(c10::DeviceIndex /*device*/, MempoolId_t /*mempool_id*/,
                 bool use_on_oom) {
  // A MemPool's memory serves only its own allocations (what use_on_oom=False asks; its
  // destructor asks it too). Its free blocks go back to the pool at emptyCache.
  TORCH_CHECK(!use_on_oom,
              "gpupool: a MemPool's memory does not serve other allocations on out of memory "
              "(MemPool(use_on_oom=True)); torch.cuda.empty_cache() returns its free memory");
}

bool GpupoolAllocator::checkPoolLiveAllocations(
    c10::DeviceIndex device, MempoolId_t mempool_id,
    const std::unordered_set<void*>& expected_live_allocations) {
  auto live = live_of(pool_handle(device, mempool_id));
  if (live.size() != expected_live_allocations.size()) return false;
  return std::all_of(live.begin(), live.end(), [&](const auto& block) {
    return expected_live_allocations.count(reinterpret_cast<void*>(block.first)) != 0;
  });
}

std::shared_ptr<cca::AllocatorState> GpupoolAllocator::getCheckpointState(c10::DeviceIndex device,
                                                        MempoolId_t id) {
  auto state = std::make_shared<Checkpoint>();
  state->device = device;
  state->id = id;
  state->live = live_of(pool_handle(device, id));
  return state;
}

cca::CheckpointDelta GpupoolAllocator::setCheckpointPoolState(
    c10::DeviceIndex device, std::shared_ptr<cca::AllocatorState> pps) {
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

cca::ShareableHandle GpupoolAllocator::shareIpcHandle(void* /*ptr*/) {
  TORCH_CHECK(false, kNoIpc);
}

std::shared_ptr<void> GpupoolAllocator::getIpcDevPtr(std::string /*handle*/) {
  // "getIpcDevPtr" names the failure as the pluggable allocator's does: gpupool.torch turns
  // either into an IpcError saying what to do (_refusing_rebuild).
  TORCH_CHECK(false, "getIpcDevPtr: ", kNoIpc);
}

void GpupoolAllocator::recordHistory(bool enabled, cca::CreateContextFn /*context_recorder*/,
                   size_t /*alloc_trace_max_entries*/, cca::RecordContext /*when*/,
                   bool /*clearHistory*/,
                   const std::vector<std::string>& /*skip_actions*/) {
  TORCH_CHECK(!enabled,
              "gpupool's allocator keeps no history of allocations "
              "(torch.cuda.memory._record_memory_history): torch.cuda.memory_stats() and "
              "gpupool.pool_status() report its counters");
}

void GpupoolAllocator::attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) {
  std::lock_guard<std::mutex> lock(mutex_);
  oom_observers_.push_back(std::move(observer));
}

void GpupoolAllocator::enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) {
  c10::cuda::CUDAGuard guard(dev);
  cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();
  } else {
    C10_CUDA_CHECK(err);
  }
}

cudaError_t GpupoolAllocator::memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                        size_t count, cudaStream_t stream, bool p2p_enabled) {
  // Mapped pages (gpupool's vmm upstream) need the peer copy across devices without P2P.
  if (p2p_enabled || dstDevice == srcDevice) {
    return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  }
  return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
}

Accumulated GpupoolAllocator::accumulated(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(mutex_);
  return accumulated_[device];
}

int GpupoolAllocator::malloc_routed(c10::DeviceIndex device, size_t size, cudaStream_t stream, void** ptr) {
  void* handle = route(device, stream);
  c10::cuda::CUDAStreamCaptureModeGuard relaxed{cudaStreamCaptureModeRelaxed};
  auto s = reinterpret_cast<uintptr_t>(stream);
  return handle != nullptr ? api_->private_allocate(handle, size, s, ptr)
                           : api_->allocate(device, size, s, ptr);
}

void* GpupoolAllocator::route(c10::DeviceIndex device, cudaStream_t stream) {
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

void* GpupoolAllocator::retry_or_throw(int status, c10::DeviceIndex device, size_t size, cudaStream_t stream) {
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

void GpupoolAllocator::fail(int status, c10::DeviceIndex device, size_t size) {
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

bool GpupoolAllocator::defer(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (recorded_ptrs_.erase(ptr) == 0) return false;
  recorded_.fetch_sub(1, std::memory_order_release);
  if (routes_.load(std::memory_order_acquire) == 0) return false;
  deferred_.push_back(ptr);
  return true;
}

void GpupoolAllocator::incref(c10::DeviceIndex device, MempoolId_t id) {
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

void* GpupoolAllocator::pool_handle(c10::DeviceIndex device, MempoolId_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = pools_.find({device, id});
  TORCH_CHECK(it != pools_.end(), "gpupool: no private memory pool (", id.first, ", ",
              id.second, ") on device ", static_cast<int>(device));
  return it->second.handle;
}

std::vector<std::pair<uintptr_t, size_t>> GpupoolAllocator::live_of(void* handle) {
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

bool GpupoolAllocator::release_freeable(const MempoolId_t* only) {
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
