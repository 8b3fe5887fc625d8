// Router device code shared by moe_route_kernel (moe_route.cu) and the fused gate + plan kernel
// (moe_experts.cu): one warp routes one token. Internal to csrc/moe.
#pragma once
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "moe/moe.h"

namespace deepfuse {
namespace route {

template <ScoreFunc S>
__device__ __forceinline__ float score(float l) {
  if constexpr (S == ScoreFunc::kSqrtSoftplus) {
    const float sp = l > 20.0f ? l : log1pf(expf(l));  // torch softplus (threshold 20)
    return sqrtf(sp);
  } else if constexpr (S == ScoreFunc::kSigmoid) {
    return 1.0f / (1.0f + expf(-l));
  } else {
    return l;  // softmax: normalised below
  }
}

// Token t's scores in fp32, top-k of (score + bias) by k warp arg-max rounds (ties: the lower
// expert id; hash_ids given: those ids), weights normalised over the chosen k and scaled.
// g, sel: this warp's shared-memory scratch of E floats each. All 32 lanes call it.
template <ScoreFunc S>
__device__ __forceinline__ void route_token(const float* __restrict__ row, const float* __restrict__ bias,
                                            const void* __restrict__ hash_ids, bool hash_is64, float* g, float* sel,
                                            int t, int E, int k, float route_scale, float* __restrict__ weights,
                                            int64_t* __restrict__ ids) {
  const int lane = threadIdx.x % 32;
  float mx = -FLT_MAX;
  for (int e = lane; e < E; e += 32) {
    const float v = score<S>(row[e]);
    g[e] = v;
    mx = fmaxf(mx, v);
  }
  if constexpr (S == ScoreFunc::kSoftmax) {
#pragma unroll
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
    for (int e = lane; e < E; e += 32) {
      const float v = expf(g[e] - mx);
      g[e] = v;
      sum += v;
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float inv = 1.0f / sum;
    for (int e = lane; e < E; e += 32) g[e] *= inv;
  }
  __syncwarp();

  int chosen = -1;  // lane j < k holds the j-th id
  if (hash_ids != nullptr) {
    if (lane < k) {
      const int64_t off = static_cast<int64_t>(t) * k + lane;
      chosen = hash_is64 ? static_cast<int>(static_cast<const int64_t*>(hash_ids)[off])
                         : static_cast<const int32_t*>(hash_ids)[off];
    }
  } else {
    for (int e = lane; e < E; e += 32) sel[e] = g[e] + (bias != nullptr ? bias[e] : 0.0f);
    __syncwarp();
    for (int j = 0; j < k; ++j) {
      float best = -FLT_MAX;
      int bi = 0x7fffffff;
      for (int e = lane; e < E; e += 32) {
        const float v = sel[e];
        if (v > best || (v == best && e < bi)) best = v, bi = e;
      }
#pragma unroll
      for (int o = 16; o; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) best = ov, bi = oi;
      }
      if (lane == j) chosen = bi;
      if (lane == 0) sel[bi] = -INFINITY;
      __syncwarp();
    }
  }
  // An id outside [0, E) (hash tables of another shard) keeps weight 0.
  float w = (lane < k && chosen >= 0 && chosen < E) ? g[chosen] : 0.0f;
  float sum = w;
#pragma unroll
  for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane < k) {
    const int64_t off = static_cast<int64_t>(t) * k + lane;
    weights[off] = w / (sum + 1e-20f) * route_scale;
    ids[off] = chosen;
  }
  __syncwarp();  // g / sel are reused by the warp's next token
}

}  // namespace route
}  // namespace deepfuse
