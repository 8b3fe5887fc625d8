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

}  // namespace deepfuse
