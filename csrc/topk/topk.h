// Row-wise top-k (radix select over order-preserving keys). Semantics: deepfuse/ops/topk.py.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace deepfuse {

enum class TopkDtype : int { kBf16 = 0, kF16 = 1, kF32 = 2 };

constexpr int kTopkMaxK = 4096;

// x: [B, N] rows `ld` elements apart, last dim contiguous, element-aligned; N < 2^31.
// lengths: int32 [B] or null (row b considers x[b, :clamp(lengths[b], 0, N)]).
// values: [B, k] of x's dtype, contiguous, or null (not written).
// indices: [B, k] contiguous, int64 if idx64 else int32. 1 <= k <= 4096.
// Slots [min(k, L_b), k) of a row get index -1 and value -inf. sorted: descending values.
// Launches one kernel on `stream`; no allocation, no synchronisation.
// slot_map (optional, needs idx64): row b's indices are written as the slots
// slot_map[m * map_ld + index] with m = map_rows[b] (map_rows null: m = b); padding stays -1.
void topk(const void* x, TopkDtype dtype, int64_t B, int64_t N, int64_t ld, int k,
          const int32_t* lengths, void* values, void* indices, bool idx64, bool sorted,
          cudaStream_t stream, const int64_t* slot_map = nullptr, int64_t map_ld = 0,
          const int64_t* map_rows = nullptr);

// The launch plan topk() uses (for tests and benchmarks): CTAs per row (a thread-block
// cluster when > 1), threads per CTA, the dynamic shared memory per CTA in bytes, and the
// kernel: 0 the general one (topk.cu), 1 the short-row one (topk_rows.cu). aligned: rows
// start on 16 bytes (x and ld), as for a contiguous tensor.
struct TopkPlan {
  int ctas_per_row;
  int threads;
  int smem_bytes;
  int kernel;
};
TopkPlan topk_plan(TopkDtype dtype, int64_t B, int64_t N, int k, bool sorted, bool aligned = true);

// Testing hook: overrides the general kernel's threshold margin z (standard deviations; see
// topk.cu) for later calls in this process; NaN restores the policy. A negative z sends most
// rows of sampled shapes through the fallback (see refilter in topk.cu).
void topk_set_margin(float z);

// topk()'s arguments as the kernels take them: the short-row kernel's parameters, extended
// by the general kernel's (topk.cu's Params).
struct TopkArgs {
  const void* x;
  int64_t ld;
  const int32_t* lengths;
  void* values;
  void* indices;
  int N, k, idx64, sorted;
  const int64_t* slot_map = nullptr;
  int64_t map_ld = 0;
  const int64_t* map_rows = nullptr;
};

// Short rows (topk_rows.cu), used by topk(): whether a shape fits when rows are aligned,
// its plan, the launch (same contract as topk()), and the one-time kernel attributes.
bool topk_rows_fits(TopkDtype dtype, int64_t B, int64_t N);
TopkPlan topk_rows_plan(TopkDtype dtype, int64_t B, int64_t N, int k, bool sorted);
void topk_rows(const TopkArgs& a, TopkDtype dtype, int64_t B, cudaStream_t stream);
void topk_rows_set_attributes();

}  // namespace deepfuse
