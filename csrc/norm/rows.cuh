// Device side of the row epilogues (rows.h): one warp holds a row of D values, lane l the
// 8-value chunks c = l + 32 i (i < CPL), values [8c, 8c + 8); chunks c >= D / 8 hold zeros.
// The standalone ops (rms_norm, rope, kv_store) and the fused ones run this same code, so a
// fused store writes exactly what the separate CUDA ops write.
#pragma once
#include <cuda_bf16.h>

#include "common/fp8_utils.cuh"
#include "norm/rows.h"

namespace deepfuse {
namespace rows {

template <int CPL>
struct WarpRow {
  float v[CPL][8];
};

__device__ __forceinline__ float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

__device__ __forceinline__ uint4 pack_bf16x8(const float (&v)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    w[i] = *reinterpret_cast<uint32_t*>(&h);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <int CPL>
__device__ __forceinline__ void load_row(WarpRow<CPL>& r, const __nv_bfloat16* p, int D, int lane) {
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const int c = lane + 32 * i;
    if (c * 8 < D) {
      load8(p + 8 * c, r.v[i]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) r.v[i][j] = 0.0f;
    }
  }
}

template <int CPL>
__device__ __forceinline__ void store_row_bf16(const WarpRow<CPL>& r, __nv_bfloat16* p, int D, int lane) {
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const int c = lane + 32 * i;
    if (c * 8 < D) *reinterpret_cast<uint4*>(p + 8 * c) = pack_bf16x8(r.v[i]);
  }
}

// y = bf16(weight * (x * rsqrt(mean(x^2) + eps))), the reference's order of operations.
template <int CPL>
__device__ __forceinline__ void rms_norm(WarpRow<CPL>& r, const float* weight, float eps, int D, int lane) {
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < CPL; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) ss = __fmaf_rn(r.v[i][j], r.v[i][j], ss);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  const float inv = rsqrtf(__fadd_rn(__fdiv_rn(ss, static_cast<float>(D)), eps));
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const int c = lane + 32 * i;
    if (c * 8 >= D) continue;
    float w[8];
    if (weight != nullptr) {
      load8(weight + 8 * c, w);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) w[j] = 1.0f;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) r.v[i][j] = bf16_round(__fmul_rn(w[j], __fmul_rn(r.v[i][j], inv)));
  }
}

// Interleaved RoPE on the last 2 * half dims: pair (x0, x1) at cols D - 2 half + 2 k ->
// (x0 c - x1 s, x1 c + x0 s), s negated for the inverse; cs / sn: this token's [half].
template <int CPL>
__device__ __forceinline__ void rope(WarpRow<CPL>& r, const float* cs, const float* sn, int half, bool inverse,
                                     int D, int lane) {
  const int r0 = D - 2 * half;
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const int c = lane + 32 * i;
    if (c * 8 >= D || c * 8 + 8 <= r0) continue;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int col = c * 8 + 2 * k;
      if (col < r0) continue;
      const int p = (col - r0) >> 1;
      const float co = __ldg(cs + p), si = inverse ? -__ldg(sn + p) : __ldg(sn + p);
      const float x0 = r.v[i][2 * k], x1 = r.v[i][2 * k + 1];
      r.v[i][2 * k] = bf16_round(__fsub_rn(__fmul_rn(x0, co), __fmul_rn(x1, si)));
      r.v[i][2 * k + 1] = bf16_round(__fadd_rn(__fmul_rn(x1, co), __fmul_rn(x0, si)));
    }
  }
}

__device__ __forceinline__ uint2 quant8(const float (&v)[8], float mul) {
  float o[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = v[j] * mul;
  return to_e4m3x8(o);
}

__device__ __forceinline__ float finite_amax8(const float (&v)[8]) {
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) m = fmaxf(m, finite_abs(v[j]));
  return m;
}

// Store row r (values already bf16-exact) at `slot` of the pages, in the kv_format layout.
// Warp-uniform: every lane calls it with the same slot. CPL: 2 for kKvFp8, 1 for kIdx*.
template <int CPL>
__device__ __forceinline__ void store(const WarpRow<CPL>& r, const RowStoreArgs& s, int64_t slot, int D, int lane) {
  if (s.kind == RowStore::kNone || slot < 0) return;
  const int64_t page = slot / s.page_size;
  const int64_t row = slot - page * s.page_size;
  if (page >= s.num_pages) return;
  uint8_t* pg = s.pages + page * s.page_bytes;
  if (s.kind == RowStore::kDense) {
    store_row_bf16(r, reinterpret_cast<__nv_bfloat16*>(pg) + row * D, D, lane);
    return;
  }
  if (s.kind == RowStore::kKvFp8) {
    if constexpr (CPL == 2) {
      uint8_t* d = pg + row * 576;
      uint8_t* ds = pg + static_cast<int64_t>(s.page_size) * 576 + row * 8;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int c = lane + 32 * i;  // groups of 64 values: lanes 8q .. 8q + 7 of one i
        float amax = finite_amax8(r.v[i]);
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
        if (c < 56) {
          const int e = ue8m0_exponent(amax);
          *reinterpret_cast<uint2*>(d + 8 * c) = quant8(r.v[i], exp2i(-e));
          if ((c & 7) == 0) ds[c >> 3] = static_cast<uint8_t>(e + 127);
        } else {
          *reinterpret_cast<uint4*>(d + 448 + 16 * (c - 56)) = pack_bf16x8(r.v[i]);
          if (c == 56) ds[7] = 0;
        }
      }
    }
    return;
  }
  // indexer keys: one scale per 128-value row (lanes 0..15)
  if constexpr (CPL == 1) {
    float amax = finite_amax8(r.v[0]);
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    float sc, mul;
    if (s.kind == RowStore::kIdxFp8) {
      sc = fp32_scale(amax);
      mul = 1.0f / sc;
    } else {
      const int e = ue8m0_exponent(amax);
      sc = exp2i(e);
      mul = exp2i(-e);
    }
    if (lane < 16) *reinterpret_cast<uint2*>(pg + row * 128 + 8 * lane) = quant8(r.v[0], mul);
    if (lane == 0) *reinterpret_cast<float*>(pg + static_cast<int64_t>(s.page_size) * 128 + row * 4) = sc;
  }
}

}  // namespace rows
}  // namespace deepfuse
