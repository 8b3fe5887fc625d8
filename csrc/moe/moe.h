// Fused MoE on sm90: router, routing plan, grouped FP8 / MXFP4 expert GEMMs, combine.
// Semantics: deepfuse/ops/moe.py (the references). Host launchers only; none allocates or
// synchronises, all are CUDA-graph capturable. Python validates every argument.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace deepfuse {

enum class ScoreFunc : int { kSqrtSoftplus = 0, kSigmoid = 1, kSoftmax = 2 };

// logits fp32 [T, E]; bias fp32 [E] or null; hash_ids [T, k] (int32 / int64) or null.
// -> weights fp32 [T, k], ids int64 [T, k] (descending selection score; hash: as given).
void moe_route(const float* logits, const float* bias, const void* hash_ids, bool hash_is64, float* weights,
               int64_t* ids, int T, int E, int k, float route_scale, ScoreFunc score, cudaStream_t stream);

enum class WeightFmt : int { kFp8 = 0, kMxfp4 = 1 };

// One projection of E stacked experts: w [E, N, Kb] (Kb = K bytes fp8, K / 2 mxfp4) and its
// scales (fp8: [E, ceil(N/128), ceil(K/128)] fp32 or UE8M0 uint8; mxfp4: uint8 [E, N, K/32]).
struct ExpertWeight {
  const void* w = nullptr;
  const void* scale = nullptr;
  bool scale_u8 = false;
};

struct MoeProblem {
  int T = 0, d = 0, inter = 0, E = 0, k = 0;
  WeightFmt fmt = WeightFmt::kFp8;
  ExpertWeight w1, w3, w2;
  bool has_shared = false;  // a shared expert, fp8 [inter, d] / [d, inter] block-scaled, weight 1
  ExpertWeight sw1, sw3, sw2;
  float limit = 0.0f;       // SwiGLU clamp (<= 0: none)
  int stream_max_t = 0;     // T up to this (<= 256): the streaming decode kernels (moe_stream.cu)
  int prefill_min_t = 0;    // T from this on (> 256; 0: never): the prefill kernels (moe_prefill.cu), fp8 or mxfp4
};

// Workspace (bytes) for a problem; the launcher carves it. P = T * (k + has_shared) pairs.
int64_t moe_workspace_bytes(const MoeProblem& p);

// x [T, d] (bf16 if x_bf16 else fp32, rows contiguous); ids [T, k] (int32 / int64; ids outside
// [0, E) contribute nothing); weights fp32 [T, k]; out [T, d] of x's dtype.
void moe_experts(const MoeProblem& p, const void* x, bool x_bf16, const void* ids, bool ids_is64,
                 const float* weights, void* out, void* workspace, cudaStream_t stream);

}  // namespace deepfuse
