// The CPU tracking allocator and the CUDA caching allocator's statistics.
#include "memory.hpp"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#ifdef FLASHDRAFT_ENGINE_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <atomic>
#include <cstring>
#include <mutex>
#include <stdexcept>

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

// Wraps LibTorch's CPU allocator. Each allocation carries a small context with the
// inner DataPtr and its size, so a free subtracts exactly what was added.
class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    auto* ctx = new Context{std::move(inner), static_cast<int64_t>(n)};
    raise_peak(g_live.fetch_add(ctx->bytes, std::memory_order_relaxed) + ctx->bytes);
    return c10::DataPtr(data, ctx, &TrackingAllocator::release, c10::Device(c10::kCPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count) std::memcpy(dest, src, count);
  }

 private:
  struct Context {
    c10::DataPtr inner;
    int64_t bytes;
  };
  static void release(void* p) {
    auto* ctx = static_cast<Context*>(p);
    g_live.fetch_sub(ctx->bytes, std::memory_order_relaxed);
    delete ctx;  // frees the inner allocation through its own deleter
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

int64_t MemoryTracker::live_bytes(c10::Device device) {
  if (device.is_cpu()) return g_live.load();
#ifdef FLASHDRAFT_ENGINE_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.has_index() ? device.index() : 0);
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
  }
#endif
  throw std::invalid_argument("memory tracking: device " + device.str() + " is not tracked (cpu, cuda are)");
}

int64_t MemoryTracker::peak_bytes(c10::Device device) {
  if (device.is_cpu()) return g_peak.load();
#ifdef FLASHDRAFT_ENGINE_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.has_index() ? device.index() : 0);
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  }
#endif
  throw std::invalid_argument("memory tracking: device " + device.str() + " is not tracked (cpu, cuda are)");
}

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
