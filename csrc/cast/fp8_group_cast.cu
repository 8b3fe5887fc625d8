// Per-row group cast to e4m3 with one scale per group (per-token FP8 and MXFP8).
//
// Layout of work: a "slot" is 8 consecutive values handled by one thread with one
// 16-byte (bf16) or two 16-byte (fp32) loads. A group of GROUP values is GROUP/8
// consecutive lanes of one warp; its amax is reduced with xor-shuffles inside that lane
// span, lane 0 of the span writes the scale. Each thread handles kUnroll slots spaced one
// block apart, all loads issued before any math, to keep enough bytes in flight.
#include "cast/cast.h"
#include "common/cuda_utils.h"
#include "common/fp8_utils.cuh"

namespace deepfuse {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename T, int GROUP, ScaleKind KIND>
__global__ void __launch_bounds__(kThreads)
fp8_group_cast_kernel(const T* __restrict__ x, uint8_t* __restrict__ q, void* __restrict__ scale,
                      int64_t M, int64_t K, int64_t x_ld, int64_t G, int64_t scale_ld) {
  constexpr int kLanes = GROUP / 8;  // threads per group
  const int64_t slots_per_row = G * kLanes;
  const int64_t total = M * slots_per_row;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads * kUnroll + threadIdx.x;

  float v[kUnroll][8];
  int64_t row[kUnroll], col[kUnroll];
  bool ok[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t slot = base + static_cast<int64_t>(u) * kThreads;
    row[u] = slot / slots_per_row;
    const int64_t s = slot - row[u] * slots_per_row;
    col[u] = (s / kLanes) * GROUP + (s % kLanes) * 8;
    ok[u] = slot < total && col[u] < K;
    if (ok[u]) {
      load8(x + row[u] * x_ld + col[u], v[u]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[u][i] = 0.0f;
    }
  }

  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, finite_abs(v[u][i]));
#pragma unroll
    for (int off = kLanes / 2; off > 0; off >>= 1)
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));

    float out[8];
    float s_val;
    int e = 0;
    if constexpr (KIND == ScaleKind::kFp32) {
      s_val = fp32_scale(amax);
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = v[u][i] / s_val;  // IEEE division, as the reference
    } else {
      e = ue8m0_exponent(amax);
      const float inv = exp2i(-e);
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = v[u][i] * inv;
    }
    if (!ok[u]) continue;
    *reinterpret_cast<uint2*>(q + row[u] * K + col[u]) = to_e4m3x8(out);
    if ((lane & (kLanes - 1)) == 0) {
      const int64_t g = col[u] / GROUP;
      if constexpr (KIND == ScaleKind::kFp32) {
        static_cast<float*>(scale)[row[u] * G + g] = s_val;
      } else if constexpr (KIND == ScaleKind::kUe8m0) {
        static_cast<uint8_t*>(scale)[row[u] * G + g] = static_cast<uint8_t>(e + 127);
      } else {
        static_cast<uint8_t*>(scale)[((g >> 2) * scale_ld + row[u]) * 4 + (g & 3)] =
            static_cast<uint8_t>(e + 127);
      }
    }
  }
}

template <typename T, int GROUP>
void launch_kind(const T* x, uint8_t* q, void* scale, ScaleKind kind, int64_t M, int64_t K,
                 int64_t x_ld, int64_t scale_ld, cudaStream_t stream) {
  const int64_t G = ceil_div<int64_t>(K, GROUP);
  const int64_t total = M * G * (GROUP / 8);
  const int64_t blocks = ceil_div<int64_t>(total, int64_t(kThreads) * kUnroll);
  if (blocks == 0) return;
  if (blocks > 0x7fffffff) throw std::runtime_error("deepfuse: fp8_group_cast: input too large");
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
