// Block-scaled FP8 / MXFP4 linear (semantics: deepfuse/ops/linear.py) on sm90: activations
// cast to FP8 per token per 128 (fp32 scales), then the grouped GEMM's weight-streaming
// kernel with one "expert". Host launch only; no allocation, no sync, graph-capturable.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace deepfuse {

struct LinearProblem {
  int64_t M = 0;
  int K = 0, N = 0;
  bool mxfp4 = false;          // else fp8 (128 x 128 block scales)
  const void* w = nullptr;     // fp8 [N, K] or packed e2m1 [N, K/2]
  const void* scale = nullptr; // fp8: [ceil(N/128), ceil(K/128)] fp32 / UE8M0; mxfp4: UE8M0 [N, K/32]
  bool scale_u8 = false;
  int groups = 0;              // > 0: block-diagonal: x [M, groups, K], w [groups * N, K] -> [M, groups, N]
  int stream_max_m = 64;       // dense M up to this: the one-launch streaming kernel (stream_linear.cu)
  int stream_max_splits = 8;   // served only where its plan needs at most this many K splits (1, 2, 4, 8)
  int stream_wgs = 1;          // consumer warpgroups per streaming CTA (1, 2: where it owns >= 2 tiles)
  int stream_policy = 0;       // plan: 0 the most CTAs per SM that fit, 1 the most ring stages resident
  bool stream_grouped = false; // block-diagonal w (groups > 0, N % 64 == 0) through the streaming kernel too
  bool x_mx = false;           // x is MXFP8: e4m3 with UE8M0 scales per 32 (x_scale); streaming kernel only
  const void* x_scale = nullptr;  // x_mx: uint8 [M, K/32] ([M, groups, K/32])
  bool persist = false;        // dense fp8 M <= 64: the persistent kernel (persist_linear.cu) first
  int persist_splits = 0;      // its K splits (0: the plan's choice; else at most this many, no empty split)
};

int64_t fp8_linear_workspace_bytes(const LinearProblem& p);

// Dense x [M, K] times w for M <= min(max_m, 64) in one launch (no workspace): TMA weight
// stream, the activation cast fused, K splits reduced across a cluster. false: not served
// (shape, M, no tensor-map entry point); the caller runs the grouped kernel.
bool stream_linear(const LinearProblem& p, int max_m, const void* x, bool x_bf16, void* out, bool out_bf16,
                   cudaStream_t stream);

// Dense fp8 x [M, K] times w for M <= 64 (persist_linear.cu): activation cast, one persistent CTA per
// SM streaming 128-row weight tiles, split-K partials reduced in split order; three launches chained
// by PDL. false: not served. Its workspace bytes (0: not served).
int64_t persist_linear_workspace_bytes(const LinearProblem& p);
bool persist_linear(const LinearProblem& p, const void* x, bool x_bf16, void* out, bool out_bf16, void* workspace,
                    cudaStream_t stream);

// x [M, K] (bf16 if x_bf16 else fp32, contiguous) -> out [M, N] (bf16 if out_bf16 else fp32);
// grouped: x [M, groups, K] -> out [M, groups, N].
void fp8_linear(const LinearProblem& p, const void* x, bool x_bf16, void* out, bool out_bf16, void* workspace,
                cudaStream_t stream);

}  // namespace deepfuse
