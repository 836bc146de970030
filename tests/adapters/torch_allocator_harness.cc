// gpupool's allocator for PyTorch (src/torch_allocator.cc, included below) run without CUDA,
// for tests/adapters/test_torch_allocator.py: the few c10::cuda and CUDA runtime functions it calls
// are defined here as host-only stand-ins (one device, streams as plain handles that the test
// sets, captures it declares), so its logic runs over gpupool's real C API on the simulated
// device. Built with the allocator's own compile command, linked against PyTorch's libc10,
// loaded with ctypes.PyDLL (so every h_* function runs with the GIL held, as the simulated
// device needs); each returns 0, or -1 with the C++ error in h_error().
#include "torch_allocator.cc"

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace {
uintptr_t current_stream = 0;                   // the "current CUDA stream" the test sets
cudaStreamCaptureMode capture_mode = cudaStreamCaptureModeGlobal;
int relaxed_entries = 0;                        // times a call made the mode relaxed
bool capturing = false;                         // cudaStreamIsCapturing's answer
size_t device_free = size_t(1) << 30;           // cudaMemGetInfo's answer
int synchronizes = 0;
std::string last_error;
std::map<uintptr_t, c10::DataPtr> held;         // DataPtrs from allocate(), by pointer
std::vector<std::shared_ptr<cca::AllocatorState>> states;

c10::cuda::CUDAStream stream_of(uintptr_t handle) {
  return c10::cuda::CUDAStream(
      c10::cuda::CUDAStream::UNCHECKED,
      c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::CUDA, 0),
                  static_cast<c10::StreamId>(handle)));
}

template <typename F>
int guarded(F f) {
  try {
    f();
    return 0;
  } catch (const c10::OutOfMemoryError& e) {
    last_error = std::string("OutOfMemoryError: ") + e.what_without_backtrace();
  } catch (const c10::Error& e) {
    last_error = std::string("Error: ") + e.what_without_backtrace();
  } catch (const std::exception& e) {
    last_error = std::string("exception: ") + e.what();
  }
  return -1;
}
}  // namespace

// c10::cuda and torch::cuda stand-ins ---------------------------------------------------------

namespace c10::cuda {
DeviceIndex device_count() noexcept { return 1; }
cudaError_t GetDevice(DeviceIndex* device) { *device = 0; return cudaSuccess; }
cudaError_t SetDevice(DeviceIndex, const bool) { return cudaSuccess; }
cudaError_t MaybeSetDevice(DeviceIndex) { return cudaSuccess; }
DeviceIndex ExchangeDevice(DeviceIndex) { return 0; }
CUDAStream getCurrentCUDAStream(DeviceIndex) { return stream_of(current_stream); }
CUDAStream getDefaultCUDAStream(DeviceIndex) { return stream_of(0); }
CUDAStream getStreamFromPool(const bool, DeviceIndex) { return stream_of(0); }
CUDAStream getStreamFromPool(const int, DeviceIndex) { return stream_of(0); }
void setCurrentCUDAStream(CUDAStream stream) { current_stream = stream.id(); }
cudaStream_t CUDAStream::stream() const {
  return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream_.id()));
}
void CUDAStream::synchronize() const {}
bool CUDAStream::query() const { return true; }
void c10_cuda_check_implementation(const int32_t err, const char* file, const char* function,
                                   const uint32_t line, const bool) {
  TORCH_CHECK(err == 0, "CUDA error ", err, " at ", file, ":", line, " in ", function);
}
namespace CUDACachingAllocator {
std::atomic<CUDAAllocator*> allocator{nullptr};
}
}  // namespace c10::cuda

namespace torch::cuda::CUDAPluggableAllocator {
void changeCurrentAllocator(
    const std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>& allocator) {
  static std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> kept;
  kept = allocator;
  c10::cuda::CUDACachingAllocator::allocator.store(allocator.get());
}
}  // namespace torch::cuda::CUDAPluggableAllocator

// CUDA runtime stand-ins -------------------------------------------------------------------------

extern "C" {
cudaError_t cudaGetLastError() { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t) { return "stand-in"; }
cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  *free = device_free;
  *total = size_t(2) << 30;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() { ++synchronizes; return cudaSuccess; }
cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  if (*mode == cudaStreamCaptureModeRelaxed) ++relaxed_entries;
  std::swap(*mode, capture_mode);
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* status) {
  *status = capturing ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void*, const void*, size_t, cudaMemcpyKind) { return cudaSuccess; }
cudaError_t cudaMemcpyAsync(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t) {
  return cudaSuccess;
}
cudaError_t cudaMemcpyPeerAsync(void*, int, const void*, int, size_t, cudaStream_t) {
  return cudaErrorNotSupported;   // the test tells the two copies apart
}
cudaError_t cudaDeviceEnablePeerAccess(int, unsigned int) { return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t*, unsigned int) { return cudaSuccess; }
cudaError_t cudaEventDestroy(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float*, cudaEvent_t, cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned int) { return cudaSuccess; }
}

// The tests' entry points ---------------------------------------------------------------------

#define H_EXPORT extern "C" __attribute__((visibility("default")))

H_EXPORT const char* h_error() { return last_error.c_str(); }
H_EXPORT void h_set_stream(uintptr_t stream) { current_stream = stream; }
H_EXPORT void h_set_capturing(int value) { capturing = value != 0; }
H_EXPORT void h_set_device_free(size_t bytes) { device_free = bytes; }
H_EXPORT int h_relaxed_entries() { return relaxed_entries; }
H_EXPORT int h_capture_mode() { return static_cast<int>(capture_mode); }
H_EXPORT int h_synchronizes() { return synchronizes; }

// A crash prints the native frames (shared object + offset) to stderr before the default
// action, for a failure on a machine where no debugger is at hand.
extern "C" void h_crashed(int signal) {
  void* frames[64];
  int n = backtrace(frames, 64);
  static const char head[] = "torch_allocator_harness: native frames at the crash:\n";
  (void)!write(2, head, sizeof head - 1);
  backtrace_symbols_fd(frames, n, 2);
  ::signal(signal, SIG_DFL);
  raise(signal);
}

H_EXPORT int h_init() {
  ::signal(SIGSEGV, h_crashed);
  ::signal(SIGBUS, h_crashed);
  return guarded([] { c10::cuda::CUDACachingAllocator::get()->init(1); });
}

// allocate() on the current stream; the DataPtr is held until h_drop.
H_EXPORT int h_allocate(size_t size, uintptr_t* out) {
  return guarded([&] {
    c10::DataPtr data = c10::cuda::CUDACachingAllocator::get()->allocate(size);
    *out = reinterpret_cast<uintptr_t>(data.get());
    if (data.get() != nullptr) held.emplace(*out, std::move(data));
  });
}

// The DataPtr's deleter runs (the tensor dies).
H_EXPORT int h_drop(uintptr_t ptr) {
  return guarded([&] {
    TORCH_CHECK(held.erase(ptr) == 1, "no DataPtr held at ", ptr);
  });
}

H_EXPORT int h_raw_alloc(size_t size, uintptr_t stream, uintptr_t* out) {
  return guarded([&] {
    *out = reinterpret_cast<uintptr_t>(c10::cuda::CUDACachingAllocator::get()
        ->raw_alloc_with_stream(size, reinterpret_cast<cudaStream_t>(stream)));
  });
}

H_EXPORT int h_raw_delete(uintptr_t ptr) {
  return guarded([&] {
    c10::cuda::CUDACachingAllocator::get()->raw_delete(reinterpret_cast<void*>(ptr));
  });
}

H_EXPORT int h_record_stream(uintptr_t ptr, uintptr_t stream) {
  return guarded([&] {
    c10::cuda::CUDACachingAllocator::get()->recordStream(held.at(ptr), stream_of(stream));
  });
}

// getDeviceStats' aggregate numbers: allocated_bytes current, peak, allocated, freed;
// reserved_bytes current, peak; allocation current, allocated, freed; segment current;
// num_alloc_retries, num_ooms, num_device_alloc, num_device_free; active_bytes current.
H_EXPORT int h_stats(int64_t* out) {
  return guarded([&] {
    auto s = c10::cuda::CUDACachingAllocator::get()->getDeviceStats(0);
    auto agg = [](const c10::CachingDeviceAllocator::StatArray& a) {
      return a[static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE)];
    };
    int64_t values[] = {agg(s.allocated_bytes).current, agg(s.allocated_bytes).peak,
                        agg(s.allocated_bytes).allocated, agg(s.allocated_bytes).freed,
                        agg(s.reserved_bytes).current, agg(s.reserved_bytes).peak,
                        agg(s.allocation).current, agg(s.allocation).allocated,
                        agg(s.allocation).freed, agg(s.segment).current, s.num_alloc_retries,
                        s.num_ooms, s.num_device_alloc, s.num_device_free,
                        agg(s.active_bytes).current};
    std::copy(std::begin(values), std::end(values), out);
  });
}

H_EXPORT int h_reset(int accumulated) {
  return guarded([&] {
    auto* a = c10::cuda::CUDACachingAllocator::get();
    accumulated ? a->resetAccumulatedStats(0) : a->resetPeakStats(0);
  });
}

H_EXPORT int h_empty_cache(uint64_t first, uint64_t second) {
  return guarded([&] { c10::cuda::CUDACachingAllocator::get()->emptyCache({first, second}); });
}

H_EXPORT int h_cache_info(size_t* largest) {
  return guarded([&] { c10::cuda::CUDACachingAllocator::get()->cacheInfo(0, largest); });
}

H_EXPORT int h_base_allocation(uintptr_t ptr, uintptr_t* base, size_t* size) {
  return guarded([&] {
    *base = reinterpret_cast<uintptr_t>(c10::cuda::CUDACachingAllocator::get()
        ->getBaseAllocation(reinterpret_cast<void*>(ptr), size));
  });
}

// beginAllocateToPool with a filter that takes the requests on `stream`.
H_EXPORT int h_begin(uint64_t first, uint64_t second, uintptr_t stream) {
  return guarded([&] {
    c10::cuda::CUDACachingAllocator::get()->beginAllocateToPool(
        0, {first, second},
        [stream](cudaStream_t s) { return reinterpret_cast<uintptr_t>(s) == stream; });
  });
}

H_EXPORT int h_end(uint64_t first, uint64_t second) {
  return guarded([&] {
    c10::cuda::CUDACachingAllocator::get()->endAllocateToPool(0, {first, second});
  });
}

H_EXPORT int h_release_pool(uint64_t first, uint64_t second) {
  return guarded([&] {
    c10::cuda::CUDACachingAllocator::get()->releasePool(0, {first, second});
  });
}

H_EXPORT int h_create_pool(uint64_t first, uint64_t second, int foreign) {
  return guarded([&] {
    std::shared_ptr<cca::CUDAAllocator> other;
    if (foreign) {
      // Another allocator (never used: only its address is compared).
      static std::shared_ptr<int> owner = std::make_shared<int>(0);
      other = std::shared_ptr<cca::CUDAAllocator>(
          owner, reinterpret_cast<cca::CUDAAllocator*>(owner.get()));
    }
    c10::cuda::CUDACachingAllocator::get()->createOrIncrefPool(0, {first, second}, other);
  });
}

H_EXPORT int h_use_count(uint64_t first, uint64_t second, int* out) {
  return guarded([&] {
    *out = c10::cuda::CUDACachingAllocator::get()->getPoolUseCount(0, {first, second});
  });
}

H_EXPORT int h_check_live(uint64_t first, uint64_t second, const uintptr_t* ptrs, size_t n,
                          int* out) {
  return guarded([&] {
    std::unordered_set<void*> expected;
    for (size_t i = 0; i < n; ++i) expected.insert(reinterpret_cast<void*>(ptrs[i]));
    *out = c10::cuda::CUDACachingAllocator::get()->checkPoolLiveAllocations(
        0, {first, second}, expected);
  });
}

// getCheckpointState; *index: the state's place, for h_restore.
H_EXPORT int h_checkpoint(uint64_t first, uint64_t second, int* index) {
  return guarded([&] {
    states.push_back(c10::cuda::CUDACachingAllocator::get()->getCheckpointState(
        0, {first, second}));
    *index = static_cast<int>(states.size()) - 1;
  });
}

// setCheckpointPoolState: the pointers freed, then those allocated (their DataPtrs are held,
// as PyTorch hands them to the live tensors' storages).
H_EXPORT int h_restore(int index, uintptr_t* freed, size_t* nfreed, uintptr_t* made,
                       size_t* nmade) {
  return guarded([&] {
    for (auto it = held.begin(); it != held.end();) {   // the allocator frees them itself
      it->second.release_context();
      it = held.erase(it);
    }
    auto delta = c10::cuda::CUDACachingAllocator::get()->setCheckpointPoolState(
        0, states.at(index));
    *nfreed = delta.ptrs_freed.size();
    for (size_t i = 0; i < delta.ptrs_freed.size(); ++i) {
      freed[i] = reinterpret_cast<uintptr_t>(delta.ptrs_freed[i]);
    }
    *nmade = delta.dataptrs_allocd.size();
    for (size_t i = 0; i < delta.dataptrs_allocd.size(); ++i) {
      made[i] = reinterpret_cast<uintptr_t>(delta.dataptrs_allocd[i].get());
      held.emplace(made[i], std::move(delta.dataptrs_allocd[i]));
    }
  });
}

H_EXPORT int h_memcpy(int dst_device, int src_device, int p2p) {
  return guarded([&] {
    TORCH_CHECK(c10::cuda::CUDACachingAllocator::get()->memcpyAsync(
        nullptr, dst_device, nullptr, src_device, 0, nullptr, p2p != 0) == cudaSuccess,
        "cudaMemcpyPeerAsync");
  });
}

H_EXPORT int h_name(char* out, size_t capacity) {
  return guarded([&] {
    copy_message(c10::cuda::CUDACachingAllocator::get()->name().c_str(), out, capacity);
  });
}
