// mHC pre / head in two launches. Pass 1 (grid: token groups of kTok x slices of the 4 d
// values, enough CTAs for two per SM) streams x once, accumulating each slice's sum of
// squares and dot products with every fn row (fn is read once per CTA for kTok tokens).
// Pass 2 sums the slices in order, one thread per token computes the sigmoids, the softmax
// and the Sinkhorn normalisations of its 4 x 4 matrix, and the CTA writes y = sum_i pre_i x_i.
// (fn @ (v r) is computed as r (fn @ v): the same in exact math.) Deterministic.
// mHC post: elementwise over [4, d] per token.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "common/cuda_utils.h"
#include "mhc/mhc.h"

namespace deepfuse {
namespace {

constexpr int kN = 4;
constexpr int kThreads = 256;
constexpr int kTok = 4;

template <typename T>
__device__ __forceinline__ float4 load4(const T* p);
template <>
__device__ __forceinline__ float4 load4<float>(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
template <>
__device__ __forceinline__ float4 load4<__nv_bfloat16>(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ void store4(__nv_bfloat16* p, float4 v) {
  const __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
  uint2 u;
  u.x = *reinterpret_cast<const uint32_t*>(&a);
  u.y = *reinterpret_cast<const uint32_t*>(&b);
  *reinterpret_cast<uint2*>(p) = u;
}
__device__ __forceinline__ float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

// Pass 1: CTA (g, s) takes tokens g kTok .. and the s-th slice of the 4 d values; it writes
// the slice's dot products with every fn row and its sum of squares to part[t][s][*].
template <typename T, int MIX>
__global__ void __launch_bounds__(kThreads) hc_dots_kernel(const T* __restrict__ x, const float* __restrict__ fn,
                                                           float* __restrict__ part, int64_t Ttot, int d, int S) {
  constexpr int NV = MIX + 1;  // dot products + the sum of squares
  __shared__ float red[kThreads / 32][kTok][NV];
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTok;
  const int ntok = Ttot - t0 < kTok ? static_cast<int>(Ttot - t0) : kTok;
  const int L = kN * d;
  const int slice = (L / 4 + S - 1) / S * 4;
  const int lo = blockIdx.y * slice, hi = min(L, lo + slice);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

  float acc[kTok][NV];
#pragma unroll
  for (int k = 0; k < kTok; ++k)
#pragma unroll
    for (int m = 0; m < NV; ++m) acc[k][m] = 0.0f;
  for (int i = lo + tid * 4; i < hi; i += kThreads * 4) {
    float4 v[kTok];
#pragma unroll
    for (int k = 0; k < kTok; ++k) {
      v[k] = k < ntok ? load4(x + (t0 + k) * L + i) : make_float4(0.f, 0.f, 0.f, 0.f);
      acc[k][MIX] += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
    }
#pragma unroll
    for (int m = 0; m < MIX; ++m) {
      const float4 w = load4(fn + static_cast<int64_t>(m) * L + i);
#pragma unroll
      for (int k = 0; k < kTok; ++k) acc[k][m] += w.x * v[k].x + w.y * v[k].y + w.z * v[k].z + w.w * v[k].w;
    }
  }
#pragma unroll
  for (int k = 0; k < kTok; ++k)
#pragma unroll
    for (int m = 0; m < NV; ++m) {
      float s = acc[k][m];
#pragma unroll
      for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) red[warp][k][m] = s;
    }
  __syncthreads();
  for (int q = tid; q < ntok * NV; q += kThreads) {
    const int k = q / NV, m = q % NV;
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) s += red[w][k][m];
    part[((t0 + k) * S + blockIdx.y) * NV + m] = s;
  }
}

// Pass 2: per kTok tokens: the slices summed in order, sigmoids, softmax + Sinkhorn, then y.
template <typename T, int MIX>
__global__ void __launch_bounds__(kThreads) hc_finish_kernel(const T* __restrict__ x, const float* __restrict__ part,
                                                             const float* __restrict__ scale,
                                                             const float* __restrict__ base, T* __restrict__ y,
                                                             float* __restrict__ post, float* __restrict__ comb,
                                                             int64_t Ttot, int d, int S, float norm_eps, float hc_eps,
                                                             int iters) {
  constexpr int NV = MIX + 1;
  __shared__ float mix[kTok][NV];
  __shared__ float pre_s[kTok][kN];
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTok;
  const int ntok = Ttot - t0 < kTok ? static_cast<int>(Ttot - t0) : kTok;
  const int L = kN * d;
  const int tid = threadIdx.x;
  for (int q = tid; q < ntok * NV; q += kThreads) {
    const int k = q / NV, m = q % NV;
    float s = 0.0f;
    for (int z = 0; z < S; ++z) s += part[((t0 + k) * S + z) * NV + m];
    mix[k][m] = s;
  }
  __syncthreads();
  // One warp per token: lanes 0..15 hold comb[i][j] (i = lane / 4, j = lane % 4), so row sums
  // reduce over lanes xor 1, 2 and column sums over xor 4, 8 (lanes 16..31 mirror 0..15).
  const int warp = tid >> 5, lane = tid & 31;
  if (warp < ntok) {
    const int k = warp;
    const int64_t t = t0 + k;
    const float r = rsqrtf(mix[k][MIX] / L + norm_eps);
    if (lane < kN) {
      pre_s[k][lane] = sigmoidf(mix[k][lane] * r * scale[0] + base[lane]) + hc_eps;
      if constexpr (MIX != kN) post[t * kN + lane] = 2.0f * sigmoidf(mix[k][kN + lane] * r * scale[1] + base[kN + lane]);
    }
    if constexpr (MIX != kN) {
      const int e = lane & 15;
      auto rows = [](float v) {
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        return v + __shfl_xor_sync(0xffffffffu, v, 2);
      };
      auto cols = [](float v) {
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        return v + __shfl_xor_sync(0xffffffffu, v, 8);
      };
      float c = mix[k][2 * kN + e] * r * scale[2] + base[2 * kN + e];
      float mx = fmaxf(c, __shfl_xor_sync(0xffffffffu, c, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      c = expf(c - mx);
      c = c / rows(c) + hc_eps;
      c = c / (cols(c) + hc_eps);
      for (int it = 1; it < iters; ++it) {
        c = c / (rows(c) + hc_eps);
        c = c / (cols(c) + hc_eps);
      }
      if (lane < kN * kN) comb[t * kN * kN + e] = c;
    }
  }
  __syncthreads();
  for (int k = 0; k < ntok; ++k) {
    const T* xt = x + (t0 + k) * L;
    for (int cidx = tid * 4; cidx < d; cidx += kThreads * 4) {
      float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        const float4 v = load4(xt + i * d + cidx);
        const float p = pre_s[k][i];
        s.x += p * v.x, s.y += p * v.y, s.z += p * v.z, s.w += p * v.w;
      }
      store4(y + (t0 + k) * d + cidx, s);
    }
  }
}

template <typename T>
__global__ void hc_post_kernel(const T* __restrict__ f, const T* __restrict__ x, const float* __restrict__ post,
                               const float* __restrict__ comb, T* __restrict__ out, int d) {
  const int64_t t = blockIdx.x;  // tokens on x: more than 65535 of them
  const int cidx = (blockIdx.y * blockDim.x + threadIdx.x) * 4;
  if (cidx >= d) return;
  float p[kN], c[kN][kN];
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    p[i] = post[t * kN + i];
#pragma unroll
    for (int j = 0; j < kN; ++j) c[i][j] = comb[(t * kN + i) * kN + j];
  }
  const float4 fv = load4(f + t * d + cidx);
  float4 xv[kN];
#pragma unroll
  for (int i = 0; i < kN; ++i) xv[i] = load4(x + (t * kN + i) * d + cidx);
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    float4 s = make_float4(p[j] * fv.x, p[j] * fv.y, p[j] * fv.z, p[j] * fv.w);
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      s.x += c[i][j] * xv[i].x, s.y += c[i][j] * xv[i].y, s.z += c[i][j] * xv[i].z, s.w += c[i][j] * xv[i].w;
    }
    store4(out + (t * kN + j) * d + cidx, s);
  }
}

}  // namespace

int hc_mix_splits(int64_t T, int d) {
  const int64_t groups = ceil_div<int64_t>(T, kTok);
  const int64_t want = ceil_div<int64_t>(2 * num_sms(), groups);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, kN * d / 2048)));
}

void hc_mix(const void* x, bool x_bf16, const float* fn, const float* scale, const float* base, void* y,
            float* post, float* comb, float* part, int64_t T, int d, bool head, float norm_eps, float hc_eps,
            int iters, cudaStream_t stream) {
  if (T <= 0) return;
  const int S = hc_mix_splits(T, d);
  const unsigned groups = static_cast<unsigned>(ceil_div<int64_t>(T, kTok));
#define DF_LAUNCH(TY, MIX)                                                                                     \
  do {                                                                                                         \
    hc_dots_kernel<TY, MIX><<<dim3(groups, S), kThreads, 0, stream>>>(static_cast<const TY*>(x), fn, part, T, d, \
                                                                      S);                                      \
    hc_finish_kernel<TY, MIX><<<groups, kThreads, 0, stream>>>(static_cast<const TY*>(x), part, scale, base,    \
                                                               static_cast<TY*>(y), post, comb, T, d, S,        \
                                                               norm_eps, hc_eps, iters);                        \
  } while (0)
  if (x_bf16) {
    if (head) DF_LAUNCH(__nv_bfloat16, kN);
    else DF_LAUNCH(__nv_bfloat16, (2 + kN) * kN);
  } else {
    if (head) DF_LAUNCH(float, kN);
    else DF_LAUNCH(float, (2 + kN) * kN);
  }
#undef DF_LAUNCH
  check_launch("hc_mix_kernel");
}

void hc_post(const void* f, const void* x, bool bf16, const float* post, const float* comb, void* out, int64_t T,
             int d, cudaStream_t stream) {
  if (T <= 0) return;
  const dim3 grid(static_cast<unsigned>(T), ceil_div(d, 4 * 128));
  if (bf16)
    hc_post_kernel<__nv_bfloat16><<<grid, 128, 0, stream>>>(static_cast<const __nv_bfloat16*>(f),
                                                            static_cast<const __nv_bfloat16*>(x), post, comb,
                                                            static_cast<__nv_bfloat16*>(out), d);
  else
    hc_post_kernel<float><<<grid, 128, 0, stream>>>(static_cast<const float*>(f), static_cast<const float*>(x), post,
                                                    comb, static_cast<float*>(out), d);
  check_launch("hc_post_kernel");
}

}  // namespace deepfuse
