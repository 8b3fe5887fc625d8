// Router: one warp per token (moe_route.cuh). Scores in fp32, top-k of (score + bias) by k warp
// arg-max rounds (ties: the lower expert id), weights normalised over the chosen k and scaled.
// And the fused gate's logits GEMV (moe_experts with a gate: moe_experts.cu runs route + plan).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "common/cuda_utils.h"
#include "moe/moe.h"
#include "moe/moe_route.cuh"

namespace deepfuse {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxE = 1024;

template <ScoreFunc S>
__global__ void __launch_bounds__(kWarps * 32) moe_route_kernel(const float* __restrict__ logits,
                                                                 const float* __restrict__ bias,
                                                                 const void* __restrict__ hash_ids, bool hash_is64,
                                                                 float* __restrict__ weights,
                                                                 int64_t* __restrict__ ids, int T, int E, int k,
                                                                 float route_scale) {
  __shared__ float s_g[kWarps][kMaxE];
  __shared__ float s_sel[kWarps][kMaxE];
  const int warp = threadIdx.x / 32;
  const int t = blockIdx.x * kWarps + warp;
  if (t >= T) return;
  route::route_token<S>(logits + static_cast<int64_t>(t) * E, bias, hash_ids, hash_is64, s_g[warp], s_sel[warp], t,
                        E, k, route_scale, weights, ids);
}

// Router logits for the fused gate (moe_experts with a gate): logits[t, e] = sum_k x[t, k] w[e, k]
// in fp32. A CTA of 8 warps takes 2 experts, 4 warps each; a warp's lanes walk its expert's row
// in float4 steps (lane + 32 (w + 4 i)), kTG tokens at a time (the slice of w stays in L1 for
// the next group); lane sums, a shuffle tree, then the 4 warps in order: deterministic.
constexpr int kGateWarps = 8, kGateWPE = 4, kGateEPB = kGateWarps / kGateWPE, kTG = 8;

__device__ __forceinline__ float4 load_x4(const __nv_bfloat16* x) {
  const uint2 u = __ldg(reinterpret_cast<const uint2*>(x));
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ float4 load_x4(const float* x) { return __ldg(reinterpret_cast<const float4*>(x)); }

template <typename XT>
__global__ void __launch_bounds__(kGateWarps * 32) gate_logits_kernel(const XT* __restrict__ x,
                                                                      const float* __restrict__ w, int T, int d,
                                                                      int E, float* __restrict__ logits) {
  // the route + plan kernel after this one waits for its completion (griddepcontrol.wait)
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  __shared__ float red[kGateWarps][kTG];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, ws = warp % kGateWPE;
  const int e = blockIdx.x * kGateEPB + warp / kGateWPE;
  const int d4 = d / 4;
  const float* wr = w + static_cast<int64_t>(min(e, E - 1)) * d;
  for (int t0 = 0; t0 < T; t0 += kTG) {
    float acc[kTG];
#pragma unroll
    for (int j = 0; j < kTG; ++j) acc[j] = 0.0f;
    if (e < E) {
#pragma unroll 4
      for (int q = ws * 32 + lane; q < d4; q += kGateWPE * 32) {
        const float4 wv = __ldg(reinterpret_cast<const float4*>(wr) + q);
#pragma unroll
        for (int j = 0; j < kTG; ++j) {
          if (t0 + j < T) {
            const float4 xv = load_x4(x + static_cast<int64_t>(t0 + j) * d + 4 * q);
            acc[j] = fmaf(wv.x, xv.x, acc[j]);
            acc[j] = fmaf(wv.y, xv.y, acc[j]);
            acc[j] = fmaf(wv.z, xv.z, acc[j]);
            acc[j] = fmaf(wv.w, xv.w, acc[j]);
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kTG; ++j) {
#pragma unroll
      for (int o = 16; o; o >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
    }
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < kTG; ++j) red[warp][j] = acc[j];
    }
    __syncthreads();
    if (ws == 0 && lane < kTG && e < E && t0 + lane < T) {
      float s = red[warp][lane];
#pragma unroll
      for (int u = 1; u < kGateWPE; ++u) s += red[warp + u][lane];
      logits[static_cast<int64_t>(t0 + lane) * E + e] = s;
    }
    __syncthreads();
  }
}

}  // namespace

void moe_route(const float* logits, const float* bias, const void* hash_ids, bool hash_is64, float* weights,
               int64_t* ids, int T, int E, int k, float route_scale, ScoreFunc score, cudaStream_t stream) {
  if (T <= 0) return;
  if (E > kMaxE || k > 32) throw std::runtime_error("deepfuse: moe_route: E <= 1024 and k <= 32 required");
  const dim3 grid(ceil_div(T, kWarps)), block(kWarps * 32);
  switch (score) {
    case ScoreFunc::kSqrtSoftplus:
      moe_route_kernel<ScoreFunc::kSqrtSoftplus><<<grid, block, 0, stream>>>(logits, bias, hash_ids, hash_is64,
                                                                             weights, ids, T, E, k, route_scale);
      break;
    case ScoreFunc::kSigmoid:
      moe_route_kernel<ScoreFunc::kSigmoid><<<grid, block, 0, stream>>>(logits, bias, hash_ids, hash_is64, weights,
                                                                        ids, T, E, k, route_scale);
      break;
    case ScoreFunc::kSoftmax:
      moe_route_kernel<ScoreFunc::kSoftmax><<<grid, block, 0, stream>>>(logits, bias, hash_ids, hash_is64, weights,
                                                                        ids, T, E, k, route_scale);
      break;
  }
  check_launch("moe_route_kernel");
}

void moe_gate_logits(const void* x, bool x_bf16, const float* w, int T, int d, int E, float* logits,
                     cudaStream_t stream) {
  const dim3 grid(ceil_div(E, kGateEPB)), block(kGateWarps * 32);
  if (x_bf16)
    gate_logits_kernel<<<grid, block, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), w, T, d, E, logits);
  else
    gate_logits_kernel<<<grid, block, 0, stream>>>(static_cast<const float*>(x), w, T, d, E, logits);
  check_launch("gate_logits_kernel");
}

}  // namespace deepfuse
