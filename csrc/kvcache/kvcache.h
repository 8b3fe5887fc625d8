// V4 KV cache kernels: quantise-and-store rows into paged FP8 / bf16 caches and rings,
// indexer key pages, and window row copies (gather, dequantise, ring <-> pages).
// Formats: python/deepfuse/engine/kv_format.py (the single definition).
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace deepfuse {

// Rows (l, t), l < L, t < T, of bf16 kv [L, T, 512] (element strides kv_layer_ld, kv_row_ld;
// row start 16-byte aligned) go to cache layer l (base + l * cache_layer_ld bytes), page /
// row from `index` (int32 or int64):
//   positions == nullptr: slot = index[l * index_layer_ld + t], page = slot / page_size,
//     row = slot % page_size; slot < 0 or page >= num_pages skips the row.
//   positions != nullptr (rings): page = index[t], row = positions[t] % window; index < 0,
//     index >= num_pages or positions < 0 skips the row.
// fp8: 584-byte rows in pages of page_bytes = page_size * 584 (data block, then scales);
// otherwise bf16 rows of 1024 bytes.
void kv_store(const void* kv, int64_t kv_layer_ld, int64_t kv_row_ld, int64_t L, int64_t T,
              void* cache, int64_t cache_layer_ld, int64_t num_pages, int64_t page_bytes,
              int page_size, bool fp8, const void* index, bool index64, int64_t index_layer_ld,
              const void* positions, bool positions64, int window, cudaStream_t stream);

// Indexer keys: bf16 k [L, T, 128] rows to slots (as above, no ring mode).
// kind 0: bf16 rows (256 bytes); 1: e4m3 + fp32 scale amax/448; 2: e4m3 + fp32 power of two.
void indexer_key_store(const void* k, int64_t k_layer_ld, int64_t k_row_ld, int64_t L, int64_t T,
                       void* cache, int64_t cache_layer_ld, int64_t num_pages, int64_t page_bytes,
                       int page_size, int kind, const void* slots, bool slots64,
                       int64_t slots_layer_ld, cudaStream_t stream);

// One side of a window copy: where row j of request b (position pos) lives in layer l.
struct KvSide {
  void* base;
  int64_t layer_ld;    // bytes
  int64_t num_pages;
  int64_t page_bytes;
  int page_size;
  int mode;            // 0 ring: page = index[b], row = pos % window
                       // 1 table: page = index[b * index_ld + pos / page_size], row = pos % page_size
                       // 2 dense: page = b, row = j
  const void* index;   // int32 or int64
  bool index64;
  int64_t index_ld;
  int64_t index_cols;  // table columns (mode 1)
};

enum class KvCopyKind : int { kFp8 = 0, kBf16 = 1, kFp8ToBf16 = 2 };

// For l < L, b < B, j < rows: request b has consumed n = lengths[b] positions; its window is
// positions start = max(n - window, 0) .. n - 1, cnt = n - start rows. Row j < cnt (position
// start + j) is copied src -> dst when both sides locate it (ring/table entry in range and
// >= 0). fill_missing: dst rows not copied (j >= cnt or src missing) are written with zeros
// (dst must then be dense). kFp8ToBf16 dequantises to a dense bf16 [.., rows, 512] side.
void kv_window_copy(const KvSide& src, const KvSide& dst, const void* lengths, bool lengths64,
                    int64_t L, int64_t B, int window, int rows, KvCopyKind kind, bool fill_missing,
                    cudaStream_t stream);

}  // namespace deepfuse
