// DeepSeek V4.1 Engram kernels: the n-gram hash, the gather + dequantisation of FP8 table rows
// (one UE8M0 exponent per 32 values), both fused, and the gate. Semantics: the references in
// python/deepfuse/ops/engram.py. No allocation, no sync, graph-capturable.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace deepfuse {

enum class EngramOut : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Table rows [R, D] e4m3 (row stride D bytes) and their exponents [R, D / 32] bytes (row
// stride D / 32): device memory, or page-locked host memory through its device pointer (UVA).
// D % 32 == 0; rows 16-byte aligned (the scales need no alignment).
struct EngramTable {
  const uint8_t* rows;
  const uint8_t* scale;
  int64_t R;
  int D;
};

// The hash constants of one layer (hash_only: of L layers, layer-major): multipliers [M],
// primes [C], offsets [C] (int64, contiguous; primes > 0), C = (M - 1) * H.
// ngram [N, M] int32 / int64, row stride ngram_ld (elements), unit column stride.
struct EngramHashArgs {
  const void* ngram;
  bool ngram64;
  int64_t ngram_ld;
  int M;
  int H;
  const int64_t* mult;
  const int64_t* primes;
  const int64_t* offsets;
};

// out [N, L, C] int64 (contiguous): row (i - 1) * H + head = (XOR_{s <= i} ngram[n, s] *
// mult[l, s]) mod primes[l, c] (the non-negative residue) + offsets[l, c]; int64 products wrap.
void engram_hash(const EngramHashArgs& h, int64_t N, int L, int64_t* out, cudaStream_t stream);

// out [N, C, D] (contiguous, `type`): row ids[n * ids_ld + c] of the table, dequantised (value
// times 2^(e - 127), e = 0 -> 2^-127, e = 255 -> inf, in fp32, then rounded to `type`); ids
// outside [0, R) give zero rows. ids int32 / int64.
void engram_lookup(const EngramTable& t, const void* ids, bool ids64, int64_t ids_ld, int64_t N, int C, void* out,
                   EngramOut type, cudaStream_t stream);

// The same rows with the ids hashed in the kernel from ngram (one layer's constants, h.mult
// [M], h.primes / h.offsets [C]): engram_lookup(engram_hash(...)[:, 0]) in one pass.
void engram_embed(const EngramHashArgs& h, int64_t N, const EngramTable& t, void* out, EngramOut type,
                  cudaStream_t stream);

// out [N, n, d] = x + sigmoid(sign(dot) sqrt(max(|dot|, clamp))) v, dot = <x w_h, k w_e>
// rsqrt(mean x^2 + eps) rsqrt(mean k^2 + eps) d^-0.5 per (token, stream); x = hidden [N, n, d],
// k = kv[:, :n], v = kv[:, n] (kv [N, n + 1, d]); all contiguous, same dtype (bf16 / fp32);
// w_hidden / w_embed fp32 [n, d] contiguous. d % 8 == 0. fp32 math.
void engram_gate(const void* hidden, const void* kv, const float* w_hidden, const float* w_embed, void* out,
                 int64_t N, int n, int d, bool bf16, float clamp, float eps, cudaStream_t stream);

}  // namespace deepfuse
