// The V4 compressor's step (rows.h: compress_store, state_store). One warp per compressed
// row: the softmax-gated pooling of its sources (online softmax per dimension, fp32), then
// the row epilogue of rows.cuh (RMSNorm, RoPE, the cache store).
#include "common/cuda_utils.h"
#include "norm/rows.cuh"

namespace deepfuse {
namespace {

constexpr int kWarps = 4;

template <typename P>
__device__ __forceinline__ P* bcast(P* p, int lane) {
  return reinterpret_cast<P*>(__shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(p), lane));
}

template <int CPL>
__global__ void __launch_bounds__(kWarps * 32) compress_kernel(const CompressArgs a, const RowStoreArgs s) {
  const int lane = threadIdx.x & 31;
  const int64_t b = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (b >= a.nb) return;
  const int D = a.D, w = a.overlap ? 2 * D : D;
  const auto* kv = static_cast<const __nv_bfloat16*>(a.kv);
  const auto* sc = static_cast<const __nv_bfloat16*>(a.score);
  const auto* skv = static_cast<const __nv_bfloat16*>(a.state_kv);
  const auto* ssc = static_cast<const __nv_bfloat16*>(a.state_score);
  const int64_t slot = s.kind != RowStore::kNone ? __ldg(s.slots + b) : -1;
  float m[CPL][8], sum[CPL][8], acc[CPL][8];
#pragma unroll
  for (int i = 0; i < CPL; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) m[i][j] = -INFINITY, sum[i][j] = 0.0f, acc[i][j] = 0.0f;
  for (int l0 = 0; l0 < a.L; l0 += 32) {
    // lane k resolves source l0 + k once; the warp then walks the sources.
    const int li = l0 + lane;
    const __nv_bfloat16* pk = nullptr;
    const __nv_bfloat16* ps = nullptr;
    const float* pa = nullptr;
    if (li < a.L) {
      const int64_t o = b * a.L + li;
      const int col = (a.overlap && li >= a.r) ? D : 0;
      if (a.src_valid[o]) {
        if (a.src_is_fresh[o]) {
          const int64_t t = __ldg(a.src_fresh + o);
          pk = kv + t * a.ld + col;
          ps = sc + t * a.ld + col;
        } else {
          const int64_t t = __ldg(a.src_state + o);
          pk = skv + t * a.state_ld + col;
          ps = ssc + t * a.state_ld + col;
        }
        pa = a.ape + __ldg(a.src_ape + o) * w + col;
      }
    }
    const int n = min(32, a.L - l0);
    for (int k = 0; k < n; ++k) {
      const __nv_bfloat16* k_kv = bcast(pk, k);
      if (k_kv == nullptr) continue;  // warp-uniform: an invalid source
      const __nv_bfloat16* k_sc = bcast(ps, k);
      const float* k_ap = bcast(pa, k);
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        const int c = lane + 32 * i;
        if (c * 8 >= D) continue;
        float x[8], g[8], e[8];
        load8(k_kv + 8 * c, x);
        load8(k_sc + 8 * c, g);
        load8(k_ap + 8 * c, e);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float lg = g[j] + e[j];
          const float mn = fmaxf(m[i][j], lg);
          const float keep = expf(m[i][j] - mn), p = expf(lg - mn);
          sum[i][j] = sum[i][j] * keep + p;
          acc[i][j] = acc[i][j] * keep + p * x[j];
          m[i][j] = mn;
        }
      }
    }
  }
  rows::WarpRow<CPL> r;
#pragma unroll
  for (int i = 0; i < CPL; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) r.v[i][j] = (lane + 32 * i) * 8 < D ? rows::bf16_round(acc[i][j] / sum[i][j]) : 0.0f;
  rows::rms_norm(r, a.norm_weight, a.eps, D, lane);
  if (a.cos != nullptr) rows::rope(r, a.cos + b * a.half, a.sin + b * a.half, a.half, false, D, lane);
  if (a.y != nullptr) rows::store_row_bf16(r, static_cast<__nv_bfloat16*>(a.y) + b * D, D, lane);
  rows::store(r, s, slot, D, lane);
}

__global__ void __launch_bounds__(kWarps * 32) state_store_kernel(const __nv_bfloat16* kv, const __nv_bfloat16* sc,
                                                                  int64_t ld, int64_t N, int w, __nv_bfloat16* skv,
                                                                  __nv_bfloat16* ssc, int64_t state_ld,
                                                                  const int64_t* slots) {
  const int lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= N) return;
  const int64_t slot = __ldg(slots + t);
  if (slot < 0) return;
  for (int c = lane; c * 8 < w; c += 32) {
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(kv + t * ld) + c);
    const uint4 g = __ldg(reinterpret_cast<const uint4*>(sc + t * ld) + c);
    reinterpret_cast<uint4*>(skv + slot * state_ld)[c] = a;
    reinterpret_cast<uint4*>(ssc + slot * state_ld)[c] = g;
  }
}

}  // namespace

bool compress_fits(int D) { return D > 0 && D % 8 == 0 && D <= 512; }

void compress_store(const CompressArgs& a, const RowStoreArgs& store, cudaStream_t stream) {
  if (a.nb <= 0) return;
  if (!compress_fits(a.D)) throw std::invalid_argument("deepfuse: compress_store: D must be a multiple of 8, <= 512");
  if (store.kind == RowStore::kKvFp8 && a.D != 512) throw std::invalid_argument("deepfuse: compress_store: KV rows need D 512");
  if ((store.kind == RowStore::kIdxFp8 || store.kind == RowStore::kIdxFp8Ue8m0) && a.D != 128)
    throw std::invalid_argument("deepfuse: compress_store: indexer keys need D 128");
  const unsigned blocks = static_cast<unsigned>(ceil_div<int64_t>(a.nb, kWarps));
  if (a.D <= 256) {
    compress_kernel<1><<<blocks, kWarps * 32, 0, stream>>>(a, store);
  } else {
    compress_kernel<2><<<blocks, kWarps * 32, 0, stream>>>(a, store);
  }
  check_launch("compress_kernel");
}

void state_store(const void* kv, const void* score, int64_t ld, int64_t N, int w, void* state_kv, void* state_score,
                 int64_t state_ld, const int64_t* state_slots, cudaStream_t stream) {
  if (N <= 0) return;
  const unsigned blocks = static_cast<unsigned>(ceil_div<int64_t>(N, kWarps));
  state_store_kernel<<<blocks, kWarps * 32, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(kv), static_cast<const __nv_bfloat16*>(score), ld, N, w,
      static_cast<__nv_bfloat16*>(state_kv), static_cast<__nv_bfloat16*>(state_score), state_ld, state_slots);
  check_launch("state_store_kernel");
}

}  // namespace deepfuse
