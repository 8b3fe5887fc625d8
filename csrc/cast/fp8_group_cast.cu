// Per-row group cast to e4m3 with one scale per group (per-token FP8 and MXFP8).
//
// Layout of work: a "slot" is 8 consecutive values of a row, handled by one thread with
// one 16-byte (bf16) or two 16-byte (fp32) loads. A group of GROUP values is GROUP/8
// consecutive lanes of one warp; its amax is reduced with xor-shuffles inside that lane
// span and lane 0 of the span writes the scale. Grid: x = blocks of kRows rows, y = tiles
// of kThreads slots of a row. Each thread handles the same slot in kRows rows, all loads
// issued before any math, so several 16-byte loads are in flight per thread and no index
// needs a run-time division.
#include "cast/cast.h"
#include "common/cuda_utils.h"
#include "common/fp8_utils.cuh"

#include <type_traits>

namespace deepfuse {
namespace {

constexpr int kThreads = 128;
constexpr int kRows = 4;

template <typename T, int GROUP, ScaleKind KIND>
__global__ void __launch_bounds__(kThreads)
fp8_group_cast_kernel(const T* __restrict__ x, uint8_t* __restrict__ q, void* __restrict__ scale,
                      int64_t M, int64_t K, int64_t x_ld, int64_t G, int64_t scale_ld) {
  constexpr int kLanes = GROUP / 8;  // threads per group
  const int64_t slot = static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x;
  const int64_t col = (slot / kLanes) * GROUP + (slot % kLanes) * 8;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const bool col_ok = col < K;

  // bf16 rows stay as raw bits until their amax is taken with integer SIMD.
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  float v[kRows][8];
  uint4 raw[kRows];
#pragma unroll
  for (int u = 0; u < kRows; ++u) {
    const bool ok = col_ok && row0 + u < M;
    if constexpr (kBf16) {
      raw[u] = ok ? __ldg(reinterpret_cast<const uint4*>(x + (row0 + u) * x_ld + col)) : make_uint4(0, 0, 0, 0);
    } else if (ok) {
      load8(x + (row0 + u) * x_ld + col, v[u]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[u][i] = 0.0f;
    }
  }

  const bool leader = (threadIdx.x & (kLanes - 1)) == 0;
  const int64_t g = col / GROUP;
#pragma unroll
  for (int u = 0; u < kRows; ++u) {
    float amax = 0.0f;
    if constexpr (kBf16) {
      amax = finite_amax8_bf16(raw[u]);
      widen8(raw[u], v[u]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, finite_abs(v[u][i]));
    }
#pragma unroll
    for (int off = kLanes / 2; off > 0; off >>= 1)
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));

    float s_val = 0.0f, mul;
    int e = 0;
    if constexpr (KIND == ScaleKind::kFp32) {
      s_val = fp32_scale(amax);
      mul = 1.0f / s_val;  // IEEE reciprocal, as the reference
    } else {
      e = ue8m0_exponent(amax);
      mul = exp2i(-e);
    }
    float out[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = v[u][i] * mul;
    const int64_t row = row0 + u;
    if (!col_ok) continue;
    if constexpr (KIND == ScaleKind::kUe8m0Packed) {
      // The packed layout is written whole: pad rows [M, scale_ld) and the pad bytes after
      // the last group of a row get 0, so the output needs no zero-fill launch.
      if (leader && row < scale_ld) {
        uint8_t* w = static_cast<uint8_t*>(scale) + ((g >> 2) * scale_ld + row) * 4;
        w[g & 3] = row < M ? static_cast<uint8_t>(e + 127) : 0;
        if (g == G - 1)
          for (int j = (g & 3) + 1; j < 4; ++j) w[j] = 0;
      }
    }
    if (row >= M) continue;
    *reinterpret_cast<uint2*>(q + row * K + col) = to_e4m3x8(out);
    if (leader) {
      if constexpr (KIND == ScaleKind::kFp32) {
        static_cast<float*>(scale)[row * G + g] = s_val;
      } else if constexpr (KIND == ScaleKind::kUe8m0) {
        static_cast<uint8_t*>(scale)[row * G + g] = static_cast<uint8_t>(e + 127);
      }
    }
  }
}

template <typename T, int GROUP>
void launch_kind(const T* x, uint8_t* q, void* scale, ScaleKind kind, int64_t M, int64_t K,
                 int64_t x_ld, int64_t scale_ld, cudaStream_t stream) {
  const int64_t G = ceil_div<int64_t>(K, GROUP);
  const int64_t tiles = ceil_div<int64_t>(G * (GROUP / 8), kThreads);
  const int64_t row_blocks = ceil_div<int64_t>(M, kRows);
  if (row_blocks == 0 || tiles == 0) return;
  if (row_blocks > 0x7fffffff || tiles > 65535)
    throw std::runtime_error("deepfuse: fp8_group_cast: input too large for one launch");
  const dim3 blocks(static_cast<unsigned>(row_blocks), static_cast<unsigned>(tiles));
  switch (kind) {
    case ScaleKind::kFp32:
      fp8_group_cast_kernel<T, GROUP, ScaleKind::kFp32>
          <<<blocks, kThreads, 0, stream>>>(x, q, scale, M, K, x_ld, G, scale_ld);
      break;
    case ScaleKind::kUe8m0:
      fp8_group_cast_kernel<T, GROUP, ScaleKind::kUe8m0>
          <<<blocks, kThreads, 0, stream>>>(x, q, scale, M, K, x_ld, G, scale_ld);
      break;
    case ScaleKind::kUe8m0Packed:
      fp8_group_cast_kernel<T, GROUP, ScaleKind::kUe8m0Packed>
          <<<blocks, kThreads, 0, stream>>>(x, q, scale, M, K, x_ld, G, scale_ld);
      break;
  }
  check_launch("fp8_group_cast");
}

template <typename T>
void launch_group(const T* x, uint8_t* q, void* scale, ScaleKind kind, int64_t M, int64_t K,
                  int64_t x_ld, int group, int64_t scale_ld, cudaStream_t stream) {
  switch (group) {
    case 32: return launch_kind<T, 32>(x, q, scale, kind, M, K, x_ld, scale_ld, stream);
    case 64: return launch_kind<T, 64>(x, q, scale, kind, M, K, x_ld, scale_ld, stream);
    case 128: return launch_kind<T, 128>(x, q, scale, kind, M, K, x_ld, scale_ld, stream);
    default: throw std::invalid_argument("deepfuse: fp8_group_cast: group must be 32, 64 or 128");
  }
}

}  // namespace

void fp8_group_cast(const void* x, bool x_is_bf16, void* q, void* scale, ScaleKind kind,
                    int64_t M, int64_t K, int64_t x_ld, int group, int64_t scale_ld,
                    cudaStream_t stream) {
  auto* qb = static_cast<uint8_t*>(q);
  if (x_is_bf16)
    launch_group(static_cast<const __nv_bfloat16*>(x), qb, scale, kind, M, K, x_ld, group, scale_ld, stream);
  else
    launch_group(static_cast<const float*>(x), qb, scale, kind, M, K, x_ld, group, scale_ld, stream);
}

}  // namespace deepfuse
