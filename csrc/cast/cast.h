// FP8 / MXFP8 activation casts: one scale per `group` consecutive values of a row.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace deepfuse {

enum class ScaleKind : int {
  kFp32 = 0,        // float [M, G] row-major, amax / 448
  kUe8m0 = 1,       // uint8 [M, G] row-major, exponent + 127
  kUe8m0Packed = 2  // int32 [ceil(G/4), ldM] (MN-major): byte j of word (g/4, m) holds group 4*(g/4)+j
};

// x: [M, K] rows `x_ld` elements apart (bf16 if x_is_bf16 else fp32), K % 8 == 0,
// x and x_ld 16-byte aligned. q: e4m3 [M, K] contiguous. G = ceil(K / group); the last
// group of a row may be partial. group in {32, 64, 128}. `scale_ld` is the packed
// layout's padded M (unused otherwise); the packed layout is written whole, pads as 0.
void fp8_group_cast(const void* x, bool x_is_bf16, void* q, void* scale, ScaleKind kind,
                    int64_t M, int64_t K, int64_t x_ld, int group, int64_t scale_ld,
                    cudaStream_t stream);

}  // namespace deepfuse
