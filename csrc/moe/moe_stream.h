// Decode-path expert GEMMs of moe_experts (csrc/moe/moe_stream.cu): persistent, warp-specialised
// TMA weight streaming with the activation casts fused. Internal to csrc/moe.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "moe/moe.h"

namespace deepfuse {

struct MoeStreamIO {
  const void* x;            // [T, d] bf16 / fp32
  bool x_bf16;
  const int* rows;          // plan: token of each position
  const int* tasks;         // plan: [U, 3] tasks of <= 16 positions (expert, first, end)
  const int* ntasks;        // plan: [0] tasks, [1] 1 if a routed expert spans several tasks
  int64_t U;                // tasks bound
  __nv_bfloat16* h;         // [P, inter]
  float* Y;                 // [P, d]
  const float* wrow;        // [P] routing weight of each position
  int* bcnt;                // balanced partition: [2][nbd] arrivals per CTA boundary, zeroed by the plan (or null)
  float* bpart;             // balanced partition: moe_stream_part_floats(nbd) floats of partial sums
  int nbd;                  // CTA boundaries per GEMM (>= the grid)
};

// Floats of partial sums both GEMMs' balanced partitions need for nbd CTA boundaries.
int64_t moe_stream_part_floats(int nbd);

// GEMM1 (w1 | w3, SwiGLU -> h) and GEMM2 (w2 x routing weight -> Y) for a plan cut into tasks
// of <= 16 rows. false: the shapes are not served (nothing launched); the caller runs the
// grouped kernels.
bool moe_stream_gemms(const MoeProblem& p, const MoeStreamIO& io, cudaStream_t stream);

}  // namespace deepfuse
