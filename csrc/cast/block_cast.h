// FP8 weight block cast (TileLang kernel kernels/fp8_block_cast.py, lowered at build time).
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace deepfuse {

// w: [N, K] row-major contiguous, bf16 if w_is_bf16 else fp32, 16-byte aligned, K % 8 == 0.
// q: e4m3 [N, K] contiguous, 8-byte aligned. scale: [ceil(N/128), ceil(K/128)] contiguous,
// fp32 (amax / 448) or, if ue8m0, uint8 exponent + 127. Blocks are 128 x 128; edge blocks
// may be partial. N == 0 or K == 0 launches nothing. Throws std::invalid_argument on bad
// sizes or alignment, std::runtime_error on launch failure or in builds without TileLang.
void fp8_block_cast(const void* w, bool w_is_bf16, void* q, void* scale, bool ue8m0, int64_t N,
                    int64_t K, cudaStream_t stream);

}  // namespace deepfuse
