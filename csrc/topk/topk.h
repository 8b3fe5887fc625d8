// Row-wise top-k (radix select over order-preserving keys): the host API. Semantics:
// deepfuse/ops/topk.py. Typed launcher: api.cpp; plan: topk_plan.cpp; kernels:
// topk_kernel.cuh (general) and topk_rows_kernel.cuh (short rows), launched by topk.cu and
// topk_rows.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace deepfuse {

enum class TopkDtype : int { kBf16 = 0, kF16 = 1, kF32 = 2 };

constexpr int kTopkMaxK = 4096;

// A call's arguments as the kernels take them (the short-row kernel's parameters; the
// general kernel's extend them).
// x: [B, N] rows `ld` elements apart, last dim contiguous, element-aligned; N < 2^31.
// lengths: int32 [B] or null (row b considers x[b, :clamp(lengths[b], 0, N)]).
// values: [B, k] of x's dtype, contiguous, or null (not written).
// indices: [B, k] contiguous, int64 if idx64 else int32. 1 <= k <= 4096.
// Slots [min(k, L_b), k) of a row get index -1 and value -inf. sorted: descending values.
// slot_map (optional, needs idx64): row b's indices are written as the slots
// slot_map[m * map_ld + index] with m = map_rows[b] (map_rows null: m = b); padding stays -1.
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

// How topk() runs a shape: the kernel (0: the general one, 1: the short-row one), CTAs per
// row (a thread-block cluster when > 1), threads per CTA, dynamic shared memory per CTA in
// bytes, 16-byte vectors per thread (short rows) or per thread and streaming round
// (general), and for the general kernel its candidate buffer entries and threshold margin
// (standard deviations of the sampled count; a negative margin sends most rows of sampled
// shapes through the fallback: tests set it).
struct TopkPlan {
  int ctas_per_row;
  int threads;
  int smem_bytes;
  int kernel;
  int vecs;
  int buffer;
  float margin;
};

// The plan for a shape on a device with `sms` multiprocessors. aligned: rows start on 16
// bytes (x and ld), as for a contiguous tensor (the short-row kernel needs it).
TopkPlan topk_plan(TopkDtype dtype, int64_t B, int64_t N, int k, bool sorted, int sms, bool aligned = true);

// Runs `plan` (from topk_plan for these arguments and the current device; the margin may be
// changed) on `stream`: one kernel, no allocation, no synchronisation.
void topk(const TopkArgs& a, TopkDtype dtype, int64_t B, const TopkPlan& plan, cudaStream_t stream);

}  // namespace deepfuse
