// Lightning-indexer logits over the paged FP8 indexer keys (V4 CSA layers).
// Semantics: deepfuse/ops/indexer.py (indexer_logits_paged_ref). No allocation, no sync.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace deepfuse {

constexpr int kIndexerHeads = 64;
constexpr int kIndexerDim = 128;

// q bf16 [N, H, 128] (contiguous, H 32 or 64), weights fp32 [N, H]; key pages of one layer in the
// FP8 indexer-key format (page_bytes = page_size * 132); entry e of token t's request is the
// key at slot entry_slots[token_req[t] * slots_ld + e]. out fp32 [N, C] (row stride C):
// out[t, e] = scale * s_e * sum_h w[t, h] relu(q[t, h] . code_e) for e < min(n_vis[t], C)
// (s_e, code_e: the key's scale and e4m3 codes; an entry with slot < 0 scores 0), -inf
// beyond. q per (token, head): a power-of-two scale s with amax / s in [128, 256), x = q / s as
// q_terms e4m3 terms (1: e4m3(x), DeepGEMM's contract; 2: H 64 hi + lo along K, exact for
// |x| >= 2^-2, within 2^-10 s below; H 32 hi + lo / 16, exact for |x| >= 2^-6),
// FP8 tensor-core dot products (sm_90a: indexer_logits_wgmma.cu). Other archs: mma.sync on q
// rounded to fp16 (H 64, q_terms 2 only).
// num_reqs (the rows of entry_slots) only picks how many consecutive tokens a CTA takes
// (indexer_rows_per_cta): tokens of one request share each key tile they read; the results do
// not depend on it (each token's sums run in one fixed order).
void indexer_logits_paged(const void* q, int H, int q_terms, const float* weights, const uint8_t* pages,
                          int64_t page_bytes, int64_t num_pages, int page_size, const int64_t* entry_slots,
                          int64_t slots_ld, int64_t num_reqs, const int64_t* token_req, const int32_t* n_vis,
                          int64_t N, int C, float scale, float* out, cudaStream_t stream);

// The sm_90a kernel (FP8 wgmma) of indexer_logits_paged.
void indexer_logits_paged_wgmma(const void* q, int H, int q_terms, const float* weights, const uint8_t* pages,
                                int64_t page_bytes, int64_t num_pages, int page_size, const int64_t* entry_slots,
                                int64_t slots_ld, int64_t num_reqs, const int64_t* token_req, const int32_t* n_vis,
                                int64_t N, int C, float scale, float* out, cudaStream_t stream);

// Tokens per CTA (1..4) for N tokens over num_reqs requests, from the shapes alone: 1 below two
// tokens per request; for N / num_reqs = n tokens each (decode with drafts), the largest of 4, 3,
// 2 that divides n, else 4; 4 when N is no multiple of num_reqs (prefill chunks).
int indexer_rows_per_cta(int64_t N, int64_t num_reqs);

}  // namespace deepfuse
