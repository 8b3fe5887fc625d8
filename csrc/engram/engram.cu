// Engram kernels (engram.h). Gather: one thread per 16 bytes of a table row (D / 16 threads a
// row; a Flash row of 256 bytes is half a warp), the row id read or hashed per thread, one
// 16-byte load of values + one exponent byte, 32 / 64 bytes written. Gate: one block per
// (token, stream), three fp32 dot products reduced over d, then x + g v.
#include <cuda_bf16.h>

#include <algorithm>

#include "common/cuda_utils.h"
#include "engram/engram.cuh"

namespace deepfuse {

namespace engram {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) hash_kernel(const EngramHashArgs h, int64_t N, int L, int64_t* out) {
  const int C = (h.M - 1) * h.H;
  const int64_t total = N * L * C;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int c = static_cast<int>(i % C);
    const int l = static_cast<int>((i / C) % L);
    const int64_t n = i / (static_cast<int64_t>(C) * L);
    out[i] = hash_row(h, h.mult + static_cast<int64_t>(l) * h.M, h.primes + static_cast<int64_t>(l) * C,
                      h.offsets + static_cast<int64_t>(l) * C, n, c);
  }
}

// Row source of the gather: ids read from memory, or hashed from the n-gram ids.
struct IdsSource {
  const void* ids;
  bool ids64;
  int64_t ld;
  __device__ __forceinline__ int64_t operator()(int64_t n, int c) const {
    return ids64 ? static_cast<const int64_t*>(ids)[n * ld + c]
                 : static_cast<int64_t>(static_cast<const int32_t*>(ids)[n * ld + c]);
  }
};

struct HashSource {
  EngramHashArgs h;
  __device__ __forceinline__ int64_t operator()(int64_t n, int c) const {
    return hash_row(h, h.mult, h.primes, h.offsets, n, c);
  }
};

template <EngramOut T, typename Src>
__global__ void __launch_bounds__(kThreads) gather_kernel(const EngramTable t, const Src src, int64_t N, int C,
                                                          void* out) {
  const int parts = t.D / 16;  // 16-byte parts of a row
  const int64_t total = N * C * parts;
  constexpr int kOutBytes = T == EngramOut::kF32 ? 64 : 32;  // per part
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int part = static_cast<int>(i % parts);
    const int64_t nc = i / parts;
    const int64_t row = src(nc / C, static_cast<int>(nc % C));
    float v[16];
    if (row >= 0 && row < t.R) {
      const uint4 raw = *reinterpret_cast<const uint4*>(t.rows + row * t.D + part * 16);
      const uint32_t e = t.scale[row * (t.D / 32) + part / 2];
      dequant16(raw, ue8m0_value(e), v);
    } else {
#pragma unroll
      for (int k = 0; k < 16; ++k) v[k] = 0.0f;
    }
    store16<T>(static_cast<char*>(out) + i * kOutBytes, v);
  }
}

template <typename Src>
void launch_gather(const EngramTable& t, const Src& src, int64_t N, int C, void* out, EngramOut type,
                   cudaStream_t stream) {
  const int64_t total = N * C * (t.D / 16);
  if (total == 0) return;
  const int64_t cap = static_cast<int64_t>(num_sms()) * 64;  // resident blocks x 8; the loop strides
  const int grid = static_cast<int>(std::min<int64_t>(ceil_div<int64_t>(total, kThreads), cap));
  switch (type) {
    case EngramOut::kF32:
      gather_kernel<EngramOut::kF32><<<grid, kThreads, 0, stream>>>(t, src, N, C, out);
      break;
    case EngramOut::kBF16:
      gather_kernel<EngramOut::kBF16><<<grid, kThreads, 0, stream>>>(t, src, N, C, out);
      break;
    case EngramOut::kF16:
      gather_kernel<EngramOut::kF16><<<grid, kThreads, 0, stream>>>(t, src, N, C, out);
      break;
  }
  check_launch("engram gather");
}

// ----------------------------------------------------------------------------- gate
constexpr int kGateThreads = 256;

__device__ __forceinline__ void load8f(const __nv_bfloat16* p, float (&v)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void load8f(const float* p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&v)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    w[i] = *reinterpret_cast<const uint32_t*>(&b);
  }
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void store8(float* p, const float (&v)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

template <typename T>
__global__ void __launch_bounds__(kGateThreads) gate_kernel(const T* __restrict__ hidden, const T* __restrict__ kv,
                                                            const float* __restrict__ wh,
                                                            const float* __restrict__ we, T* __restrict__ out,
                                                            int n, int d, float clamp, float eps) {
  const int64_t tok = blockIdx.x / n;
  const int j = static_cast<int>(blockIdx.x % n);
  const T* x = hidden + (tok * n + j) * d;
  const T* k = kv + (tok * (n + 1) + j) * d;
  const T* v = kv + (tok * (n + 1) + n) * d;
  const float* a = wh + static_cast<int64_t>(j) * d;
  const float* b = we + static_cast<int64_t>(j) * d;
  float sxx = 0.f, skk = 0.f, sxk = 0.f;
  for (int c = threadIdx.x * 8; c < d; c += kGateThreads * 8) {
    float xv[8], kv8[8], av[8], bv[8];
    load8f(x + c, xv);
    load8f(k + c, kv8);
    load8f(a + c, av);
    load8f(b + c, bv);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      sxx = fmaf(xv[i], xv[i], sxx);
      skk = fmaf(kv8[i], kv8[i], skk);
      sxk = fmaf(xv[i] * av[i], kv8[i] * bv[i], sxk);
    }
  }
  __shared__ float red[3][kGateThreads / 32];
  __shared__ float gate;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    sxx += __shfl_xor_sync(0xffffffffu, sxx, o);
    skk += __shfl_xor_sync(0xffffffffu, skk, o);
    sxk += __shfl_xor_sync(0xffffffffu, sxk, o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    red[0][warp] = sxx;
    red[1][warp] = skk;
    red[2][warp] = sxk;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float s0 = 0.f, s1 = 0.f, s2 = 0.f;
    for (int w = 0; w < kGateThreads / 32; ++w) {
      s0 += red[0][w];
      s1 += red[1][w];
      s2 += red[2][w];
    }
    const float rx = 1.0f / sqrtf(s0 / d + eps);
    const float rk = 1.0f / sqrtf(s1 / d + eps);
    const float dot = s2 * rx * rk * (1.0f / sqrtf(static_cast<float>(d)));
    const float sgn = dot > 0.f ? 1.f : (dot < 0.f ? -1.f : (dot == 0.f ? 0.f : dot));  // torch.sign; NaN stays
    const float z = sqrtf(fmaxf(fabsf(dot), clamp)) * sgn;
    gate = 1.0f / (1.0f + expf(-z));
  }
  __syncthreads();
  const float g = gate;
  T* y = out + (tok * n + j) * d;
  for (int c = threadIdx.x * 8; c < d; c += kGateThreads * 8) {
    float xv[8], vv[8];
    load8f(x + c, xv);
    load8f(v + c, vv);
#pragma unroll
    for (int i = 0; i < 8; ++i) xv[i] = xv[i] + g * vv[i];
    store8(y + c, xv);
  }
}

}  // namespace engram

void engram_hash(const EngramHashArgs& h, int64_t N, int L, int64_t* out, cudaStream_t stream) {
  const int64_t total = N * L * (h.M - 1) * h.H;
  if (total == 0) return;
  const int grid = static_cast<int>(
      std::min<int64_t>(ceil_div<int64_t>(total, engram::kThreads), static_cast<int64_t>(num_sms()) * 64));
  engram::hash_kernel<<<grid, engram::kThreads, 0, stream>>>(h, N, L, out);
  check_launch("engram_hash");
}

void engram_lookup(const EngramTable& t, const void* ids, bool ids64, int64_t ids_ld, int64_t N, int C, void* out,
                   EngramOut type, cudaStream_t stream) {
  engram::launch_gather(t, engram::IdsSource{ids, ids64, ids_ld}, N, C, out, type, stream);
}

void engram_embed(const EngramHashArgs& h, int64_t N, const EngramTable& t, void* out, EngramOut type,
                  cudaStream_t stream) {
  engram::launch_gather(t, engram::HashSource{h}, N, (h.M - 1) * h.H, out, type, stream);
}

void engram_gate(const void* hidden, const void* kv, const float* w_hidden, const float* w_embed, void* out,
                 int64_t N, int n, int d, bool bf16, float clamp, float eps, cudaStream_t stream) {
  const int64_t blocks = N * n;
  if (blocks == 0) return;
  if (bf16) {
    engram::gate_kernel<__nv_bfloat16><<<static_cast<unsigned>(blocks), engram::kGateThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(hidden), static_cast<const __nv_bfloat16*>(kv), w_hidden, w_embed,
        static_cast<__nv_bfloat16*>(out), n, d, clamp, eps);
  } else {
    engram::gate_kernel<float><<<static_cast<unsigned>(blocks), engram::kGateThreads, 0, stream>>>(
        static_cast<const float*>(hidden), static_cast<const float*>(kv), w_hidden, w_embed,
        static_cast<float*>(out), n, d, clamp, eps);
  }
  check_launch("engram_gate");
}

}  // namespace deepfuse
