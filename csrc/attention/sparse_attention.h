// V4 sparse attention over paged KV (deepfuse/ops/attention.py defines the semantics):
// host API. Device code: sparse_attn_sm90_bf16.cuh (kernels), sparse_attn_sm90_bf16.cu
// (instantiations + launch); host policy (splits, groups): sparse_attn_plan.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace deepfuse {

// One key source: paged rows, FP8 (584-byte V4 rows, kv_format.py) or bf16 [page, 512].
struct AttnSource {
  const uint8_t* base = nullptr;  // page 0
  int64_t num_slots = 0;          // pages * page_size; slots >= this are skipped
  int64_t page_bytes = 0;         // page stride in bytes
  int page_size = 0;
  int fp8 = 0;                    // 1: FP8 rows, 0: bf16 rows
  const void* idx = nullptr;      // [T, K] slots (row stride K), int32 or int64
  int idx64 = 0;
  int K = 0;                      // index columns (0: source absent)
  const void* len = nullptr;      // [T] or null: only idx[t, :len[t]] count
  int len64 = 0;
};

struct AttnParams {
  const void* q = nullptr;  // bf16 [T, H, 512], rows (t, h) at q + t * q_ld_t + h * q_ld_h
  int64_t q_ld_t = 0, q_ld_h = 0;  // element strides
  int T = 0, H = 0;
  AttnSource src[2];
  const float* sink = nullptr;  // [H]
  float scale_log2 = 0.f;       // softmax scale * log2(e)
  const float* cos = nullptr;   // [T, rope_pairs] (inverse RoPE on the last 2 * rope_pairs dims)
  const float* sin = nullptr;
  int rope_pairs = 0;
  int mxfp8 = 0;                // 0: bf16 out [T, H, 512]; 1: e4m3 [T, H*512] + UE8M0 [T, H*16]
  void* out = nullptr;
  uint8_t* out_scale = nullptr;
  float* lse = nullptr;         // [T, H]
  int G = 1;                    // query rows per group (consecutive rows sharing key loads)
  int splits = 1;               // split-KV parts; > 1 needs the workspace
  float* ws_o = nullptr;        // [splits, T, H, 512] unnormalised partial outputs
  float* ws_ml = nullptr;       // [splits, T, H, 2] (running max in log2 units, sum)
};

// The launch policy (host only, no device work): splits for a call shape.
struct AttnPlan {
  int G, splits, ctas, blocks;
};
AttnPlan sparse_attention_plan(int T, int H, int K_total, int G);

// Workspace floats needed for a plan (0 when splits == 1).
int64_t sparse_attention_workspace_floats(int T, int H, int splits);

// The warp-specialised wgmma kernel (sparse_decode_sm90.cu): covers G == 1, H 64 / 128, FP8
// (or absent) sources; used when enabled: on by default (GPU tests + memcheck on the H200,
// 2026-12-03); DEEPFUSE_SPARSE_DECODE=0 / 1 overrides the default.
constexpr bool kSparseDecodeDefault = true;
bool sparse_decode_covers(const AttnParams& p);
bool sparse_decode_enabled();
// Launches the main kernel; true when it also reduced the split-KV partials (in a cluster of the
// splits: no combine launch; DEEPFUSE_SPARSE_DECODE_REDUCE=1, sparse_decode_sm90.cu).
bool sparse_decode_launch(const AttnParams& p, cudaStream_t stream);
bool sparse_decode_reduce_enabled(const AttnParams& p);

// Launches the attention (and the split-KV combine when splits > 1). No sync, no allocation.
void sparse_attention_paged(const AttnParams& p, cudaStream_t stream);

}  // namespace deepfuse
