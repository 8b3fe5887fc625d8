// Row epilogues of the V4 layer: RMSNorm, RoPE and the store of a row into the engine's
// caches (deepfuse/kv_format.py), alone or fused. Semantics: deepfuse/ops/norm.py, rope.py,
// kvcache.py, compressor.py (the references). No allocation, no sync, graph-capturable.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace deepfuse {

// Where a finished row goes besides (or instead of) a dense bf16 output.
enum class RowStore : int {
  kNone = 0,
  kKvFp8 = 1,      // KV row format (D = 512, RoPE 64): 448 e4m3 + 64 bf16, 7 UE8M0 scales
  kIdxFp8 = 2,     // indexer key format (D = 128): 128 e4m3 + fp32 scale amax / 448
  kIdxFp8Ue8m0 = 3,// indexer key format with a power-of-two scale
  kDense = 4,      // bf16 [pages, page_size, D] rows
};

// One layer's pages: row `slot` = page slot / page_size, row slot % page_size; slots < 0
// or beyond the pages are skipped.
struct RowStoreArgs {
  RowStore kind = RowStore::kNone;
  uint8_t* pages = nullptr;
  int64_t page_bytes = 0;  // bytes per page (dense: page_size * D * 2)
  int64_t num_pages = 0;
  int page_size = 0;
  const int64_t* slots = nullptr;  // one per stored row
};

// Rows of x [rows, D] bf16 (row stride x_ld); token of row i = i / H (cos, sin: fp32
// [tokens, half], contiguous; null: no RoPE). norm: y = rms_norm(x, weight) first (weight
// fp32 [D] or null), rounded to bf16; then the RoPE on the last 2 * half dims, rounded to
// bf16. y [rows, D] bf16 (contiguous) or null; store: rows need H == 1 (slot per token).
// D % 8 == 0, D <= 16384 (D > 4096: one block per row, no store), half * 2 <= D,
// (D - 2 * half) even.
bool norm_rope_fits(int D);
void norm_rope(const void* x, int64_t x_ld, int64_t rows, int H, int D, void* y, bool norm, const float* weight,
               float eps, const float* cos, const float* sin, int half, bool inverse, const RowStoreArgs& store,
               cudaStream_t stream);

// The V4 compressor's step (models/compressor.py): rows b < nb pool L source rows with a
// per-dimension softmax. Source l of row b is token src_fresh[b, l] of this step (kv / score
// [N, w] bf16) if src_is_fresh[b, l], else row src_state[b, l] of the state rings (state_kv /
// state_score [*, w] bf16); weight logits score + ape[src_ape[b, l]] (ape fp32 [r, w]);
// invalid sources (src_valid false) are left out. overlap: L = 2r, sources l < r read columns
// [0, D), the others [D, 2D) (w = 2D); else w = D, columns [0, D). The pooled row (bf16) is
// RMS-normalised with norm_weight, RoPE'd with cos/sin [nb, half] and stored at slots
// (store.slots [nb]); y [nb, D] (optional) receives it too. D in {128, 512} (or D <= 512,
// D % 8 == 0, for dense stores).
struct CompressArgs {
  const void* kv;
  const void* score;
  int64_t ld;  // row stride of kv / score (elements)
  const void* state_kv;
  const void* state_score;
  int64_t state_ld;
  const float* ape;
  const int64_t* src_fresh;
  const int64_t* src_state;
  const int64_t* src_ape;
  const bool* src_is_fresh;
  const bool* src_valid;
  int64_t nb;
  int L, r, D;
  bool overlap;
  const float* norm_weight;
  float eps;
  const float* cos;
  const float* sin;
  int half;
  void* y;
};
bool compress_fits(int D);
void compress_store(const CompressArgs& a, const RowStoreArgs& store, cudaStream_t stream);

// State rings: rows state_slots[t] (>= 0) of state_kv / state_score [*, w] get kv[t] /
// score[t] (bf16 [N, w], row stride ld). w % 8 == 0.
void state_store(const void* kv, const void* score, int64_t ld, int64_t N, int w, void* state_kv,
                 void* state_score, int64_t state_ld, const int64_t* state_slots, cudaStream_t stream);

}  // namespace deepfuse
