// DeviceMark (device_mark.hpp).
#include "train/device_mark.hpp"

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace flashdraft {

DeviceMark::DeviceMark(c10::Device device) : host_(std::chrono::steady_clock::now()) {
  if (!device.is_cuda()) return;
  const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  event_.emplace(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);  // with timing
  event_->record(impl->getStream(device));
}

void DeviceMark::wait() const {
  if (event_) event_->synchronize();
}

double DeviceMark::seconds_since(const DeviceMark& earlier) const {
  wait();
  if (event_ && earlier.event_) return earlier.event_->elapsedTime(*event_) / 1e3;
  return std::chrono::duration<double>(host_ - earlier.host_).count();
}

double DeviceMark::host_seconds_since(std::chrono::steady_clock::time_point start) const {
  wait();
  const auto reached = event_ ? std::chrono::steady_clock::now() : host_;
  return std::chrono::duration<double>(reached - start).count();
}

ReadAside::ReadAside(c10::Device device) {
  if (!device.is_cuda()) return;
  guard_.reset_stream(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStreamFromGlobalPool(device));
}

}  // namespace flashdraft
