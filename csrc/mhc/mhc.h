// mHC (manifold-constrained hyper-connections) kernels for n = 4 streams (V4's hc_mult).
// Semantics: deepfuse/ops/mhc.py (the references). No allocation, no sync, graph-capturable.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace deepfuse {

// x [T, 4, d] (bf16 if x_bf16 else fp32, contiguous); fn fp32 [mixes, 4 d]; scale fp32 [3]
// (head: [1]); base fp32 [mixes]. mixes = 24 (pre) or 4 (head).
// pre: -> y [T, d] (x's dtype), post fp32 [T, 4], comb fp32 [T, 4, 4]; head: -> y only.
// part: fp32 workspace of T * hc_mix_splits(T, d) * (mixes + 1) values.
int hc_mix_splits(int64_t T, int d);
void hc_mix(const void* x, bool x_bf16, const float* fn, const float* scale, const float* base, void* y,
            float* post, float* comb, float* part, int64_t T, int d, bool head, float norm_eps, float hc_eps,
            int iters, cudaStream_t stream);

// f [T, d], x [T, 4, d] (both bf16 or both fp32), post [T, 4], comb [T, 4, 4] fp32 -> out [T, 4, d].
void hc_post(const void* f, const void* x, bool bf16, const float* post, const float* comb, void* out, int64_t T,
             int d, cudaStream_t stream);

}  // namespace deepfuse
