// The short-row top-k kernel: one CTA per row, the whole row in registers, an exact radix
// select. (Longer rows: topk_kernel.cuh samples a threshold and buffers candidates.)
//
// A row of at most 2048 16-byte vectors (16K 16-bit or 8K fp32 values; 512 or 1024
// threads, 1 to 4 vectors each: kRowsCfg, topk_plan.cpp) is read once into registers, as keys
// (topk_common.cuh: float order, NaN above +inf; 0 marks "not in the row"). Level 1: a
// 2048-bin shared histogram of the top 11 key bits of every element finds the bucket
// holding the K-th largest key. One pass then splits each thread's elements into bit
// masks: A (bucket above: selected) and C (in the bucket: open). The next levels (16-bit
// keys: the last 5 bits; fp32: 11, then 10) walk only C's set bits: histogram, search,
// then move C's elements above the found digit to A and drop those below. After the last
// level C holds the keys equal to the K-th, T. A block scan of (|A|, |C|) gives every
// thread its slots: A's elements to [0, above) in row order, the krem = K - above of C's
// with the lowest indices after them (sorted: (key, index) pairs in shared memory, then a
// bitonic sort). The scan runs in thread order, which is index order for one vector per
// thread; with V > 1 and more keys == T than krem (ties straddle the K-th: rare for float
// data) a second scan of C's counts per vector ranks them in index order.
// No candidate buffer, no fallback. Cost per phase (tools/probes/topk_probe.cu):
// docs/notes/topk-perf.md, "a short-row kernel".
#pragma once
#include <cstdint>
#include <type_traits>

#include "common/cuda_utils.h"
#include "topk/topk.h"
#include "topk/topk_common.cuh"
#include "topk/topk_config.h"

// Phase-clock hook: tools/probes/topk_probe.cu defines it before including this file; the
// library build compiles it to nothing. TOPK_ROWS_PROBE(i): thread 0 records the clock in slot i.
#ifndef TOPK_ROWS_PROBE
#define TOPK_ROWS_PROBE(i) do {} while (0)
#endif

namespace deepfuse {
namespace {

using namespace topk_detail;

// Bucket b of H[0, NB) with S(b+1) < krem <= S(b), S(b) = sum of the bins >= b (S(0) >= krem
// on entry): returns {b, S(b+1)}. Block-collective, two barriers; H is read before the first.
template <int NT, int NB>
__device__ __forceinline__ uint2 find_bin(RowsShared& sh, const uint32_t* H, uint32_t krem) {
  constexpr int PER = NB >= NT ? NB / NT : 1;  // bins per thread, consecutive
  constexpr int NW = NT / 32;
  static_assert(PER == 1 || PER == 2 || PER == 4, "bins per thread");
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  uint32_t c[PER];
  if constexpr (PER == 4) {
    const uint4 q = reinterpret_cast<const uint4*>(H)[t];
    c[0] = q.x, c[1] = q.y, c[2] = q.z, c[3] = q.w;
  } else if constexpr (PER == 2) {
    const uint2 q = reinterpret_cast<const uint2*>(H)[t];
    c[0] = q.x, c[1] = q.y;
  } else {
    c[0] = t < NB ? H[t] : 0u;
  }
  uint32_t tot = 0;
#pragma unroll
  for (int j = 0; j < PER; ++j) tot += c[j];
  uint32_t suf = tot;  // inclusive suffix sum over this warp's lanes >= this one
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t o = __shfl_down_sync(kFull, suf, off);
    if (lane + off < 32) suf += o;
  }
  if (lane == 0) sh.wsum[warp] = suf;
  __syncthreads();
  uint32_t run = __reduce_add_sync(kFull, lane > warp && lane < NW ? sh.wsum[lane] : 0u) + suf - tot;
#pragma unroll
  for (int j = PER - 1; j >= 0; --j) {
    if (run < krem && run + c[j] >= krem) {
      sh.res_bin = static_cast<uint32_t>(t * PER + j);
      sh.res_above = run;
    }
    run += c[j];
  }
  __syncthreads();
  return make_uint2(sh.res_bin, sh.res_above);
}

// The same for 32 bins, by every warp on its own (no barrier).
__device__ __forceinline__ uint2 find_bin32(const uint32_t* H, uint32_t krem) {
  const int lane = threadIdx.x & 31;
  const uint32_t c = H[lane];
  uint32_t suf = c;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t o = __shfl_down_sync(kFull, suf, off);
    if (lane + off < 32) suf += o;
  }
  const uint32_t above = suf - c;
  const int b = __ffs(__ballot_sync(kFull, above < krem && suf >= krem)) - 1;
  return make_uint2(static_cast<uint32_t>(b), __shfl_sync(kFull, above, b));
}

// Keys of the elements of a 16-byte vector (16-bit: two per word, in place).
template <class F>
__device__ __forceinline__ uint4 keys(const uint4& v) {
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (F::kBits == 16) {
      // Per 16-bit half, no carry between halves (|x| + 0x7FFF <= 0xFFFE): bit 15 of
      // |x| + 0x7FFF is |x| != 0, of |x| + 0x7FFF - kNaNAbove is |x| > kNaNAbove (NaN).
      const uint32_t a = w[i] & 0x7FFF7FFFu;
      const uint32_t negz = ~(a + 0x7FFF7FFFu) & w[i] & 0x80008000u;  // -0.0
      const uint32_t r = w[i] ^ negz;                                   // -0.0 -> +0.0
      const uint32_t flip = ((r >> 15) & 0x00010001u) * 0x7FFFu | 0x80008000u;
      const uint32_t nan = ((a + (0x7FFFu - F::kNaNAbove) * 0x00010001u) >> 15 & 0x00010001u) * 0xFFFFu;
      w[i] = (r ^ flip) | nan;
    } else {
      w[i] = F::key(w[i]);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// v with its elements from n on (0 < n < VEC) set to 0.
template <int VEC>
__device__ __forceinline__ uint4 keep_first(const uint4& v, int n) {
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (VEC == 8) {
      w[i] &= (2 * i + 1 < n ? 0xFFFF0000u : 0u) | (2 * i < n ? 0xFFFFu : 0u);
    } else {
      w[i] = i < n ? w[i] : 0u;
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ int ctz(uint32_t m) { return __ffs(static_cast<int>(m)) - 1; }

template <int FMT, int NT, int V>
__global__ void __launch_bounds__(NT, 1) topk_rows_kernel(const TopkArgs P) {
  using F = Fmt<FMT>;
  using Raw = typename F::Raw;
  constexpr int VEC = 16 / sizeof(Raw);
  constexpr int KB = F::kBits;
  constexpr int EPT = V * VEC;  // elements per thread: one bit each in a mask
  static_assert(EPT <= 32, "elements per thread");
  static_assert((F::kKeyNegInf >> (KB - 11)) > 0, "real keys never fall in level 1's bin 0");
  using Mask = uint32_t;
  extern __shared__ __align__(16) unsigned char smem[];
  RowsShared& sh = *reinterpret_cast<RowsShared*>(smem);
  unsigned long long* sel = reinterpret_cast<unsigned long long*>(smem + sizeof(RowsShared));
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x;
  const Raw* p = static_cast<const Raw*>(P.x) + row * P.ld;
  const int L = P.lengths ? min(max(P.lengths[row], 0), P.N) : P.N;
  const int K = min(P.k, L);
  TOPK_ROWS_PROBE(0);

  // Vector j of this thread holds elements [(tid + j * NT) * VEC, + VEC): in bounds when it
  // starts below L (N is a multiple of VEC). Held as keys; 0 (no real key) past L.
  uint4 v[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int e0 = (tid + j * NT) * VEC;
    v[j] = e0 < L ? ld_stream(p + e0) : make_uint4(0u, 0u, 0u, 0u);
  }
  uint4* h4 = reinterpret_cast<uint4*>(&sh.h[0][0]);
  for (int i = tid; i < 2 * kRowBins / 4; i += NT) h4[i] = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int e0 = (tid + j * NT) * VEC;
    if (e0 < L) {
      v[j] = keys<F>(v[j]);
      if (e0 + VEC > L) v[j] = keep_first<VEC>(v[j], L - e0);
    }
  }
  __syncthreads();
  TOPK_ROWS_PROBE(1);

  // Element q in [0, V * VEC) of this thread: vector q / VEC, lane q % VEC. Compile-time q
  // (every element, unrolled) or run-time q (set bits of a mask; selects, no local memory).
  auto key_dyn = [&](int q) {
    uint4 w = v[0];
#pragma unroll
    for (int j = 1; j < V; ++j) w = q / VEC == j ? v[j] : w;
    return elem_dyn<VEC>(w, q % VEC);
  };
  auto index_of = [&](int q) { return (tid + q / VEC * NT) * VEC + q % VEC; };

  // A: this thread's elements selected for sure; C: those in the bucket still open (keys
  // whose digits so far equal the K-th key's). After the last level C holds keys == T.
  Mask A = 0, C = 0;
  uint32_t above = 0, krem = 0;  // keys above the open bucket; slots left for it
  if (L <= P.k) {  // every element (key 0 marks none)
#pragma unroll
    for (int q = 0; q < EPT; ++q) A |= static_cast<Mask>(elem<VEC>(v[q / VEC], q % VEC) != 0u) << q;
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if ((tid + j * NT) * VEC < L) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          // Key 0 (past L: at most VEC - 1 elements) lands in bin 0, which the search never
          // picks: the L > K real keys lie in bins >= key(-inf) >> (KB - 11) > 0.
          atomicAdd(&sh.h[0][elem<VEC>(v[j], i) >> (KB - 11)], 1u);
        }
      }
    }
    __syncthreads();
    TOPK_ROWS_PROBE(2);
    const uint2 r = find_bin<NT, kRowBins>(sh, sh.h[0], static_cast<uint32_t>(K));
    TOPK_ROWS_PROBE(3);
    above = r.y;
#pragma unroll
    for (int q = 0; q < EPT; ++q) {
      const uint32_t d = elem<VEC>(v[q / VEC], q % VEC) >> (KB - 11);
      A |= static_cast<Mask>(d > r.x) << q;
      C |= static_cast<Mask>(d == r.x) << q;
    }
    TOPK_ROWS_PROBE(7);
    // Next level: digit (key >> shift) & (NB - 1) of the open bucket's keys.
    auto level = [&](auto nb, int shift, uint32_t* H) {
      constexpr int NB = decltype(nb)::value;
      for (Mask m = C; m; m &= m - 1)
        atomicAdd(&H[(key_dyn(ctz(m)) >> shift) & (NB - 1)], 1u);
      TOPK_ROWS_PROBE(8);
      __syncthreads();
      TOPK_ROWS_PROBE(9);
      uint2 b;
      if constexpr (NB == 32) {
        b = find_bin32(H, static_cast<uint32_t>(K) - above);
      } else {
        b = find_bin<NT, NB>(sh, H, static_cast<uint32_t>(K) - above);
      }
      above += b.y;
      TOPK_ROWS_PROBE(10);
      for (Mask m = C; m; m &= m - 1) {
        const int q = ctz(m);
        const uint32_t d = (key_dyn(q) >> shift) & (NB - 1);
        if (d != b.x) C &= ~(Mask{1} << q);
        if (d > b.x) A |= Mask{1} << q;
      }
    };
    if constexpr (KB == 16) {
      level(std::integral_constant<int, 32>{}, 0, sh.h[1]);
    } else {
      // h[0] was read before find_bin's first barrier: cleared for level 3.
      for (int i = tid; i < kRowBins / 4; i += NT) h4[i] = make_uint4(0u, 0u, 0u, 0u);
      level(std::integral_constant<int, kRowBins>{}, 10, sh.h[1]);
      level(std::integral_constant<int, 1024>{}, 0, sh.h[0]);
    }
    krem = static_cast<uint32_t>(K) - above;
  }
  TOPK_ROWS_PROBE(4);

  // Slots: a block exclusive scan of |A| << 16 | |C| in thread order (the high half sums to
  // <= K, the low half to <= L < 2^16): keys above T to [0, above) in row order, the first
  // krem of those equal to T to [above, K).
  const uint32_t cnt = static_cast<uint32_t>(__popc(A)) << 16 | static_cast<uint32_t>(__popc(C));
  const int lane = tid & 31, warp = tid >> 5;
  uint32_t inc = cnt;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t o = __shfl_up_sync(kFull, inc, off);
    if (lane >= off) inc += o;
  }
  if (lane == 31) sh.wsum[warp] = inc;  // the last find_bin read wsum before its 2nd barrier
  __syncthreads();
  const uint32_t ws = lane < NT / 32 ? sh.wsum[lane] : 0u;
  const uint32_t base = __reduce_add_sync(kFull, lane < warp ? ws : 0u) + inc - cnt;
  uint32_t gpos = base >> 16, qpos = base & 0xFFFFu;
  // Keys == T of vector j of this thread: slots from qv[j] (after the thread's earlier
  // vectors; with V = 1 thread order is index order).
  auto cnt_vec = [&](int j) { return static_cast<uint32_t>(__popc((C >> (j * VEC)) & ((Mask{1} << VEC) - 1u))); };
  uint32_t qv[V];
#pragma unroll
  for (int j = 0; j < V; ++j) qv[j] = j ? qv[j - 1] + cnt_vec(j - 1) : qpos;
  if constexpr (V > 1) {
    // Block-uniform: more keys == T than slots for them (every C is empty when L <= k).
    if ((__reduce_add_sync(kFull, ws) & 0xFFFFu) > krem) {
      // Index order is (vector j, thread, lane): a scan of per-vector counts (16 bits each,
      // <= NT * VEC <= 8192) in thread order; vector j's keys follow all of vectors < j.
      unsigned long long c64 = 0;
#pragma unroll
      for (int j = 0; j < V; ++j) c64 |= static_cast<unsigned long long>(cnt_vec(j)) << (16 * j);
      unsigned long long inc64 = c64;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const unsigned long long o2 = __shfl_up_sync(kFull, inc64, off);
        if (lane >= off) inc64 += o2;
      }
      if (lane == 31) sh.wsum64[warp] = inc64;
      __syncthreads();
      // Sums over the warps, 32 bits (two fields) at a time: no carry between fields.
      const unsigned long long x = lane < NT / 32 ? sh.wsum64[lane] : 0ull;
      const uint32_t xl = static_cast<uint32_t>(x), xh = static_cast<uint32_t>(x >> 32);
      unsigned long long before = __reduce_add_sync(kFull, lane < warp ? xl : 0u);
      unsigned long long total = __reduce_add_sync(kFull, xl);
      if constexpr (V > 2) {
        before |= static_cast<unsigned long long>(__reduce_add_sync(kFull, lane < warp ? xh : 0u)) << 32;
        total |= static_cast<unsigned long long>(__reduce_add_sync(kFull, xh)) << 32;
      }
      const unsigned long long excl = before + inc64 - c64;
      uint32_t prior = 0;  // keys == T in vectors < j of every thread
#pragma unroll
      for (int j = 0; j < V; ++j) {
        qv[j] = prior + static_cast<uint32_t>((excl >> (16 * j)) & 0xFFFFu);
        prior += static_cast<uint32_t>((total >> (16 * j)) & 0xFFFFu);
      }
    }
  }
  TOPK_ROWS_PROBE(5);

  Out<F> o;
  o.values = P.values ? static_cast<Raw*>(P.values) + row * P.k : nullptr;
  o.indices = P.idx64 ? static_cast<void*>(static_cast<int64_t*>(P.indices) + row * P.k)
                      : static_cast<void*>(static_cast<int32_t*>(P.indices) + row * P.k);
  o.sel = sel;
  o.map = P.slot_map ? P.slot_map + (P.map_rows ? __ldg(P.map_rows + row) : int64_t(row)) * P.map_ld : nullptr;
  o.idx64 = P.idx64 != 0;
  o.sorted = P.sorted != 0;
  // A NaN's key drops its payload, a zero's its sign: their bits are read again.
  auto put = [&](uint32_t pos, int q) {
    const uint32_t key = key_dyn(q);
    const int e = index_of(q);
    const uint32_t raw = !o.values ? 0u
                         : (key == F::kKeyNaN || key == F::kKeyZero ? static_cast<uint32_t>(__ldg(p + e))
                                                                     : F::raw(key));
    o.emit(pos, e, raw, key);
  };
  for (Mask m = A; m; m &= m - 1) put(gpos++, ctz(m));
#pragma unroll
  for (int j = 0; j < V; ++j) {
    uint32_t pos = qv[j];
    for (Mask m = (C >> (j * VEC)) & ((Mask{1} << VEC) - 1u); m && pos < krem; m &= m - 1)
      put(above + pos++, j * VEC + ctz(m));
  }
  TOPK_ROWS_PROBE(6);
  finish_row<F, NT>(o, sel, p, K, P.k);
}

template <int FMT, int NT, int V>
void rows_attr() {
  check_cuda(cudaFuncSetAttribute(topk_rows_kernel<FMT, NT, V>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(sizeof(RowsShared)) + kTopkMaxK * 8),
             "topk: cudaFuncSetAttribute");
}

template <int FMT>
void rows_attrs() {
  rows_attr<FMT, 512, 1>();
  rows_attr<FMT, 512, 2>();
  rows_attr<FMT, 512, 4>();
  rows_attr<FMT, 1024, 1>();
  rows_attr<FMT, 1024, 2>();
}

// Opts every variant of the short-row kernel into large dynamic shared memory (current device).
inline void set_rows_attributes() {
  rows_attrs<0>();
  rows_attrs<1>();
  rows_attrs<2>();
}

template <int FMT>
void rows_launch(const TopkArgs& P, int64_t B, const TopkPlan& plan, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(B)), block(static_cast<unsigned>(plan.threads));
  const int smem = plan.smem_bytes;
  if (plan.threads == 512 && plan.vecs == 1) {
    topk_rows_kernel<FMT, 512, 1><<<grid, block, smem, stream>>>(P);
  } else if (plan.threads == 512 && plan.vecs == 2) {
    topk_rows_kernel<FMT, 512, 2><<<grid, block, smem, stream>>>(P);
  } else if (plan.threads == 512 && plan.vecs == 4) {
    topk_rows_kernel<FMT, 512, 4><<<grid, block, smem, stream>>>(P);
  } else if (plan.threads == 1024 && plan.vecs == 1) {
    topk_rows_kernel<FMT, 1024, 1><<<grid, block, smem, stream>>>(P);
  } else if (plan.threads == 1024 && plan.vecs == 2) {
    topk_rows_kernel<FMT, 1024, 2><<<grid, block, smem, stream>>>(P);
  } else {
    throw std::runtime_error("deepfuse: topk: no short-row kernel for the plan");
  }
  check_launch("topk_rows");
}

// The short-row kernel (plan.kernel == 1) over B rows of `a` (attributes set).
inline void launch_rows(const TopkArgs& a, TopkDtype dtype, int64_t B, const TopkPlan& plan, cudaStream_t stream) {
  switch (dtype) {
    case TopkDtype::kBf16: rows_launch<0>(a, B, plan, stream); break;
    case TopkDtype::kF16: rows_launch<1>(a, B, plan, stream); break;
    default: rows_launch<2>(a, B, plan, stream); break;
  }
}

}  // namespace
}  // namespace deepfuse
