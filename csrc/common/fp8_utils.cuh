// Device helpers for FP8 e4m3 / UE8M0 scaling. The semantics are defined by the Python
// references in deepfuse/ops/cast.py; these must stay bit-identical to them.
#pragma once
#include <cuda_fp8.h>
#include <cuda_bf16.h>
#include <cstdint>

namespace deepfuse {

constexpr float kE4M3Max = 448.0f;
constexpr float kFp32Tiny = 1.17549435e-38f;  // 2^-126, smallest normal fp32

// |v| for finite v, 0 for inf/NaN: non-finite values never set a group's scale.
__device__ __forceinline__ float finite_abs(float v) { return isfinite(v) ? fabsf(v) : 0.0f; }

// fp32 scale: amax / 448, at least 2^-126 (so all-zero groups get a finite scale).
__device__ __forceinline__ float fp32_scale(float amax) { return fmaxf(amax / kE4M3Max, kFp32Tiny); }

// 2^n exactly for n in [-127, 127] (2^-127 is subnormal; no ftz).
__device__ __forceinline__ float exp2i(int n) {
  return n >= -126 ? __uint_as_float(static_cast<uint32_t>(n + 127) << 23) : __uint_as_float(0x00400000u);
}

// UE8M0 exponent e in [-127, 127]: the smallest power of two 2^e with amax / 2^e <= 448.
// Exact: ceil(log2(v)) of v = amax / 448 from its bits, then corrected against 448 * 2^e
// (the division may round down across a power of two). v == 0 (amax == 0, or the
// division underflowed) gives -127, as does any v <= 2^-127 (clamped).
__device__ __forceinline__ int ue8m0_exponent(float amax) {
  const float v = amax / kE4M3Max;
  if (v == 0.0f) return -127;
  const uint32_t bits = __float_as_uint(v);  // v > 0: no sign bit
  const int biased = static_cast<int>(bits >> 23);
  int e = biased == 0 ? (v > 0x1p-127f ? -126 : -127)             // subnormal v
                      : biased - 127 + ((bits & 0x7fffffu) != 0u);  // ceil(log2(v))
  if (amax > kE4M3Max * exp2i(e)) e += 1;
  return min(127, e);
}

// Eight floats to eight e4m3 bytes (round to nearest even, saturating; NaN stays NaN).
__device__ __forceinline__ uint2 to_e4m3x8(const float (&v)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = __nv_cvt_float2_to_fp8x2(make_float2(v[2 * i], v[2 * i + 1]), __NV_SATFINITE, __NV_E4M3);
  return make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
}

// 16-byte loads of eight values, widened to fp32.
// Eight bf16 (raw bits) widened to fp32.
__device__ __forceinline__ void widen8(const uint4& raw, float (&v)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[8]) {
  widen8(__ldg(reinterpret_cast<const uint4*>(p)), v);
}

__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  float4 a = __ldg(reinterpret_cast<const float4*>(p));
  float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// Max |x| over the finite values among eight bf16 (raw bits), as a float. Integer SIMD on
// 16-bit halves: a bf16 is finite iff |bits| < 0x7f80, and non-negative floats order as
// their bit patterns, so the result equals the float computation exactly.
__device__ __forceinline__ float finite_amax8_bf16(const uint4& raw) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t a = w[i] & 0x7fff7fffu;
    m = __vmaxu2(m, a & __vcmpltu2(a, 0x7f807f80u));
  }
  return __uint_as_float(max(m & 0xffffu, m >> 16) << 16);
}

}  // namespace deepfuse
