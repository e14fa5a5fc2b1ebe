// The CPU tracking allocator and the CUDA caching allocator's statistics.
#include "train/memory.hpp"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#ifdef FLASHDRAFT_ENGINE_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <atomic>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

namespace flashdraft {

namespace {

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};
std::atomic<bool> g_installed{false};

void raise_peak(int64_t now) {
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

// Wraps LibTorch's CPU allocator. The DataPtrs it hands out are "simple" (context ==
// data), as the default CPU allocator's are: some CPU kernels (oneDNN bf16 paths)
// assert it. The size and the inner deleter of each live allocation are kept in a
// table, so a free subtracts exactly what its allocation added.
class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    c10::DeleterFnPtr inner_deleter = inner.get_deleter();
    void* context = inner.release_context();
    if (!context)  // a zero-byte allocation: nothing to track
      return c10::DataPtr(data, data, inner_deleter, c10::Device(c10::kCPU));
    if (context != data) {  // the base allocator is not simple; give the memory back
      inner_deleter(context);
      throw std::runtime_error(
          "memory tracking: LibTorch's CPU allocator returned a DataPtr whose context is not its "
          "data; the tracking allocator cannot wrap it");
    }
    {
      std::lock_guard<std::mutex> lock(mutex());
      live()[data] = Entry{static_cast<int64_t>(n), inner_deleter};
    }
    raise_peak(g_live.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed) + static_cast<int64_t>(n));
    return c10::DataPtr(data, data, &TrackingAllocator::release, c10::Device(c10::kCPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &TrackingAllocator::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count) std::memcpy(dest, src, count);
  }

 private:
  struct Entry {
    int64_t bytes;
    c10::DeleterFnPtr deleter;
  };
  // Leaked on purpose: frees during static destruction still need them.
  static std::mutex& mutex() {
    static auto* m = new std::mutex();
    return *m;
  }
  static std::unordered_map<void*, Entry>& live() {
    static auto* table = new std::unordered_map<void*, Entry>();
    return *table;
  }
  static void release(void* p) {
    Entry e{0, nullptr};
    {
      std::lock_guard<std::mutex> lock(mutex());
      auto it = live().find(p);
      if (it != live().end()) {
        e = it->second;
        live().erase(it);
      }
    }
    g_live.fetch_sub(e.bytes, std::memory_order_relaxed);
    if (e.deleter) e.deleter(p);
  }
  c10::Allocator* base_;
};

}  // namespace

void MemoryTracker::install() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Leaked on purpose: tensors freed during static destruction still call it.
    static auto* tracker = new TrackingAllocator(c10::GetDefaultCPUAllocator());
    c10::SetCPUAllocator(tracker, /*priority=*/100);
    g_installed = true;
  });
}

bool MemoryTracker::installed() { return g_installed.load(); }

namespace {

// Bytes allocated on `device` now, or at their peak since the last reset.
int64_t allocated_bytes(c10::Device device, bool peak) {
  if (device.is_cpu()) return peak ? g_peak.load() : g_live.load();
#ifdef FLASHDRAFT_ENGINE_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.has_index() ? device.index() : 0);
    const auto& bytes = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
    return peak ? bytes.peak : bytes.current;
  }
#endif
  throw std::invalid_argument("memory tracking: device " + device.str() + " is not tracked (cpu, cuda are)");
}

}  // namespace

int64_t MemoryTracker::live_bytes(c10::Device device) { return allocated_bytes(device, /*peak=*/false); }

int64_t MemoryTracker::peak_bytes(c10::Device device) { return allocated_bytes(device, /*peak=*/true); }

void MemoryTracker::reset_peak(c10::Device device) {
  if (device.is_cpu()) {
    g_peak.store(g_live.load());
    return;
  }
#ifdef FLASHDRAFT_ENGINE_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.has_index() ? device.index() : 0);
    return;
  }
#endif
  throw std::invalid_argument("memory tracking: device " + device.str() + " is not tracked (cpu, cuda are)");
}

}  // namespace flashdraft
