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
  int stream_balance_max_t = 0;  // ... and up to this, equal stage ranges per CTA (tiles split between two CTAs)
  int prefill_min_t = 0;    // T from this on (> 256; 0: never): the prefill kernels (moe_prefill.cu), fp8 or mxfp4
};

// Workspace (bytes) for a problem; the launcher carves it. P = T * (k + has_shared) pairs.
int64_t moe_workspace_bytes(const MoeProblem& p);

// The router fused into moe_experts (T <= kGateMaxT): logits = x w^T in fp32 (x as given, w fp32
// [E, d], d % 4 == 0), then moe_route's semantics; ids / weights are written, not read.
constexpr int kGateMaxT = 256;
struct MoeGate {
  const float* w = nullptr;         // [E, d]
  const float* bias = nullptr;      // [E] or null
  const void* hash_ids = nullptr;   // [T, k] int32 / int64 or null
  bool hash_is64 = false;
  ScoreFunc score = ScoreFunc::kSqrtSoftplus;
  float route_scale = 1.0f;
};

// x [T, d] (bf16 if x_bf16 else fp32, rows contiguous); ids [T, k] (int32 / int64; ids outside
// [0, E) contribute nothing); weights fp32 [T, k]; out [T, d] of x's dtype. With gate (T <=
// kGateMaxT): ids (int64) and weights are outputs of the fused router (two launches: the logits
// GEMV, then route + plan in one CTA) instead of inputs.
void moe_experts(const MoeProblem& p, const void* x, bool x_bf16, const void* ids, bool ids_is64,
                 const float* weights, void* out, void* workspace, cudaStream_t stream,
                 const MoeGate* gate = nullptr);

// The fused gate's logits [T, E] fp32 (moe_route.cu; internal to moe_experts).
void moe_gate_logits(const void* x, bool x_bf16, const float* w, int T, int d, int E, float* logits,
                     cudaStream_t stream);

}  // namespace deepfuse
