#include "common/cuda_utils.h"

namespace deepfuse {

int num_sms() {
  static int cache[64] = {0};
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev < 64 && cache[dev]) return cache[dev];
  int n = 0;
  check_cuda(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  if (dev < 64) cache[dev] = n;
  return n;
}

int device_cc() {
  static int cache[64] = {0};
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev < 64 && cache[dev]) return cache[dev];
  int major = 0, minor = 0;
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "cudaDeviceGetAttribute");
  const int cc = major * 10 + minor;
  if (dev < 64) cache[dev] = cc;
  return cc;
}

void require_sm90a(const char* op) {
  const int cc = device_cc();
  if (cc != 90)
    throw std::runtime_error("deepfuse: no sm_" + std::to_string(cc) + " kernel for " + op +
                             " yet (its kernel uses wgmma: sm_90a only)");
}

}  // namespace deepfuse
