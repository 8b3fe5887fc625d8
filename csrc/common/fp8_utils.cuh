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

// UE8M0 exponent e in [-127, 127]: the smallest power of two 2^e with amax / 2^e <= 448.
// amax / 448 == 0 gives -127. Exact: ceil(log2(amax / 448)) corrected against 448 * 2^e.
__device__ __forceinline__ int ue8m0_exponent(float amax) {
  const float v = amax / kE4M3Max;
  if (v == 0.0f) return -127;  // zero, or the division underflowed
  int e;
  float m = frexpf(v, &e);                 // v = m * 2^e, m in [0.5, 1)
  if (m == 0.5f) e -= 1;                   // v is a power of two
  if (amax > ldexpf(kE4M3Max, e)) e += 1;  // the division rounded down across a power of two
  return max(-127, min(127, e));
}

// 2^n exactly for n in [-127, 127] (2^-127 is subnormal; no ftz).
__device__ __forceinline__ float exp2i(int n) {
  return n >= -126 ? __int_as_float((n + 127) << 23) : __int_as_float(0x00400000);
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
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[8]) {
  uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  float4 a = __ldg(reinterpret_cast<const float4*>(p));
  float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

}  // namespace deepfuse
