// Host launcher of the TileLang weight block cast: argument checks, then the generated
// per-arch launcher (deepfuse_tl_kernels.h, written into the build tree by
// tools/build/tilelang_codegen.py). Without TileLang (DEEPFUSE_NO_TILELANG) it only throws.
#include "cast/block_cast.h"

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#ifndef DEEPFUSE_NO_TILELANG
#include "deepfuse_tl_kernels.h"
#endif

namespace deepfuse {

void fp8_block_cast(const void* w, bool w_is_bf16, void* q, void* scale, bool ue8m0, int64_t N,
                    int64_t K, cudaStream_t stream) {
#ifdef DEEPFUSE_NO_TILELANG
  (void)w, (void)w_is_bf16, (void)q, (void)scale, (void)ue8m0, (void)N, (void)K, (void)stream;
  throw std::runtime_error(
      "deepfuse: fp8_block_cast: this deepfuse was built without TileLang kernels "
      "(DEEPFUSE_TILELANG=OFF); rebuild with DEEPFUSE_TILELANG=ON");
#else
  const char* op = "deepfuse: fp8_block_cast: ";
  if (N < 0 || K < 0) throw std::invalid_argument(std::string(op) + "negative size");
  if (N == 0 || K == 0) return;
  if (K % 8 != 0) throw std::invalid_argument(std::string(op) + "K = " + std::to_string(K) + " must be a multiple of 8");
  // The generated launcher takes int sizes; the grid's y extent is ceil(N / 128) <= 65535.
  if (N > 65535LL * 128 || K > std::numeric_limits<int>::max() - 127)
    throw std::invalid_argument(std::string(op) + "w of " + std::to_string(N) + " x " + std::to_string(K) +
                                " is too large (N <= 8388480, K < 2^31 - 127)");
  const auto addr = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  if (addr(w) % 16 || addr(q) % 8 || (!ue8m0 && addr(scale) % 4))
    throw std::invalid_argument(std::string(op) + "w must be 16-byte, q 8-byte and fp32 scales 4-byte aligned");
  void* wp = const_cast<void*>(w);
  const int n = static_cast<int>(N), k = static_cast<int>(K);
  if (w_is_bf16) {
    if (ue8m0) tl::fp8_block_cast_bf16_ue8m0(wp, q, scale, n, k, stream);
    else tl::fp8_block_cast_bf16_fp32(wp, q, scale, n, k, stream);
  } else {
    if (ue8m0) tl::fp8_block_cast_fp32_ue8m0(wp, q, scale, n, k, stream);
    else tl::fp8_block_cast_fp32_fp32(wp, q, scale, n, k, stream);
  }
#endif
}

}  // namespace deepfuse
