// Memory tracking. On CPU, a tracking allocator installed into LibTorch at start-up
// counts live bytes and the peak since the last reset; on CUDA, the caching
// allocator's own statistics. The trainer resets the peak at each phase (forward,
// backward, optimizer) and reads it at the end of the phase.
#pragma once

#include <flashdraft/export.hpp>

#include <c10/core/Device.h>

#include <cstdint>

namespace flashdraft {

class FLASHDRAFT_API MemoryTracker {
 public:
  // Installs the CPU tracking allocator (idempotent). Tensors allocated before the
  // install are not counted (their frees are not either).
  static void install();
  static bool installed();
  // Bytes currently held by tensors on `device` (CPU: tracked; CUDA: allocated).
  static int64_t live_bytes(c10::Device device = c10::kCPU);
  // Highest live_bytes since the last reset_peak on `device`.
  static int64_t peak_bytes(c10::Device device = c10::kCPU);
  // Starts a new phase: the peak becomes the current live bytes.
  static void reset_peak(c10::Device device = c10::kCPU);
};

}  // namespace flashdraft
