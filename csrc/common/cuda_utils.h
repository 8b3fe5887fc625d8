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

// Compute capability of the current device as major * 10 + minor (cached per device; no sync).
int device_cc();

// Launchers of Hopper-only kernels (common/arch.h) call this before any launch: on a device
// other than sm_90 it throws "deepfuse: no sm_<cc> kernel for <op> yet".
void require_sm90a(const char* op);

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }

}  // namespace deepfuse
