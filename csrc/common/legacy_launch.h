// Transitional: what the untyped launchers (device pointers as integers) share. Deleted when
// the last family takes TensorArg.
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>

#include "common/cuda_utils.h"

namespace deepfuse {
namespace py = pybind11;
namespace legacy {

using ptr_t = std::uintptr_t;

template <typename T = void>
T* P(ptr_t p) { return reinterpret_cast<T*>(p); }

// `device` (>= 0) is made current for the call and the caller's device restored after it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (device < 0) return;
    check_cuda(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ == device) {
      prev_ = -1;
      return;
    }
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

}  // namespace legacy
}  // namespace deepfuse
