// A point in a device's queue, for timing without waiting: on CUDA an event recorded on
// the current stream (reached when the work queued before it has run), elsewhere the host
// clock (CPU work runs as it is queued). Reading a time waits for the later mark only.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>

#include <chrono>
#include <optional>

namespace flashdraft {

class DeviceMark {
 public:
  // Marks the current end of `device`'s queue.
  explicit DeviceMark(c10::Device device);
  // Blocks the host until the device has reached this mark.
  void wait() const;
  // Seconds between `earlier` and this mark on the device (waits for this mark).
  double seconds_since(const DeviceMark& earlier) const;
  // Host seconds from `start` until the device reached this mark (waits for it).
  double host_seconds_since(std::chrono::steady_clock::time_point start) const;

 private:
  std::optional<c10::Event> event_;  // CUDA
  std::chrono::steady_clock::time_point host_;
};

// While alive, the current stream of `device` (CUDA) is a side stream from the pool, so
// that reading a finished step's scalars (item(), .to(kCPU)) waits for those copies only,
// not for everything queued since on the main stream (a plain item() synchronises the
// whole stream: it would wait for the next step too). Only for tensors whose producer is
// known to have run (a DeviceMark after them was waited for).
class ReadAside {
 public:
  explicit ReadAside(c10::Device device);

 private:
  c10::OptionalStreamGuard guard_;
};

}  // namespace flashdraft
