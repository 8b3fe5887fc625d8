// Host-side helpers shared by every launcher: error checks and device queries.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace deepfuse {

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("deepfuse: ") + what + ": " + cudaGetErrorString(e));
}

// Call right after a launch; launch errors (bad config, no driver) become Python exceptions.
inline void check_launch(const char* kernel) {
  check_cuda(cudaGetLastError(), kernel);
}

inline cudaStream_t as_stream(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// Multiprocessor count of the current device (cached per device; no sync).
int num_sms();

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }

}  // namespace deepfuse
