// Row-wise top-k: radix select over order-preserving unsigned keys.
//
// Keys: a float's bits become an unsigned integer of the same width whose order is the
// float order (negative: all bits flipped; non-negative: sign bit set). Every NaN maps to
// the all-ones key, above +inf. bf16/fp16 give 16-bit keys, fp32 32-bit keys.
//
// Work split: a row is handled by G CTAs (G in {1, 2, 4, 8}); for G > 1 they form a
// thread-block cluster and exchange histograms through distributed shared memory (DSMEM).
// G grows until B * G fills the GPU (small B, long rows: the whole GPU reads each row
// once) and until each CTA's part of the row fits in its shared memory ("staged": read
// from HBM once, every later pass runs on shared memory). Rows too long to stage at
// G = 8 are re-read from global memory (L2) on every pass.
//
// Select, per row, K = min(k, L) with L the row's length. Digits of 11+5 (16-bit keys) or
// 11+11+10 bits (32-bit keys), most significant first:
//   level 0  each CTA reads its part of the row (16-byte loads, several in flight),
//            stages it in shared memory and builds the 2048-bin histogram of digit 0
//            with shared-memory atomics.
//   merge    (G > 1) reduce-scatter then all-gather of the CTAs' histograms over DSMEM,
//            two cluster barriers: every CTA then holds the row's histogram.
//   scan     a block suffix scan finds the bucket b holding the K-th largest key, the
//            count above b (all selected) and the count in b. This CTA's own counts are
//            scanned alongside (packed in the high half of 64-bit sums).
//   stop     if bucket b holds exactly what is still needed, or the key is exhausted, the
//            threshold prefix T is final; else the next level histograms the next digit
//            of the elements whose prefix equals the chosen buckets.
//   final    one more pass writes every element whose prefix is > T and, of those == T,
//            as many as still needed (by ticket). Each CTA reserves its output slots
//            with one atomic on rank 0's counters (DSMEM); inside a CTA, warp-aggregated
//            shared-memory tickets.
// L <= k: every element is selected and goes to the slot equal to its index.
// sorted: the selected (key, index) pairs go to rank 0's shared memory instead; rank 0
// bitonic-sorts them (descending) and writes the indices and values (re-read from x).
// Rows shorter than k are padded by rank 0 (index -1, value -inf).
#include <cooperative_groups.h>

#include "common/cuda_utils.h"
#include "topk/topk.h"

namespace deepfuse {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 2048;  // widest digit: 11 bits
constexpr int kUnroll = 4;   // 16-byte loads in flight per thread in the first pass
constexpr int kMaxCluster = 8;
constexpr int kMinSegment = 4096;          // do not split rows into parts smaller than this
constexpr int kSmemTwoPerSm = 112 * 1024;  // per CTA: two CTAs fit an SM (228 KB)
constexpr int kSmemOnePerSm = 220 * 1024;  // per CTA: one CTA per SM
constexpr unsigned kFull = 0xffffffffu;
static_assert(kBins == 4 * kThreads, "scan and zeroing assume four bins per thread");

template <int FMT>
struct Fmt;
template <>
struct Fmt<0> {  // bf16
  using Raw = uint16_t;
  static constexpr int kBits = 16;
  static constexpr uint32_t kNegInf = 0xFF80u;
  __device__ __forceinline__ static uint32_t key(uint32_t r) {
    const uint32_t k = r ^ ((r & 0x8000u) ? 0xFFFFu : 0x8000u);
    return (r & 0x7FFFu) > 0x7F80u ? 0xFFFFu : k;
  }
};
template <>
struct Fmt<1> {  // fp16
  using Raw = uint16_t;
  static constexpr int kBits = 16;
  static constexpr uint32_t kNegInf = 0xFC00u;
  __device__ __forceinline__ static uint32_t key(uint32_t r) {
    const uint32_t k = r ^ ((r & 0x8000u) ? 0xFFFFu : 0x8000u);
    return (r & 0x7FFFu) > 0x7C00u ? 0xFFFFu : k;
  }
};
template <>
struct Fmt<2> {  // fp32
  using Raw = uint32_t;
  static constexpr int kBits = 32;
  static constexpr uint32_t kNegInf = 0xFF800000u;
  __device__ __forceinline__ static uint32_t key(uint32_t r) {
    const uint32_t k = r ^ ((r & 0x80000000u) ? 0xFFFFFFFFu : 0x80000000u);
    return (r & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFFFFFFu : k;
  }
};

// Digit widths, most significant first: 16-bit keys 11 + 5, 32-bit keys 11 + 11 + 10.
__host__ __device__ constexpr int digit_bits(int key_bits, int level) {
  return key_bits == 16 ? (level == 0 ? 11 : 5) : (level < 2 ? 11 : 10);
}

struct __align__(16) Shared {
  uint32_t hist[kBins];    // this CTA's histogram of the current digit
  uint32_t red[kBins];     // G > 1: this CTA's slice of the row histogram (kBins / G bins)
  uint32_t merged[kBins];  // G > 1: the row histogram
  unsigned long long wsum[kWarps];
  uint32_t res_bin, res_above, res_cnt, res_lab, res_lcnt;  // scan result
  uint32_t cnt_gt, cnt_eq;    // rank 0: cluster-wide output slot counters
  uint32_t tk_gt, tk_eq;      // this CTA's tickets
  uint32_t base_gt, base_eq;  // this CTA's first slot (greater / tied)
};

struct Params {
  const void* x;
  int64_t ld;
  const int32_t* lengths;
  void* values;
  void* indices;
  int N, k, G, idx64, sorted;
};

__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

// Element i of a 16-byte vector of raw values (i must be a compile-time constant after unrolling).
template <int VEC>
__device__ __forceinline__ uint32_t elem(const uint4& v, int i) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  if constexpr (VEC == 8) {
    return (w[i >> 1] >> ((i & 1) * 16)) & 0xFFFFu;
  } else {
    return w[i];
  }
}

// This CTA's part of a row. Slot s covers elements [seg0 + s*VEC, seg0 + (s+1)*VEC) (16-byte
// aligned in global memory); elements outside [lo, hi) are not this CTA's. Interior slots
// [1, nslots - 1) lie wholly inside [lo, hi); the two edge slots hold the row's unaligned
// head (rank 0) and tail (last rank) or nothing.
template <class F, bool STAGED>
struct Part {
  using Raw = typename F::Raw;
  static constexpr int VEC = 16 / sizeof(Raw);
  const Raw* p;  // row start
  int lo, hi, seg0, nslots;
  uint4* stage;  // nslots slots (STAGED)

  __device__ __forceinline__ bool in(int e) const { return e >= lo && e < hi; }

  __device__ __forceinline__ uint4 load_interior_global(int s) const {
    const uint4* a = reinterpret_cast<const uint4*>(p + static_cast<int64_t>(seg0 + s * VEC));
    if constexpr (STAGED) {
      return __ldcs(a);  // read once: evict first
    } else {
      return __ldg(a);  // read again by the later passes: keep in L2
    }
  }

  __device__ __forceinline__ uint4 load_edge_global(int s) const {
    const int e0 = seg0 + s * VEC;
    uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if (in(e0 + i)) {
        const uint32_t r = __ldg(p + static_cast<int64_t>(e0 + i));
        if constexpr (VEC == 8) {
          w[i >> 1] |= r << ((i & 1) * 16);
        } else {
          w[i] = r;
        }
      }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }

  __device__ __forceinline__ bool is_edge(int s) const { return s == 0 || s == nslots - 1; }

  // Any slot, from the stage (STAGED) or from global memory.
  __device__ __forceinline__ uint4 load(int s) const {
    if constexpr (STAGED) {
      return stage[s];
    } else {
      return is_edge(s) ? load_edge_global(s) : load_interior_global(s);
    }
  }
};

// Histogram of digit (key >> shift) & mask over this CTA's elements whose key >> pshift
// equals prefix. FIRST: level 0 (no prefix), slots come from global memory and are staged.
template <bool FIRST, class F, bool STAGED>
__device__ __forceinline__ void hist_pass(const Part<F, STAGED>& c, uint32_t* hist, int pshift,
                                          uint32_t prefix, int shift, uint32_t mask) {
  constexpr int VEC = Part<F, STAGED>::VEC;
  constexpr int kU = (FIRST || !STAGED) ? kUnroll : 2;
  auto count = [&](uint32_t raw) {
    const uint32_t key = F::key(raw);
    if (FIRST || (key >> pshift) == prefix) atomicAdd(&hist[(key >> shift) & mask], 1u);
  };
  if (threadIdx.x < 2) {  // the two edge slots
    const int s = threadIdx.x == 0 ? 0 : c.nslots - 1;
    const uint4 v = (FIRST || !STAGED) ? c.load_edge_global(s) : c.stage[s];
    if constexpr (FIRST && STAGED) c.stage[s] = v;
    const int e0 = c.seg0 + s * VEC;
#pragma unroll
    for (int i = 0; i < VEC; ++i)
      if (c.in(e0 + i)) count(elem<VEC>(v, i));
  }
  const int n_in = c.nslots - 2;  // interior slots 1 .. nslots - 2
  for (int s0 = 0; s0 < n_in; s0 += kThreads * kU) {
    uint4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int j = s0 + u * kThreads + static_cast<int>(threadIdx.x);
      v[u] = make_uint4(0u, 0u, 0u, 0u);
      if (j < n_in) v[u] = (FIRST || !STAGED) ? c.load_interior_global(1 + j) : c.stage[1 + j];
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int j = s0 + u * kThreads + static_cast<int>(threadIdx.x);
      if (j >= n_in) break;
      if constexpr (FIRST && STAGED) c.stage[1 + j] = v[u];
#pragma unroll
      for (int i = 0; i < VEC; ++i) count(elem<VEC>(v[u], i));
    }
  }
}

// G > 1: every CTA of the cluster ends with the row histogram in sh.merged.
__device__ __forceinline__ void merge_histograms(Shared& sh, int G, int lg_slice, int rank) {
  cg::cluster_group cl = cg::this_cluster();
  cluster_sync();  // all local histograms complete (and every CTA of the cluster running)
  const int slice = 1 << lg_slice;  // kBins / G
  for (int j = threadIdx.x; j < slice; j += kThreads) {
    uint32_t sum = 0;
#pragma unroll
    for (int r = 0; r < kMaxCluster; ++r)
      if (r < G) sum += cl.map_shared_rank(sh.hist, r)[rank * slice + j];
    sh.red[j] = sum;
  }
  cluster_sync();  // slices complete; local histograms no longer read remotely
#pragma unroll
  for (int u = 0; u < kBins / kThreads; ++u) {
    const int b = u * kThreads + threadIdx.x;
    sh.merged[b] = cl.map_shared_rank(sh.red, b >> lg_slice)[b & (slice - 1)];
  }
  __syncthreads();
}

// Finds bucket b with S(b+1) < krem <= S(b), S(b) = sum of M over bins >= b (krem >= 1 and
// S(0) >= krem). Writes b, S(b+1), M[b] and this CTA's H-sums to sh.res_*.
__device__ __forceinline__ void find_bucket(Shared& sh, const uint32_t* M, const uint32_t* H,
                                            uint32_t krem) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const uint4 m4 = reinterpret_cast<const uint4*>(M)[t];
  const uint4 h4 = reinterpret_cast<const uint4*>(H)[t];
  unsigned long long c[4];
  c[0] = (static_cast<unsigned long long>(h4.x) << 32) | m4.x;
  c[1] = (static_cast<unsigned long long>(h4.y) << 32) | m4.y;
  c[2] = (static_cast<unsigned long long>(h4.z) << 32) | m4.z;
  c[3] = (static_cast<unsigned long long>(h4.w) << 32) | m4.w;
  const unsigned long long tot = c[0] + c[1] + c[2] + c[3];
  unsigned long long suf = tot;  // inclusive suffix sum over the lanes >= this one
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const unsigned long long o = __shfl_down_sync(kFull, suf, off);
    if (lane + off < 32) suf += o;
  }
  if (lane == 0) sh.wsum[warp] = suf;
  __syncthreads();
  unsigned long long run = suf - tot;  // bins above this thread's
#pragma unroll
  for (int w = 1; w < kWarps; ++w)
    if (w > warp) run += sh.wsum[w];
#pragma unroll
  for (int j = 3; j >= 0; --j) {
    const uint32_t above = static_cast<uint32_t>(run), in = static_cast<uint32_t>(c[j]);
    if (above < krem && above + in >= krem) {
      sh.res_bin = 4 * t + j;
      sh.res_above = above;
      sh.res_cnt = in;
      sh.res_lab = static_cast<uint32_t>(run >> 32);
      sh.res_lcnt = static_cast<uint32_t>(c[j] >> 32);
    }
    run += c[j];
  }
  __syncthreads();
}

template <class F>
struct Out {
  using Raw = typename F::Raw;
  Raw* values;           // row start or null
  void* indices;         // row start
  unsigned long long* sel;  // sorted: rank 0's pair buffer (maybe remote)
  bool idx64, sorted;

  __device__ __forceinline__ void emit(int pos, int e, uint32_t raw, uint32_t key) const {
    if (sorted) {
      sel[pos] = (static_cast<unsigned long long>(key) << 32) | static_cast<uint32_t>(e);
      return;
    }
    if (values) values[pos] = static_cast<Raw>(raw);
    if (idx64) {
      static_cast<int64_t*>(indices)[pos] = e;
    } else {
      static_cast<int32_t*>(indices)[pos] = e;
    }
  }
  __device__ __forceinline__ void pad(int pos) const {
    if (values) values[pos] = static_cast<Raw>(F::kNegInf);
    if (idx64) {
      static_cast<int64_t*>(indices)[pos] = -1;
    } else {
      static_cast<int32_t*>(indices)[pos] = -1;
    }
  }
};

// Writes the elements with key >> shift > tp (slots base_gt + ticket) and, of those equal
// to tp, the ones whose ticket base_eq + t < need_eq (slots above_total + t). Tickets: a
// warp scan of per-thread counts and one shared-memory atomic per warp and counter.
template <class F, bool STAGED>
__device__ __forceinline__ void select_pass(const Part<F, STAGED>& c, Shared& sh, const Out<F>& o,
                                            int shift, uint32_t tp, uint32_t base_gt,
                                            uint32_t base_eq, uint32_t above_total,
                                            uint32_t need_eq) {
  constexpr int VEC = Part<F, STAGED>::VEC;
  const int lane = threadIdx.x & 31;
  for (int s0 = 0; s0 < c.nslots; s0 += kThreads) {  // uniform trip count: warp collectives inside
    const int s = s0 + threadIdx.x;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (s < c.nslots) v = c.load(s);
    const int e0 = c.seg0 + s * VEC;
    const bool check = s >= c.nslots || c.is_edge(s);
    uint32_t gtm = 0, eqm = 0;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const uint32_t kp = F::key(elem<VEC>(v, i)) >> shift;
      const bool ok = !check || (s < c.nslots && c.in(e0 + i));
      gtm |= static_cast<uint32_t>(ok && kp > tp) << i;
      eqm |= static_cast<uint32_t>(ok && kp == tp) << i;
    }
    if (!__any_sync(kFull, (gtm | eqm) != 0u)) continue;
    // Warp-inclusive scan of (ties << 16 | greater) counts (each <= 8 per thread).
    const uint32_t mine = (static_cast<uint32_t>(__popc(eqm)) << 16) | static_cast<uint32_t>(__popc(gtm));
    uint32_t incl = mine;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const uint32_t o2 = __shfl_up_sync(kFull, incl, off);
      if (lane >= off) incl += o2;
    }
    const uint32_t total = __shfl_sync(kFull, incl, 31);
    uint32_t bg = 0, bq = 0;
    if (lane == 0) {
      if (total & 0xFFFFu) bg = atomicAdd(&sh.tk_gt, total & 0xFFFFu);
      if (total >> 16) bq = atomicAdd(&sh.tk_eq, total >> 16);
    }
    bg = __shfl_sync(kFull, bg, 0);
    bq = __shfl_sync(kFull, bq, 0);
    const uint32_t excl = incl - mine;
    uint32_t pg = base_gt + bg + (excl & 0xFFFFu);  // this thread's next slot / ticket
    uint32_t tq = base_eq + bq + (excl >> 16);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const uint32_t raw = elem<VEC>(v, i);
      if ((gtm >> i) & 1u) o.emit(pg++, e0 + i, raw, F::key(raw));
      if ((eqm >> i) & 1u) {
        if (tq < need_eq) o.emit(above_total + tq, e0 + i, raw, F::key(raw));
        ++tq;
      }
    }
  }
}

// Descending bitonic sort of a[0, n), n a power of two, by one CTA.
__device__ __forceinline__ void sort_desc(unsigned long long* a, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < (n >> 1); t += kThreads) {
        const int i = 2 * t - (t & (stride - 1));
        const int j = i + stride;
        const unsigned long long x = a[i], y = a[j];
        const bool desc = (i & size) == 0;
        if (desc ? x < y : x > y) {
          a[i] = y;
          a[j] = x;
        }
      }
      __syncthreads();
    }
  }
}

template <int FMT, bool STAGED>
__global__ void __launch_bounds__(kThreads, 2) topk_kernel(const Params P) {
  using F = Fmt<FMT>;
  using Raw = typename F::Raw;
  constexpr int VEC = 16 / sizeof(Raw);
  constexpr int KB = F::kBits;
  constexpr int kLevels = KB == 16 ? 2 : 3;

  extern __shared__ __align__(16) unsigned char smem[];
  Shared& sh = *reinterpret_cast<Shared*>(smem);
  unsigned long long* sel = reinterpret_cast<unsigned long long*>(smem + sizeof(Shared));
  uint4* stage = reinterpret_cast<uint4*>(smem + sizeof(Shared) +
                                          (P.sorted ? kTopkMaxK * sizeof(unsigned long long) : 0));

  const int G = P.G;
  const int lg_g = __ffs(G) - 1;
  const int rank = blockIdx.x & (G - 1);
  const int64_t row = blockIdx.x >> lg_g;
  const int tid = threadIdx.x;
  const Raw* p = static_cast<const Raw*>(P.x) + row * P.ld;
  int L = P.N;
  if (P.lengths) L = min(max(__ldg(P.lengths + row), 0), P.N);
  const int kk = min(P.k, L);

  // This CTA's share of [0, L): whole 16-byte vectors [seg_start, seg_end); rank 0 also
  // takes the unaligned head [0, head), the last rank the tail [seg_end, L).
  int head = static_cast<int>(((16u - (static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p)) & 15u)) & 15u) /
                              sizeof(Raw));
  head = min(head, L);
  const int V = (L - head) / VEC;
  const int vpc = (V + G - 1) >> lg_g;
  const int v0 = min(rank * vpc, V), v1 = min(v0 + vpc, V);
  const int seg_start = head + v0 * VEC;
  Part<F, STAGED> c;
  c.p = p;
  c.lo = rank == 0 ? 0 : seg_start;
  c.hi = rank == G - 1 ? L : head + v1 * VEC;
  c.seg0 = seg_start - VEC;
  c.nslots = v1 - v0 + 2;
  c.stage = stage;

  cg::cluster_group cl = cg::this_cluster();
  Out<F> o;
  o.values = P.values ? static_cast<Raw*>(P.values) + row * P.k : nullptr;
  o.indices = P.idx64 ? static_cast<void*>(static_cast<int64_t*>(P.indices) + row * P.k)
                      : static_cast<void*>(static_cast<int32_t*>(P.indices) + row * P.k);
  o.sel = G > 1 ? cl.map_shared_rank(sel, 0) : sel;
  o.idx64 = P.idx64 != 0;
  o.sorted = P.sorted != 0;

  reinterpret_cast<uint4*>(sh.hist)[tid] = make_uint4(0u, 0u, 0u, 0u);  // kBins == 4 * kThreads
  if (tid == 0) sh.cnt_gt = sh.cnt_eq = sh.tk_gt = sh.tk_eq = 0;
  __syncthreads();

  bool remote_counters = false;  // unsorted G > 1: arrived after the DSMEM atomics
  if (kk == L) {
    // Every element is selected (L <= k, including L == 0): slot = index.
    if (o.sorted && G > 1) cluster_sync();  // rank 0 is running before its buffer is written
    for (int e = c.lo + tid; e < c.hi; e += kThreads) {
      const uint32_t raw = __ldg(p + e);
      o.emit(e, e, raw, F::key(raw));
    }
  } else {
    // Radix select of the K = kk largest keys.
    uint32_t prefix = 0, krem = kk, gt_local = 0, eq_local = 0;
    int shift = KB;
    const uint32_t* M = G > 1 ? sh.merged : sh.hist;
    const int lg_slice = 11 - lg_g;
#pragma unroll
    for (int level = 0; level < kLevels; ++level) {
      const int bits = digit_bits(KB, level);
      const int pshift = shift;
      shift -= bits;
      if (level == 0) {
        hist_pass<true>(c, sh.hist, 0, 0u, shift, kBins - 1);
      } else {
        reinterpret_cast<uint4*>(sh.hist)[tid] = make_uint4(0u, 0u, 0u, 0u);
        __syncthreads();
        hist_pass<false>(c, sh.hist, pshift, prefix, shift, (1u << bits) - 1u);
      }
      __syncthreads();
      if (G > 1) merge_histograms(sh, G, lg_slice, rank);
      find_bucket(sh, M, sh.hist, krem);
      const uint32_t b = sh.res_bin, above = sh.res_above, cnt = sh.res_cnt;
      gt_local += sh.res_lab;
      eq_local = sh.res_lcnt;
      prefix = (prefix << bits) | b;
      krem -= above;
      if (cnt == krem) break;  // the whole bucket is selected
    }
    uint32_t base_gt = 0, base_eq = 0;
    if (G > 1) {
      if (tid == 0) {
        sh.base_gt = atomicAdd(cl.map_shared_rank(&sh.cnt_gt, 0), gt_local);
        sh.base_eq = atomicAdd(cl.map_shared_rank(&sh.cnt_eq, 0), eq_local);
      }
      __syncthreads();
      base_gt = sh.base_gt;
      base_eq = sh.base_eq;
      if (!o.sorted) {
        cluster_arrive();  // rank 0 waits for this before it exits
        remote_counters = true;
      }
    }
    select_pass(c, sh, o, shift, prefix, base_gt, base_eq, kk - krem, krem);
  }

  if (rank == 0) {
    Out<F> og = o;
    og.sorted = false;
    for (int pos = kk + tid; pos < P.k; pos += kThreads) og.pad(pos);
  }
  if (o.sorted) {
    if (G > 1) {
      cluster_sync();  // every CTA's pairs are in rank 0's buffer
    } else {
      __syncthreads();
    }
    if (rank != 0 || kk == 0) return;
    int n = 1;
    while (n < kk) n <<= 1;
    for (int i = kk + tid; i < n; i += kThreads) sel[i] = 0ull;  // below every real pair
    __syncthreads();
    sort_desc(sel, n);
    Out<F> og = o;
    og.sorted = false;
    for (int i = tid; i < kk; i += kThreads) {
      const int e = static_cast<int>(static_cast<uint32_t>(sel[i]));
      og.emit(i, e, og.values ? __ldg(p + e) : 0u, 0u);
    }
  } else if (remote_counters) {
    cluster_wait();
  }
}

int elem_size(TopkDtype d) { return d == TopkDtype::kF32 ? 4 : 2; }

// Opts every kernel variant into large dynamic shared memory, once per device (on the
// first call, so that a later first use of a variant inside a graph capture needs no
// attribute call).
void set_smem_attributes() {
  static bool done[64] = {};
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev < 64 && done[dev]) return;
  const void* kernels[] = {reinterpret_cast<const void*>(topk_kernel<0, true>),
                           reinterpret_cast<const void*>(topk_kernel<0, false>),
                           reinterpret_cast<const void*>(topk_kernel<1, true>),
                           reinterpret_cast<const void*>(topk_kernel<1, false>),
                           reinterpret_cast<const void*>(topk_kernel<2, true>),
                           reinterpret_cast<const void*>(topk_kernel<2, false>)};
  for (const void* kern : kernels)
    check_cuda(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemOnePerSm),
               "topk: cudaFuncSetAttribute");
  if (dev < 64) done[dev] = true;
}

template <int FMT, bool STAGED>
void launch(const Params& P, int64_t B, int smem, cudaStream_t stream) {
  auto kern = topk_kernel<FMT, STAGED>;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(B * P.G), 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(P.G);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&cfg, kern, P), "topk: launch");
  check_launch("topk");
}

}  // namespace

TopkPlan topk_plan(TopkDtype dtype, int64_t B, int64_t N, bool sorted) {
  const int vec = 16 / elem_size(dtype);
  const int64_t fixed = static_cast<int64_t>(sizeof(Shared)) +
                        (sorted ? kTopkMaxK * static_cast<int64_t>(sizeof(unsigned long long)) : 0);
  const int64_t nvec = N / vec;
  auto stage_bytes = [&](int g) { return (ceil_div<int64_t>(nvec, g) + 2) * 16; };
  const int64_t sms = num_sms();
  int g = 1;  // parallelism: about two CTAs per SM, parts of at least kMinSegment elements
  while (g < kMaxCluster && B * g < 2 * sms && N / (2 * g) >= kMinSegment) g *= 2;
  for (int64_t budget : {static_cast<int64_t>(kSmemTwoPerSm), static_cast<int64_t>(kSmemOnePerSm)})
    for (int G = g; G <= kMaxCluster; G *= 2)
      if (fixed + stage_bytes(G) <= budget)
        return TopkPlan{G, true, static_cast<int>(fixed + stage_bytes(G))};
  return TopkPlan{g, false, static_cast<int>(fixed)};
}

void topk(const void* x, TopkDtype dtype, int64_t B, int64_t N, int64_t ld, int k,
          const int32_t* lengths, void* values, void* indices, bool idx64, bool sorted,
          cudaStream_t stream) {
  if (B <= 0) return;
  if (k < 1 || k > kTopkMaxK) throw std::runtime_error("deepfuse: topk: k must be in [1, 4096]");
  if (N < 0 || N >= (int64_t{1} << 31)) throw std::runtime_error("deepfuse: topk: N must be < 2^31");
  const TopkPlan plan = topk_plan(dtype, B, N, sorted);
  if (B * plan.ctas_per_row >= (int64_t{1} << 31)) throw std::runtime_error("deepfuse: topk: too many rows");
  Params P;
  P.x = x;
  P.ld = ld;
  P.lengths = lengths;
  P.values = values;
  P.indices = indices;
  P.N = static_cast<int>(N);
  P.k = k;
  P.G = plan.ctas_per_row;
  P.idx64 = idx64;
  P.sorted = sorted;
  set_smem_attributes();
  switch (dtype) {
    case TopkDtype::kBf16:
      plan.staged ? launch<0, true>(P, B, plan.smem_bytes, stream) : launch<0, false>(P, B, plan.smem_bytes, stream);
      break;
    case TopkDtype::kF16:
      plan.staged ? launch<1, true>(P, B, plan.smem_bytes, stream) : launch<1, false>(P, B, plan.smem_bytes, stream);
      break;
    case TopkDtype::kF32:
      plan.staged ? launch<2, true>(P, B, plan.smem_bytes, stream) : launch<2, false>(P, B, plan.smem_bytes, stream);
      break;
    default:
      throw std::runtime_error("deepfuse: topk: bad dtype code");
  }
}

}  // namespace deepfuse
