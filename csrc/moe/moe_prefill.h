// Prefill-path expert GEMMs of moe_experts (csrc/moe/moe_prefill.cu): tokens on wgmma's M side,
// a TMA producer warp feeding an mbarrier ring, two consumer warpgroups, a persistent tile
// scheduler over (task, n-tile). Internal to csrc/moe.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "moe/moe.h"

namespace deepfuse {

struct MoePrefillIO {
  const void* x;            // [T, d] bf16 / fp32
  bool x_bf16;
  const int* rows;          // plan: token of each position
  const int* tasks;         // plan: [U, 3] tasks of <= 128 positions (expert, first, end)
  const int* ntasks;
  int64_t U;                // tasks bound
  int64_t P;                // positions bound (rows of xp / h / hq / Y)
  uint8_t* xp;              // [P, d] e4m3: x gathered into position order
  float* xsT;               // [ceil(d/128), Pp] fp32 scales, transposed (Pp = P rounded up to 4)
  __nv_bfloat16* h;         // [P, inter]
  uint8_t* hq;              // [P, inter] e4m3
  float* hsT;               // [ceil(inter/128), Pp]
  float* Y;                 // [P, d]
  const float* wrow;        // [P] routing weight of each position
};

inline int64_t moe_prefill_pitch(int64_t P) { return (P + 3) / 4 * 4; }

// Whether the prefill kernels serve this problem (fp8 or mxfp4 weights, d and inter multiples of 128).
bool moe_prefill_supported(const MoeProblem& p);

// gather-cast x -> GEMM1 (w1 | w3, SwiGLU -> h bf16) -> cast h -> GEMM2 (w2 x routing weight -> Y);
// mxfp4 experts: the e2m1 weights decoded to e4m3 in shared memory by decode warps (moe_prefill.cu).
// false: not served (nothing launched).
bool moe_prefill_gemms(const MoeProblem& p, const MoePrefillIO& io, cudaStream_t stream);

// Dense FP8 linears at large M through the same fp8 kernel (one group, no routing): x [M, G Kg] bf16 / fp32
// (cast per 128 into the workspace) times w e4m3 [G R, Kg] (block-diagonal when G > 1: group g of x
// through rows g R ..) with 128 x 128 block scales [ceil(G R / 128), ceil(Kg / 128)] fp32 / UE8M0
// -> out [M, G R] bf16 / fp32. force_bn: 128 / 256 tiles (0: by the tile count); cluster: 2-CTA clusters
// sharing the weight tile (1 / 0; < 0: the default). false: not served.
int64_t linear_prefill_workspace_bytes(int64_t M, int64_t K);
bool linear_prefill_supported(int64_t M, int64_t G, int64_t Kg, int64_t R);
bool linear_prefill(const void* x, bool x_bf16, int64_t M, int64_t G, int64_t Kg, const uint8_t* w, const void* scale,
                    bool scale_u8, int64_t R, void* out, bool out_f32, void* workspace, int force_bn, int cluster,
                    cudaStream_t stream);

}  // namespace deepfuse
