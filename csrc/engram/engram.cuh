// Device code of the Engram kernels (engram.h): the hash of one table column and the
// dequantisation of 16 e4m3 values of a table row.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "engram/engram.h"

namespace deepfuse::engram {

// n-gram id s of row n, widened to int64 as the reference's .long().
__device__ __forceinline__ int64_t ngram_at(const EngramHashArgs& h, int64_t n, int s) {
  return h.ngram64 ? static_cast<const int64_t*>(h.ngram)[n * h.ngram_ld + s]
                   : static_cast<int64_t>(static_cast<const int32_t*>(h.ngram)[n * h.ngram_ld + s]);
}

// Table row of column c (order i = c / H + 1) of n-gram row n with one layer's multipliers
// `mult` [M] and primes / offsets [C]: XOR of the wrapped products of columns 0..i, then the
// residue in [0, prime) (torch's % takes the divisor's sign) plus the offset.
__device__ __forceinline__ int64_t hash_row(const EngramHashArgs& h, const int64_t* mult, const int64_t* primes,
                                            const int64_t* offsets, int64_t n, int c) {
  const int order = c / h.H + 1;
  uint64_t x = 0;
  for (int s = 0; s <= order; ++s)
    x ^= static_cast<uint64_t>(ngram_at(h, n, s)) * static_cast<uint64_t>(__ldg(mult + s));
  const int64_t p = __ldg(primes + c);
  int64_t r = static_cast<int64_t>(x) % p;
  if (r < 0) r += p;
  return r + __ldg(offsets + c);
}

// 2^(e - 127) as fp32: e = 0 -> 2^-127 (subnormal), e = 255 -> +inf (what exp2 gives).
__device__ __forceinline__ float ue8m0_value(uint32_t e) {
  return __uint_as_float(e ? e << 23 : 0x00400000u);
}

// 16 e4m3 bytes times f, in fp32 (e4m3 -> fp32 is exact; the product rounds once).
__device__ __forceinline__ void dequant16(const uint4& raw, float f, float (&v)[16]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[i] >> (16 * j)),
                                                        __NV_E4M3);
      const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&hr));
      v[4 * i + 2 * j] = p.x * f;
      v[4 * i + 2 * j + 1] = p.y * f;
    }
  }
}

// Store 16 fp32 values (rounded to nearest even) at out (32- or 64-byte aligned).
template <EngramOut T>
__device__ __forceinline__ void store16(void* out, const float (&v)[16]) {
  if constexpr (T == EngramOut::kF32) {
    float4* o = static_cast<float4*>(out);
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
  } else {
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if constexpr (T == EngramOut::kBF16) {
        const __nv_bfloat162 b = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
        w[i] = *reinterpret_cast<const uint32_t*>(&b);
      } else {
        const __half2 b = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
        w[i] = *reinterpret_cast<const uint32_t*>(&b);
      }
    }
    uint4* o = static_cast<uint4*>(out);
    o[0] = make_uint4(w[0], w[1], w[2], w[3]);
    o[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
}

}  // namespace deepfuse::engram
