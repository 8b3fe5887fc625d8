// Device code shared by the sm90 sparse-attention kernels (sparse_attn_sm90_bf16.cuh: mma.sync;
// sparse_decode_sm90.cuh: wgmma): FP8 row dequantisation and the output epilogue.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "attention/sparse_attention.h"
#include "common/fp8_utils.cuh"

namespace deepfuse {
namespace attn_dev {

constexpr int kDim = 512;
constexpr float kLn2 = 0.69314718055994530942f;
constexpr float kLog2e = 1.44269504088896340736f;

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ int64_t load_i(const void* p, int is64, int64_t i) {
  return is64 ? __ldg(static_cast<const long long*>(p) + i) : static_cast<int64_t>(__ldg(static_cast<const int*>(p) + i));
}

// 16 e4m3 (a uint4) times 2^e -> 16 bf16 (two uint4), as kv_dequantise_rows: fp32 product
// rounded to bf16.
__device__ __forceinline__ void dequant16(const uint4& raw, float mul, uint4& lo, uint4& hi) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t o[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const __nv_fp8x2_storage_t pr = static_cast<__nv_fp8x2_storage_t>((w[i] >> (16 * k)) & 0xffffu);
      const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(pr, __NV_E4M3);
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&hr));
      o[2 * i + k] = pack_bf16(f.x * mul, f.y * mul);
    }
  }
  lo = make_uint4(o[0], o[1], o[2], o[3]);
  hi = make_uint4(o[4], o[5], o[6], o[7]);
}

// The epilogue of one thread's accumulator: two head rows hrow[i] of query row t, 32 n8 tiles
// of 256 output columns (half `half` of the 512): o(j, i, k) is column half * 256 + 8 j + 2 qd + k
// of row i, m_run / l_run the row's running max (log2 units) and quad-summed sum.
// Split-KV (P.splits > 1): unnormalised fp32 partials and (max, sum) into the workspace.
// Otherwise: sink normalisation, lse, inverse RoPE on the last 2 * rope_pairs columns, bf16 or
// MXFP8 (e4m3 + UE8M0 per 32 columns, group amax over the quad).
// With a staging tile (stage != nullptr, shared memory): the bf16 / e4m3 values of row
// hrow[i] - row0 go there instead of to P.out, 16-byte chunk c of a row at chunk c ^ (row & 7)
// (rows of 1024 bytes for bf16, 512 for MXFP8); the caller copies the tile out (store_staged).
// kStaged (compile time): every one-split call stages (stage != nullptr then), so only one of the
// two store paths is compiled into a kernel.
template <bool kStaged = false, class Acc>
__device__ __forceinline__ void write_output(const AttnParams& P, int64_t t, const int (&hrow)[2], int half, int qd,
                                             const float (&m_run)[2], const float (&l_run)[2], Acc&& o,
                                             uint8_t* stage = nullptr, int row0 = 0) {
  const int col0 = half * 256 + 2 * qd;  // column of o(j, i, 0) = col0 + 8 j
  if (P.splits > 1) {
    const int64_t base = (static_cast<int64_t>(blockIdx.y) * P.T + t) * P.H;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float* wo = P.ws_o + (base + hrow[i]) * kDim + col0;
#pragma unroll
      for (int j = 0; j < 32; ++j) *reinterpret_cast<float2*>(wo + j * 8) = make_float2(o(j, i, 0), o(j, i, 1));
      if (half == 0 && qd == 0)
        *reinterpret_cast<float2*>(P.ws_ml + (base + hrow[i]) * 2) = make_float2(m_run[i], l_run[i]);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float sk = P.sink[hrow[i]] * kLog2e;
    float M = fmaxf(m_run[i], sk);
    if (M == -INFINITY) M = 0.f;
    const float w = exp2f(m_run[i] - M);
    const float f = w / (l_run[i] * w + exp2f(sk - M));
    if (half == 0 && qd == 0)
      P.lse[t * P.H + hrow[i]] = l_run[i] > 0.f ? (log2f(l_run[i]) + m_run[i]) * kLn2 : -INFINITY;
#pragma unroll
    for (int j = 0; j < 32; ++j) o(j, i, 0) *= f, o(j, i, 1) *= f;
  }
  const int rope0 = kDim - 2 * P.rope_pairs;
  if (P.rope_pairs > 0) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int col = col0 + 8 * j;
      if (col >= rope0) {
        const int pi = (col - rope0) >> 1;
        const float cs = P.cos[t * P.rope_pairs + pi], sn = P.sin[t * P.rope_pairs + pi];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float x0 = o(j, i, 0), x1 = o(j, i, 1);
          o(j, i, 0) = x0 * cs + x1 * sn;
          o(j, i, 1) = x1 * cs - x0 * sn;
        }
      }
    }
  }
  if (!P.mxfp8) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if constexpr (kStaged) {  // chunk half * 32 + j of the row, bytes 4 qd ..
        const int r = hrow[i] - row0;
        uint8_t* sr = stage + r * 1024 + 4 * qd;
#pragma unroll
        for (int j = 0; j < 32; ++j)
          *reinterpret_cast<uint32_t*>(sr + (((half * 32 + j) ^ (r & 7)) << 4)) = pack_bf16(o(j, i, 0), o(j, i, 1));
        continue;
      }
      __nv_bfloat16* ob = static_cast<__nv_bfloat16*>(P.out) + (t * P.H + hrow[i]) * kDim + col0;
#pragma unroll
      for (int j = 0; j < 32; ++j) *reinterpret_cast<uint32_t*>(ob + j * 8) = pack_bf16(o(j, i, 0), o(j, i, 1));
    }
  } else {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      uint8_t* ob = static_cast<uint8_t*>(P.out) + (t * P.H + hrow[i]) * kDim + col0;
#pragma unroll
      for (int gg = 0; gg < 8; ++gg) {  // 32-column groups: n8 tiles 4 gg .. 4 gg + 3
        float am = 0.f;
#pragma unroll
        for (int j = 4 * gg; j < 4 * gg + 4; ++j) am = fmaxf(am, fmaxf(finite_abs(o(j, i, 0)), finite_abs(o(j, i, 1))));
        am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 1));
        am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 2));
        const int e = ue8m0_exponent(am);
        const float mul = exp2i(-e);
#pragma unroll
        for (int j = 4 * gg; j < 4 * gg + 4; ++j) {
          const float a = fminf(fmaxf(o(j, i, 0) * mul, -kE4M3Max), kE4M3Max);
          const float b = fminf(fmaxf(o(j, i, 1) * mul, -kE4M3Max), kE4M3Max);
          const __nv_fp8x2_storage_t v = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
          if constexpr (kStaged) {  // chunk half * 16 + j / 2 of the row, bytes 8 (j & 1) + 2 qd ..
            const int r = hrow[i] - row0;
            *reinterpret_cast<uint16_t*>(stage + r * 512 + (((half * 16 + (j >> 1)) ^ (r & 7)) << 4) + 8 * (j & 1) +
                                         2 * qd) = static_cast<uint16_t>(v);
          } else {
            *reinterpret_cast<uint16_t*>(ob + j * 8) = static_cast<uint16_t>(v);
          }
        }
        if (qd == 0) P.out_scale[(t * P.H + hrow[i]) * 16 + half * 8 + gg] = static_cast<uint8_t>(e + 127);
      }
    }
  }
}

// The end of the split-KV combine for one output row th = t * H + h, 4 columns 4 i .. 4 i + 3 per
// thread (128 threads per row, a warp holds 8 whole 32-column groups): acc = the merged unnormalised
// output (relative to M, log2 units), l its sum, sk the sink (log2 units). Sink normalisation, lse,
// inverse RoPE, bf16 or MXFP8 (group amax over 8 lanes). Shared by sparse_attn_combine_kernel and
// the wgmma kernel's in-cluster reduction.
__device__ __forceinline__ void combine_row_out(const AttnParams& P, int64_t t, int64_t th, float (&acc)[4], float l,
                                                float M, float sk, int i) {
  const float f = 1.f / (l + exp2f(sk - M));
#pragma unroll
  for (int k = 0; k < 4; ++k) acc[k] *= f;
  if (i == 0) P.lse[th] = l > 0.f ? (log2f(l) + M) * kLn2 : -INFINITY;
  const int rope0 = kDim - 2 * P.rope_pairs;
  if (P.rope_pairs > 0) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      if (4 * i + 2 * k < rope0) continue;
      const int pi = (4 * i + 2 * k - rope0) >> 1;
      const float cs = P.cos[t * P.rope_pairs + pi], sn = P.sin[t * P.rope_pairs + pi];
      const float x0 = acc[2 * k], x1 = acc[2 * k + 1];
      acc[2 * k] = x0 * cs + x1 * sn;
      acc[2 * k + 1] = x1 * cs - x0 * sn;
    }
  }
  if (!P.mxfp8) {
    uint2 v = make_uint2(pack_bf16(acc[0], acc[1]), pack_bf16(acc[2], acc[3]));
    *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(P.out) + th * kDim + 4 * i) = v;
  } else {
    float am = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) am = fmaxf(am, finite_abs(acc[k]));
    am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 1));
    am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 2));
    am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 4));
    const int e = ue8m0_exponent(am);
    const float mul = exp2i(-e);
    float c[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) c[k] = fminf(fmaxf(acc[k] * mul, -kE4M3Max), kE4M3Max);
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(c[0], c[1]), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c[2], c[3]), __NV_SATFINITE, __NV_E4M3);
    *reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(P.out) + th * kDim + 4 * i) = lo | (hi << 16);
    if ((i & 7) == 0) P.out_scale[th * 16 + (i >> 3)] = static_cast<uint8_t>(e + 127);
  }
}

// Copies a staged tile of 64 output rows (write_output with a stage) to rows row0 .. row0 + 63 of
// query row t of P.out with 16-byte stores: nthr threads, thread index i; rows contiguous in P.out.
__device__ __forceinline__ void store_staged(const AttnParams& P, int64_t t, int row0, const uint8_t* stage, int i,
                                             int nthr) {
  const int rb = P.mxfp8 ? 512 : 1024;  // bytes per row
  const int cpr = rb >> 4;               // chunks per row
  uint8_t* dst = static_cast<uint8_t*>(P.out) + (t * P.H + row0) * static_cast<int64_t>(rb);
  for (int k = i; k < 64 * cpr; k += nthr) {
    const int r = k / cpr, c = k - r * cpr;
    *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(k) * 16) =
        *reinterpret_cast<const uint4*>(stage + r * rb + ((c ^ (r & 7)) << 4));
  }
}

}  // namespace attn_dev
}  // namespace deepfuse
