// Row-wise top-k: one streaming pass over the row that keeps only candidates, then a radix
// select over the candidates alone.
//
// Keys: a float's bits become an unsigned integer of the same width whose order is the
// float order (negative: all bits flipped; non-negative: sign bit set). Every NaN maps to
// the all-ones key, above +inf. bf16/fp16 give 16-bit keys, fp32 32-bit keys.
//
// Why not a radix select over the whole row: for real-valued data the top digit of the
// key (sign, exponent, a few mantissa bits) falls into a few dozen bins, so a histogram of
// every element serialises on shared-memory atomics to the same addresses; that, not HBM,
// bounded the previous (staged, full-histogram) kernel at 2-4x torch.topk.
//
// Work split: a row is handled by G CTAs (G in {1, 2, 4, 8}; a thread-block cluster when
// G > 1, 512 threads per CTA; G = 1: 256 threads, up to four CTAs per SM). G grows while
// the grid stays within about one wave and each CTA keeps at least 8192 elements.
//
// Per CTA, with K = min(k, L) (L: the row's length) and a candidate buffer of C >= 2K
// (raw bits, index) pairs in shared memory:
//   estimate  (part longer than C) every thread reads a few elements spread over the CTA's
//             part; a histogram of their top 11 key bits gives a first threshold thr whose
//             expected count above it is a few standard deviations over this part's share
//             of K. Only a speed hint: every case below stays exact.
//   stream    the part is read once from HBM (16-byte loads, two sets of U per thread in
//             flight). A float compare against thr (exact while thr < key(+inf); else the
//             keys are compared) drops almost every element; the survivors are appended
//             to the buffer (warp-scanned counts, one shared atomic per warp).
//   compact   when an append does not fit (warp reservations past C fail and are retried),
//             the CTA selects the K largest buffered keys (radix select over the buffer),
//             keeps exactly those and raises thr to their threshold. Invariants: every
//             dropped element has key <= thr; every buffered key is >= thr; after a
//             compaction the buffer holds >= K keys >= thr (a valid top-K of the part).
//   select    D = the largest thr of the row's CTAs (DSMEM exchange for G > 1). A radix
//             select over the buffered keys >= D (11-bit digits starting below the common
//             prefix of the smallest and largest buffered keys, so candidates spread over
//             the bins; histograms merged over DSMEM for G > 1) finds the K-th key. If
//             fewer than K candidates are >= D (the estimate was too high), the row is
//             streamed again with thr = 0 (exact by the invariant).
//   histograms (sample, select): lanes of a warp with the same bin are merged first
//             (match.any), one shared atomic per distinct bin.
//   output    candidates above the threshold prefix take slots by ticket; of those equal
//             to it, as many as still needed. Slot bases across CTAs: one atomic per CTA on
//             rank 0's counters (DSMEM).
// L <= k: every element is selected and goes to the slot equal to its index.
// sorted: the selected (key, index) pairs go to rank 0's shared memory instead; rank 0
// bitonic-sorts them (descending) and writes the indices and values (re-read from x).
// Rows shorter than k are padded by rank 0 (index -1, value -inf).
#include <cooperative_groups.h>
#include <cuda_fp16.h>

#include "common/cuda_utils.h"
#include "topk/topk.h"

namespace deepfuse {
namespace {

namespace cg = cooperative_groups;

constexpr int kBins = 2048;  // widest digit: 11 bits
constexpr int kMaxCluster = 8;
constexpr int kMinPart = 8192;  // do not split rows into parts smaller than this
constexpr int kSamples = 1024;  // elements per CTA in the threshold estimate
constexpr uint32_t kNone = 0xFFFFFFFFu;
constexpr unsigned kFull = 0xffffffffu;

template <int FMT>
struct Fmt;
template <>
struct Fmt<0> {  // bf16
  using Raw = uint16_t;
  static constexpr int kBits = 16;
  static constexpr uint32_t kNegInf = 0xFF80u;
  static constexpr uint32_t kKeyNegInf = 0x007Fu, kKeyPosInf = 0xFF80u;
  __device__ __forceinline__ static uint32_t key(uint32_t r) {
    const uint32_t k = r ^ ((r & 0x8000u) ? 0xFFFFu : 0x8000u);
    return (r & 0x7FFFu) > 0x7F80u ? 0xFFFFu : k;
  }
  __device__ __forceinline__ static float to_float(uint32_t r) { return __uint_as_float(r << 16); }
  // Bit i: element i of v is not below t (NaN included).
  __device__ __forceinline__ static uint32_t ge_mask(const uint4& v, float t) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      m |= static_cast<uint32_t>(!(__uint_as_float(w[i] << 16) < t)) << (2 * i);
      m |= static_cast<uint32_t>(!(__uint_as_float(w[i] & 0xFFFF0000u) < t)) << (2 * i + 1);
    }
    return m;
  }
};
template <>
struct Fmt<1> {  // fp16
  using Raw = uint16_t;
  static constexpr int kBits = 16;
  static constexpr uint32_t kNegInf = 0xFC00u;
  static constexpr uint32_t kKeyNegInf = 0x03FFu, kKeyPosInf = 0xFC00u;
  __device__ __forceinline__ static uint32_t key(uint32_t r) {
    const uint32_t k = r ^ ((r & 0x8000u) ? 0xFFFFu : 0x8000u);
    return (r & 0x7FFFu) > 0x7C00u ? 0xFFFFu : k;
  }
  __device__ __forceinline__ static float to_float(uint32_t r) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(r)));
  }
  __device__ __forceinline__ static uint32_t ge_mask(const uint4& v, float t) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      m |= static_cast<uint32_t>(!(to_float(w[i] & 0xFFFFu) < t)) << (2 * i);
      m |= static_cast<uint32_t>(!(to_float(w[i] >> 16) < t)) << (2 * i + 1);
    }
    return m;
  }
};
template <>
struct Fmt<2> {  // fp32
  using Raw = uint32_t;
  static constexpr int kBits = 32;
  static constexpr uint32_t kNegInf = 0xFF800000u;
  static constexpr uint32_t kKeyNegInf = 0x007FFFFFu, kKeyPosInf = 0xFF800000u;
  __device__ __forceinline__ static uint32_t key(uint32_t r) {
    const uint32_t k = r ^ ((r & 0x80000000u) ? 0xFFFFFFFFu : 0x80000000u);
    return (r & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFFFFFFu : k;
  }
  __device__ __forceinline__ static float to_float(uint32_t r) { return __uint_as_float(r); }
  __device__ __forceinline__ static uint32_t ge_mask(const uint4& v, float t) {
    return static_cast<uint32_t>(!(__uint_as_float(v.x) < t)) |
           static_cast<uint32_t>(!(__uint_as_float(v.y) < t)) << 1 |
           static_cast<uint32_t>(!(__uint_as_float(v.z) < t)) << 2 |
           static_cast<uint32_t>(!(__uint_as_float(v.w) < t)) << 3;
  }
};

// x >> s for s in [0, 32].
__device__ __forceinline__ uint32_t shr(uint32_t x, int s) { return s >= 32 ? 0u : x >> s; }

// The value t of key thr + 1, clamped to [-inf, +inf]: key(x) > thr implies !(x < t) (NaN
// included). For thr < key(+inf) the converse holds too, except for x = -0.0 when
// thr = key(-0.0) (then key(x) == thr: a harmless extra candidate).
template <class F>
__device__ __forceinline__ float thr_float(uint32_t thr) {
  const uint32_t t1 = thr >= F::kKeyPosInf ? F::kKeyPosInf : max(thr + 1u, F::kKeyNegInf);
  constexpr uint32_t sign = 1u << (F::kBits - 1);
  constexpr uint32_t all = F::kBits == 32 ? 0xFFFFFFFFu : 0xFFFFu;
  return F::to_float((t1 & sign) ? (t1 ^ sign) : (~t1 & all));
}

struct __align__(16) Shared {
  uint32_t hist[kBins];  // this CTA's histogram of the current digit
  unsigned long long wsum[16];
  uint32_t res_bin, res_above, res_cnt, res_lab, res_lcnt, res_total;  // find_bucket result
  uint32_t cnt;   // buffer reservation counter
  uint32_t vend;  // lowest base of a failed reservation (kNone: none)
  uint32_t mx;    // largest buffered key
  uint32_t mn;    // smallest buffered key (kNone: empty)
  uint32_t dr;    // this CTA's drop threshold (read by the cluster)
  uint32_t cnt_gt, cnt_eq;  // rank 0: cluster-wide output slot counters
  uint32_t tk_gt, tk_eq, tk_ret;
  uint32_t base_gt, base_eq;
};

struct Params {
  const void* x;
  int64_t ld;
  const int32_t* lengths;
  void* values;
  void* indices;
  int N, k, G, C, idx64, sorted;
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

// 16 bytes read once: no L1 allocation.
__device__ __forceinline__ uint4 ld_stream(const void* a) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(a));
  return v;
}

// Element i of a 16-byte vector of raw values (i a compile-time constant after unrolling).
template <int VEC>
__device__ __forceinline__ uint32_t elem(const uint4& v, int i) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  if constexpr (VEC == 8) {
    return (w[i >> 1] >> ((i & 1) * 16)) & 0xFFFFu;
  } else {
    return w[i];
  }
}

// Element i of a 16-byte vector, i known only at run time (selects, no local memory).
template <int VEC>
__device__ __forceinline__ uint32_t elem_dyn(const uint4& v, int i) {
  if constexpr (VEC == 8) {
    const uint32_t w = (i & 4) ? ((i & 2) ? v.w : v.z) : ((i & 2) ? v.y : v.x);
    return (i & 1) ? (w >> 16) : (w & 0xFFFFu);
  } else {
    return (i & 2) ? ((i & 1) ? v.w : v.z) : ((i & 1) ? v.y : v.x);
  }
}

// Adds 1 to h[bin] for every active lane; lanes of a warp with the same bin are merged
// first (one shared atomic per distinct bin: skewed bins do not serialise). Warp-collective.
__device__ __forceinline__ void hist_add(uint32_t* h, uint32_t bin, bool active) {
  const uint32_t act = __ballot_sync(kFull, active);
  if (active) {
    const uint32_t peers = __match_any_sync(act, bin);
    if ((threadIdx.x & 31u) == static_cast<uint32_t>(__ffs(peers) - 1)) atomicAdd(&h[bin], __popc(peers));
  }
}

// This CTA's part of a row. Slot s covers elements [seg0 + s*VEC, seg0 + (s+1)*VEC) (16-byte
// aligned in global memory); elements outside [lo, hi) are not this CTA's. Interior slots
// [1, nslots - 1) lie wholly inside [lo, hi); the two edge slots hold the row's unaligned
// head (rank 0) and tail (last rank) or nothing.
template <class F>
struct Part {
  using Raw = typename F::Raw;
  static constexpr int VEC = 16 / sizeof(Raw);
  const Raw* p;  // row start
  int lo, hi, seg0, nslots;

  __device__ __forceinline__ bool in(int e) const { return e >= lo && e < hi; }
  __device__ __forceinline__ uint4 load_interior(int s) const {
    return ld_stream(p + static_cast<int64_t>(seg0 + s * VEC));
  }
  __device__ __forceinline__ uint4 load_edge(int s) const {
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
};

// G > 1: every CTA of the cluster ends with the row histogram in `merged`.
template <int NT>
__device__ __forceinline__ void merge_histograms(Shared& sh, uint32_t* red, uint32_t* merged, int G,
                                                 int lg_slice, int rank) {
  cg::cluster_group cl = cg::this_cluster();
  cluster_sync();  // all local histograms complete (and every CTA of the cluster running)
  const int slice = 1 << lg_slice;  // kBins / G
  for (int j = threadIdx.x; j < slice; j += NT) {
    uint32_t sum = 0;
#pragma unroll
    for (int r = 0; r < kMaxCluster; ++r)
      if (r < G) sum += cl.map_shared_rank(sh.hist, r)[rank * slice + j];
    red[j] = sum;
  }
  cluster_sync();  // slices complete; local histograms no longer read remotely
#pragma unroll
  for (int u = 0; u < kBins / NT; ++u) {
    const int b = u * NT + threadIdx.x;
    merged[b] = cl.map_shared_rank(red, b >> lg_slice)[b & (slice - 1)];
  }
  __syncthreads();
}

// Finds bucket b with S(b+1) < krem <= S(b), S(b) = sum of M over bins >= b, if S(0) >= krem.
// Writes b, S(b+1), M[b], this CTA's H-sums (S_H(b+1), H[b]) and S(0) to sh.res_*.
template <int NT>
__device__ __forceinline__ void find_bucket(Shared& sh, const uint32_t* M, const uint32_t* H,
                                            uint32_t krem) {
  constexpr int BPT = kBins / NT;  // bins per thread: 4 or 8
  constexpr int NW = NT / 32;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  unsigned long long c[BPT];
#pragma unroll
  for (int q = 0; q < BPT / 4; ++q) {
    const uint4 m4 = reinterpret_cast<const uint4*>(M)[t * (BPT / 4) + q];
    const uint4 h4 = reinterpret_cast<const uint4*>(H)[t * (BPT / 4) + q];
    c[4 * q + 0] = (static_cast<unsigned long long>(h4.x) << 32) | m4.x;
    c[4 * q + 1] = (static_cast<unsigned long long>(h4.y) << 32) | m4.y;
    c[4 * q + 2] = (static_cast<unsigned long long>(h4.z) << 32) | m4.z;
    c[4 * q + 3] = (static_cast<unsigned long long>(h4.w) << 32) | m4.w;
  }
  unsigned long long tot = 0;
#pragma unroll
  for (int j = 0; j < BPT; ++j) tot += c[j];
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
  for (int w = 1; w < NW; ++w)
    if (w > warp) run += sh.wsum[w];
  if (t == 0) sh.res_total = static_cast<uint32_t>(run + tot);
#pragma unroll
  for (int j = BPT - 1; j >= 0; --j) {
    const uint32_t above = static_cast<uint32_t>(run), in = static_cast<uint32_t>(c[j]);
    if (above < krem && above + in >= krem) {
      sh.res_bin = BPT * t + j;
      sh.res_above = above;
      sh.res_cnt = in;
      sh.res_lab = static_cast<uint32_t>(run >> 32);
      sh.res_lcnt = static_cast<uint32_t>(c[j] >> 32);
    }
    run += c[j];
  }
  __syncthreads();
}

// find_bucket for a plain histogram (no per-CTA half): res_bin only.
template <int NT>
__device__ __forceinline__ void find_bucket_lean(Shared& sh, const uint32_t* M, uint32_t krem) {
  constexpr int BPT = kBins / NT;
  constexpr int NW = NT / 32;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  uint32_t c[BPT];
#pragma unroll
  for (int q = 0; q < BPT / 4; ++q) {
    const uint4 m4 = reinterpret_cast<const uint4*>(M)[t * (BPT / 4) + q];
    c[4 * q + 0] = m4.x;
    c[4 * q + 1] = m4.y;
    c[4 * q + 2] = m4.z;
    c[4 * q + 3] = m4.w;
  }
  uint32_t tot = 0;
#pragma unroll
  for (int j = 0; j < BPT; ++j) tot += c[j];
  uint32_t suf = tot;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t o = __shfl_down_sync(kFull, suf, off);
    if (lane + off < 32) suf += o;
  }
  if (lane == 0) sh.wsum[warp] = suf;
  __syncthreads();
  uint32_t run = suf - tot;
#pragma unroll
  for (int w = 1; w < NW; ++w)
    if (w > warp) run += static_cast<uint32_t>(sh.wsum[w]);
#pragma unroll
  for (int j = BPT - 1; j >= 0; --j) {
    if (run < krem && run + c[j] >= krem) sh.res_bin = BPT * t + j;
    run += c[j];
  }
  __syncthreads();
}

template <class F>
struct Out {
  using Raw = typename F::Raw;
  Raw* values;              // row start or null
  void* indices;            // row start
  unsigned long long* sel;  // sorted: rank 0's pair buffer (maybe remote)
  bool idx64, sorted;

  __device__ __forceinline__ void emit(uint32_t pos, int e, uint32_t raw, uint32_t key) const {
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

// Result of a radix select over the buffer: the selected keys are those >= lo whose
// key >> shift is > T, plus `krem` of those equal to T. gt/eq_local: this CTA's counts.
struct Sel {
  uint32_t T, krem, gt_local, eq_local;
  int shift;
  bool ok;
};

// Descending bitonic sort of a[0, n), n a power of two, by one CTA.
template <int NT>
__device__ __forceinline__ void sort_desc(unsigned long long* a, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < (n >> 1); t += NT) {
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

template <int FMT, int NT, int U>
__device__ __noinline__ uint32_t compact_buffer(Shared& sh, uint32_t* craw, uint32_t* cidx, uint32_t cap,
                                                uint32_t kk, uint32_t thr);

template <int FMT, int NT, int U>
struct Ctx {
  using F = Fmt<FMT>;
  using Raw = typename F::Raw;
  static constexpr int VEC = 16 / sizeof(Raw);
  static constexpr int KB = F::kBits;

  Shared& sh;
  uint32_t* craw;    // buffer: raw bits
  uint32_t* cidx;    // buffer: element index
  uint32_t* red;     // G > 1
  uint32_t* merged;  // G > 1
  Part<F> c;
  int G, rank, lg_slice;
  uint32_t cap, kk;
  uint32_t thr;  // drop threshold: elements with key <= thr are not buffered
  float tf;      // thr as a float compare (exact while fast)
  bool fast;     // thr < key(+inf): the float compare decides

  __device__ __forceinline__ void set_thr(uint32_t t) {
    thr = t;
    tf = thr_float<F>(t);
    fast = t < F::kKeyPosInf;
  }

  // Appends this warp's elements of masks m[q] (bit i: element e0[q] + i of v[q]) with one
  // reservation (at most 32 * NV * VEC <= 1024 entries). Warp-collective. Returns false (for
  // the whole warp, nothing written) if the reservation does not fit the buffer.
  template <int NV>
  __device__ __forceinline__ bool warp_insert(const uint4 (&v)[NV], const int (&e0)[NV], const uint32_t (&m)[NV]) {
    const int lane = threadIdx.x & 31;
    uint32_t n = 0;
#pragma unroll
    for (int q = 0; q < NV; ++q) n += __popc(m[q]);
    uint32_t incl = n;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const uint32_t o = __shfl_up_sync(kFull, incl, off);
      if (lane >= off) incl += o;
    }
    const uint32_t total = __shfl_sync(kFull, incl, 31);
    if (total == 0) return true;
    uint32_t base = 0;
    if (lane == 31) {
      base = atomicAdd(&sh.cnt, total);
      if (base + total > cap) atomicMin(&sh.vend, base);
    }
    base = __shfl_sync(kFull, base, 31);
    if (base + total > cap) return false;
    uint32_t pos = base + incl - n;
#pragma unroll
    for (int q = 0; q < NV; ++q) {
      for (uint32_t mm = m[q]; mm; mm &= mm - 1u, ++pos) {  // usually zero or one bit
        const int i = __ffs(mm) - 1;
        craw[pos] = elem_dyn<VEC>(v[q], i);
        cidx[pos] = static_cast<uint32_t>(e0[q] + i);
      }
    }
    return true;
  }

  __device__ __forceinline__ uint32_t exact_mask(const uint4& v) const {
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < VEC; ++i) m |= static_cast<uint32_t>(F::key(elem<VEC>(v, i)) > thr) << i;
    return m;
  }

  // Largest and smallest key of buffer[0, n) into sh.mx, sh.mn (0 and kNone before).
  // Ends with a barrier.
  __device__ __forceinline__ void buffer_range(uint32_t n) {
    uint32_t hi = 0, lo = kNone;
    for (uint32_t i = threadIdx.x; i < n; i += NT) {
      const uint32_t key = F::key(craw[i]);
      hi = max(hi, key);
      lo = min(lo, key);
    }
    hi = __reduce_max_sync(kFull, hi);
    lo = __reduce_min_sync(kFull, lo);
    if ((threadIdx.x & 31) == 0) {
      if (hi) atomicMax(&sh.mx, hi);
      if (lo != kNone) atomicMin(&sh.mn, lo);
    }
    __syncthreads();
  }

  // Radix select of the `need` largest keys >= lo of buffer[0, n) (of every CTA's buffer if
  // cluster). Every key >= lo lies in [base, hi] (base >= lo). ok = false if fewer than
  // `need` keys are >= lo.
  __device__ __forceinline__ Sel select(uint32_t n, uint32_t lo, uint32_t base, uint32_t hi, uint32_t need,
                                        bool cluster) {
    const int tid = threadIdx.x;
    int start = KB;
    if (hi >= base) {
      const uint32_t d = base ^ hi;
      start = d ? 32 - __clz(d) : 0;
    }
    start = max(start, 11);  // at least one level; keys in [base, hi] share key >> start
    uint32_t prefix = shr(base, start), krem = need, gt_local = 0, eq_local = 0;
    int shift = start;
    if (tid == 0) sh.tk_gt = sh.tk_eq = sh.tk_ret = 0;
    const uint32_t* M = cluster ? merged : sh.hist;
#pragma unroll 1
    for (int level = 0; level < 3 && shift > 0; ++level) {
      const int bits = min(11, shift);
      const int pshift = shift;
      shift -= bits;
      const uint32_t mask = (1u << bits) - 1u;
#pragma unroll
      for (int q = 0; q < kBins / (4 * NT); ++q)
        reinterpret_cast<uint4*>(sh.hist)[q * NT + tid] = make_uint4(0u, 0u, 0u, 0u);
      __syncthreads();
      for (uint32_t s0 = 0; s0 < n; s0 += NT) {  // uniform trip count: warp collectives inside
        const uint32_t i = s0 + tid;
        const uint32_t key = i < n ? F::key(craw[i]) : 0u;
        hist_add(sh.hist, (key >> shift) & mask, i < n && key >= lo && shr(key, pshift) == prefix);
      }
      __syncthreads();
      if (cluster) merge_histograms<NT>(sh, red, merged, G, lg_slice, rank);
      find_bucket<NT>(sh, M, sh.hist, krem);
      if (level == 0 && sh.res_total < need) return Sel{0u, 0u, 0u, 0u, 0, false};
      const uint32_t b = sh.res_bin, above = sh.res_above, cnt = sh.res_cnt;
      gt_local += sh.res_lab;
      eq_local = sh.res_lcnt;
      prefix = (prefix << bits) | b;
      krem -= above;
      if (cnt == krem) break;  // the whole bucket is selected
    }
    return Sel{prefix, krem, gt_local, eq_local, shift, true};
  }

  // Keeps exactly the selection s of buffer[0, n) (keys >= lo) at its front, in place:
  // each NT-entry chunk is read, ranked (one ticket counter) and written below its start.
  __device__ void compact_pass(uint32_t n, uint32_t lo, const Sel& s) {
    const int lane = threadIdx.x & 31;
    const uint32_t lt = (1u << lane) - 1u;
    for (uint32_t s0 = 0; s0 < n; s0 += NT) {  // uniform trip count
      const uint32_t i = s0 + threadIdx.x;
      uint32_t raw = 0, idx = 0;
      bool gt = false, eq = false;
      if (i < n) {
        raw = craw[i];
        idx = cidx[i];
        const uint32_t key = F::key(raw);
        const uint32_t kp = key >> s.shift;
        gt = key >= lo && kp > s.T;
        eq = key >= lo && kp == s.T;
      }
      const uint32_t qm = __ballot_sync(kFull, eq);
      uint32_t bq = 0;
      if (lane == 0 && qm) bq = atomicAdd(&sh.tk_eq, __popc(qm));
      bq = __shfl_sync(kFull, bq, 0);
      const bool keep = gt || (eq && bq + __popc(qm & lt) < s.krem);
      const uint32_t am = __ballot_sync(kFull, keep);
      uint32_t ba = 0;
      if (lane == 0 && am) ba = atomicAdd(&sh.tk_ret, __popc(am));
      ba = __shfl_sync(kFull, ba, 0);
      __syncthreads();  // the chunk is read before any of it is overwritten
      if (keep) {
        const uint32_t pos = ba + __popc(am & lt);
        craw[pos] = raw;
        cidx[pos] = idx;
      }
    }
  }

  // The buffer overflowed: keep its K largest keys and raise thr. Block-collective.
  // A warp appends at most 1024 entries at once, so n >= C - 1023 > K, and after the
  // compaction at least one retried append fits (C - K >= 1024).
  __device__ __forceinline__ uint32_t compact_now() {
    const uint32_t n = sh.vend;  // entries [0, n) are written
    buffer_range(n);
    const uint32_t lo = thr;
    const Sel s = select(n, lo, max(lo, sh.mn), sh.mx, kk, false);  // n > K keys >= lo: cannot fail
    compact_pass(n, lo, s);
    __syncthreads();
    if (threadIdx.x == 0) {
      sh.cnt = kk;
      sh.vend = kNone;
      sh.mx = 0;
      sh.mn = kNone;
    }
    __syncthreads();
    return max(lo, s.T << s.shift);  // the K kept keys are >= both
  }

  // Filters the U vectors of round r (interior slots 1 + (r*U + u)*NT + tid) into the buffer
  // (one append per warp and round); `nxt` holds round r + 1 (in flight). On an overflow the
  // buffer is compacted and both sets are loaded again (so no vector register lives across
  // the compaction), then the warps whose append failed retry with the new threshold.
  __device__ __forceinline__ void process(uint4 (&v)[U], uint4 (&nxt)[U], int r, int n_in) {
    bool pend = true;  // warp-uniform: this round not yet appended
#pragma unroll 1
    for (;;) {
      uint32_t m[U];
      int e0[U];
      bool any = false;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int j = (r * U + u) * NT + static_cast<int>(threadIdx.x);
        e0[u] = c.seg0 + (1 + j) * VEC;
        m[u] = 0;
        if (pend && j < n_in) m[u] = fast ? F::ge_mask(v[u], tf) : exact_mask(v[u]);
        any |= m[u] != 0u;
      }
      bool failed = false;
      if (__any_sync(kFull, any)) failed = !warp_insert<U>(v, e0, m);
      if (!__syncthreads_or(failed)) break;
      set_thr(compact_buffer<FMT, NT, U>(sh, craw, cidx, cap, kk, thr));
      load(v, r, n_in);
      load(nxt, r + 1, n_in);
      pend = failed;
    }
  }

  __device__ __forceinline__ void load(uint4 (&v)[U], int r, int n_in) const {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = (r * U + u) * NT + static_cast<int>(threadIdx.x);
      v[u] = j < n_in ? c.load_interior(1 + j) : make_uint4(0u, 0u, 0u, 0u);
    }
  }

  // One pass over this CTA's part: buffer every element with key > thr (thr0 = 0: all;
  // else from a sample when the part does not fit the buffer).
  __device__ void stream(bool estimate, int L) {
    const int tid = threadIdx.x;
    const int n_in = c.nslots - 2;  // interior slots 1 .. nslots - 2
    const int R = (n_in + NT * U - 1) / (NT * U);
    const bool sample = estimate && n_in > 0 && static_cast<uint32_t>(c.hi - c.lo) > cap;
    uint4 sv = make_uint4(0u, 0u, 0u, 0u);
    if (sample) sv = c.load_interior(1 + static_cast<int>((static_cast<int64_t>(tid) * n_in) / NT));
    uint4 A[U], B[U];
    load(A, 0, n_in);  // in flight during the estimate (B after it: registers)
    uint4 ev = make_uint4(0u, 0u, 0u, 0u);  // the two edge slots (lanes 0 and 1 of warp 0)
    const int es = tid == 0 ? 0 : c.nslots - 1;
    if (tid < 2) ev = c.load_edge(es);
    uint32_t t0 = 0;
    if (sample) {
      // Histogram of the top 11 key bits of kSamples elements spread over the part.
      constexpr int SPT = kSamples / NT;  // 4 or 2 per thread
      constexpr int shift = KB - 11;
#pragma unroll
      for (int i = 0; i < SPT; ++i) hist_add(sh.hist, F::key(elem<VEC>(sv, i * (VEC / SPT))) >> shift, true);
      __syncthreads();
      // Expected sample count among the row's K largest, plus 3 sigma and a floor.
      const float ks = __fdividef(static_cast<float>(kk) * kSamples, static_cast<float>(L));
      float sq;
      asm("sqrt.approx.f32 %0, %1;" : "=f"(sq) : "f"(ks));
      const uint32_t ts = static_cast<uint32_t>(ks + 3.f * sq + 5.f);
      if (ts < kSamples) {
        find_bucket_lean<NT>(sh, sh.hist, ts);
        const uint32_t b = sh.res_bin;
        t0 = b ? (b << shift) - 1u : 0u;  // buffer keys >= bucket b's lower edge
      }
    }
    set_thr(t0);
    if (tid < 32) {
      const uint4 v1[1] = {ev};
      const int e1[1] = {c.seg0 + es * VEC};
      uint32_t m1[1] = {0u};
      if (tid < 2) {
#pragma unroll
        for (int i = 0; i < VEC; ++i)
          m1[0] |= static_cast<uint32_t>(c.in(e1[0] + i) && F::key(elem<VEC>(ev, i)) > thr) << i;
      }
      warp_insert<1>(v1, e1, m1);  // the buffer is empty: fits
    }
    __syncthreads();
    load(B, 1, n_in);  // all zero (no loads) when R == 1
#pragma unroll 1
    for (int r = 0; r < R; r += 2) {
      process(A, B, r, n_in);
      if (r + 2 < R) load(A, r + 2, n_in);
      if (r + 1 < R) {
        process(B, A, r + 1, n_in);
        if (r + 3 < R) load(B, r + 3, n_in);
      }
    }
    __syncthreads();
  }

  // Writes the selection s of buffer[0, n) (keys >= lo): keys above T to slots
  // base_gt + ticket, of those equal to T the ones with tickets base_eq + t < s.krem to
  // slots above_total + base_eq + t.
  __device__ void emit_pass(const Out<F>& o, uint32_t n, uint32_t lo, const Sel& s, uint32_t base_gt,
                            uint32_t base_eq, uint32_t above_total) {
    const int lane = threadIdx.x & 31;
    const uint32_t lt = (1u << lane) - 1u;
    for (uint32_t s0 = 0; s0 < n; s0 += NT) {  // uniform trip count: warp collectives inside
      const uint32_t i = s0 + threadIdx.x;
      uint32_t raw = 0, key = 0;
      bool gt = false, eq = false;
      if (i < n) {
        raw = craw[i];
        key = F::key(raw);
        const uint32_t kp = key >> s.shift;
        gt = key >= lo && kp > s.T;
        eq = key >= lo && kp == s.T;
      }
      const uint32_t gm = __ballot_sync(kFull, gt), qm = __ballot_sync(kFull, eq);
      if ((gm | qm) == 0u) continue;
      uint32_t bg = 0, bq = 0;
      if (lane == 0) {
        if (gm) bg = atomicAdd(&sh.tk_gt, __popc(gm));
        if (qm) bq = atomicAdd(&sh.tk_eq, __popc(qm));
      }
      bg = __shfl_sync(kFull, bg, 0);
      bq = __shfl_sync(kFull, bq, 0);
      if (gt) o.emit(base_gt + bg + __popc(gm & lt), static_cast<int>(cidx[i]), raw, key);
      if (eq) {
        const uint32_t t = base_eq + bq + __popc(qm & lt);
        if (t < s.krem) o.emit(above_total + t, static_cast<int>(cidx[i]), raw, key);
      }
    }
  }
};

// Out of line (runs rarely): the streaming loop keeps its registers.
template <int FMT, int NT, int U>
__device__ __noinline__ uint32_t compact_buffer(Shared& sh, uint32_t* craw, uint32_t* cidx, uint32_t cap,
                                                uint32_t kk, uint32_t thr) {
  Ctx<FMT, NT, U> cx{sh, craw, cidx, nullptr, nullptr, {}, 1, 0, 11, cap, kk, thr, 0.f, true};
  return cx.compact_now();
}

template <int FMT, int NT, int U>
__global__ void __launch_bounds__(NT, NT == 256 ? 4 : 2) topk_kernel(const Params P) {
  using C_ = Ctx<FMT, NT, U>;
  using F = typename C_::F;
  using Raw = typename F::Raw;
  constexpr int VEC = C_::VEC;

  extern __shared__ __align__(16) unsigned char smem[];
  Shared& sh = *reinterpret_cast<Shared*>(smem);
  unsigned char* dyn = smem + sizeof(Shared);
  unsigned long long* sel = reinterpret_cast<unsigned long long*>(dyn);
  if (P.sorted) dyn += kTopkMaxK * sizeof(unsigned long long);
  uint32_t* merged = reinterpret_cast<uint32_t*>(dyn);
  uint32_t* red = merged + kBins;
  if (P.G > 1) dyn += (kBins + kBins / 2) * sizeof(uint32_t);
  uint32_t* craw = reinterpret_cast<uint32_t*>(dyn);
  uint32_t* cidx = craw + P.C;

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

  C_ cx{sh, craw, cidx, red, merged, {}, G, rank, 11 - lg_g, static_cast<uint32_t>(P.C),
        static_cast<uint32_t>(kk), 0u, 0.f, true};
  cx.c.p = p;
  cx.c.lo = rank == 0 ? 0 : seg_start;
  cx.c.hi = rank == G - 1 ? L : head + v1 * VEC;
  cx.c.seg0 = seg_start - VEC;
  cx.c.nslots = v1 - v0 + 2;

  cg::cluster_group cl = cg::this_cluster();
  auto make_out = [&]() {  // built where used: not live across the streaming loop
    Out<F> o;
    o.values = P.values ? static_cast<Raw*>(P.values) + row * P.k : nullptr;
    o.indices = P.idx64 ? static_cast<void*>(static_cast<int64_t*>(P.indices) + row * P.k)
                        : static_cast<void*>(static_cast<int32_t*>(P.indices) + row * P.k);
    o.sel = G > 1 ? cl.map_shared_rank(sel, 0) : sel;
    o.idx64 = P.idx64 != 0;
    o.sorted = P.sorted != 0;
    return o;
  };

#pragma unroll
  for (int q = 0; q < kBins / (4 * NT); ++q)
    reinterpret_cast<uint4*>(sh.hist)[q * NT + tid] = make_uint4(0u, 0u, 0u, 0u);
  if (tid == 0) {
    sh.cnt = 0;
    sh.vend = kNone;
    sh.mx = 0;
    sh.mn = kNone;
    sh.cnt_gt = sh.cnt_eq = sh.tk_gt = sh.tk_eq = sh.tk_ret = 0;
  }
  __syncthreads();

  bool remote_counters = false;  // unsorted G > 1: arrived after the DSMEM atomics
  if (kk == L) {
    // Every element is selected (L <= k, including L == 0): slot = index.
    const Out<F> o = make_out();
    if (o.sorted && G > 1) cluster_sync();  // rank 0 is running before its buffer is written
    for (int e = cx.c.lo + tid; e < cx.c.hi; e += NT) {
      const uint32_t raw = __ldg(p + e);
      o.emit(e, e, raw, F::key(raw));
    }
  } else {
    Sel s{};
    uint32_t D = 0, n = 0;
#pragma unroll 1
    for (int attempt = 0; attempt < 2; ++attempt) {
      cx.stream(attempt == 0, L);
      n = sh.cnt;  // <= C (the last round fitted)
      cx.buffer_range(n);
      D = cx.thr;
      uint32_t MX = sh.mx, MN = sh.mn;
      if (G > 1) {
        if (tid == 0) sh.dr = cx.thr;
        cluster_sync();
        for (int r = 0; r < G; ++r) {
          D = max(D, *cl.map_shared_rank(&sh.dr, r));
          MX = max(MX, *cl.map_shared_rank(&sh.mx, r));
          MN = min(MN, *cl.map_shared_rank(&sh.mn, r));
        }
      }
      s = cx.select(n, D, max(D, MN), MX, static_cast<uint32_t>(kk), G > 1);
      if (s.ok) break;
      // Fewer than K candidates above the estimate: stream again, keeping everything.
      if (tid == 0) {
        sh.cnt = 0;
        sh.mx = 0;
        sh.mn = kNone;
      }
      __syncthreads();
    }
    const Out<F> o = make_out();
    uint32_t base_gt = 0, base_eq = 0;
    if (G > 1) {
      if (tid == 0) {
        sh.base_gt = atomicAdd(cl.map_shared_rank(&sh.cnt_gt, 0), s.gt_local);
        sh.base_eq = atomicAdd(cl.map_shared_rank(&sh.cnt_eq, 0), s.eq_local);
      }
      __syncthreads();
      base_gt = sh.base_gt;
      base_eq = sh.base_eq;
      if (!o.sorted) {
        cluster_arrive();  // rank 0 waits for this before it exits
        remote_counters = true;
      }
    }
    cx.emit_pass(o, n, D, s, base_gt, base_eq, static_cast<uint32_t>(kk) - s.krem);
  }

  const Out<F> o = make_out();
  if (rank == 0) {
    Out<F> og = o;
    og.sorted = false;
    for (int pos = kk + tid; pos < P.k; pos += NT) og.pad(pos);
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
    for (int i = kk + tid; i < n; i += NT) sel[i] = 0ull;  // below every real pair
    __syncthreads();
    sort_desc<NT>(sel, n);
    Out<F> og = o;
    og.sorted = false;
    for (int i = tid; i < kk; i += NT) {
      const int e = static_cast<int>(static_cast<uint32_t>(sel[i]));
      og.emit(i, e, og.values ? __ldg(p + e) : 0u, 0u);
    }
  } else if (remote_counters) {
    cluster_wait();
  }
}

constexpr int kU = 4;  // 16-byte loads per thread and set (two sets in flight)

// Opts every kernel variant into large dynamic shared memory, once per device (on the
// first call, so that a later first use of a variant inside a graph capture needs no
// attribute call).
void set_smem_attributes() {
  static bool done[64] = {};
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev < 64 && done[dev]) return;
  const void* kernels[] = {reinterpret_cast<const void*>(topk_kernel<0, 256, kU>),
                           reinterpret_cast<const void*>(topk_kernel<0, 512, kU>),
                           reinterpret_cast<const void*>(topk_kernel<1, 256, kU>),
                           reinterpret_cast<const void*>(topk_kernel<1, 512, kU>),
                           reinterpret_cast<const void*>(topk_kernel<2, 256, kU>),
                           reinterpret_cast<const void*>(topk_kernel<2, 512, kU>)};
  for (const void* kern : kernels)
    check_cuda(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024),
               "topk: cudaFuncSetAttribute");
  if (dev < 64) done[dev] = true;
}

template <int FMT, int NT>
void launch(const Params& P, int64_t B, int smem, cudaStream_t stream) {
  auto kern = topk_kernel<FMT, NT, kU>;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(B * P.G), 1, 1);
  cfg.blockDim = dim3(NT, 1, 1);
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

// Candidate buffer entries: >= 2k (room to append between compactions); 5632 keeps a
// 256-thread CTA at <= 55 KB, four per SM.
int buffer_entries(int k) { return k <= 2048 ? 5632 : 2 * k + 1024; }

}  // namespace

TopkPlan topk_plan(TopkDtype dtype, int64_t B, int64_t N, int k, bool sorted) {
  (void)dtype;
  const int64_t sms = num_sms();
  int g = 1;  // double while the grid stays within about one wave (two 512-thread CTAs per SM)
  while (g < kMaxCluster && B * 2 * g <= 2 * sms && N / (2 * g) >= kMinPart) g *= 2;
  const int nt = g > 1 ? 512 : 256;
  const int C = buffer_entries(k);
  const int64_t smem = static_cast<int64_t>(sizeof(Shared)) +
                       (sorted ? kTopkMaxK * static_cast<int64_t>(sizeof(unsigned long long)) : 0) +
                       (g > 1 ? (kBins + kBins / 2) * 4 : 0) + 8 * static_cast<int64_t>(C);
  return TopkPlan{g, nt, static_cast<int>(smem)};
}

void topk(const void* x, TopkDtype dtype, int64_t B, int64_t N, int64_t ld, int k,
          const int32_t* lengths, void* values, void* indices, bool idx64, bool sorted,
          cudaStream_t stream) {
  if (B <= 0) return;
  if (k < 1 || k > kTopkMaxK) throw std::runtime_error("deepfuse: topk: k must be in [1, 4096]");
  if (N < 0 || N >= (int64_t{1} << 31)) throw std::runtime_error("deepfuse: topk: N must be < 2^31");
  const TopkPlan plan = topk_plan(dtype, B, N, k, sorted);
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
  P.C = buffer_entries(k);
  P.idx64 = idx64;
  P.sorted = sorted;
  set_smem_attributes();
  const bool wide = plan.threads == 512;
  switch (dtype) {
    case TopkDtype::kBf16:
      wide ? launch<0, 512>(P, B, plan.smem_bytes, stream) : launch<0, 256>(P, B, plan.smem_bytes, stream);
      break;
    case TopkDtype::kF16:
      wide ? launch<1, 512>(P, B, plan.smem_bytes, stream) : launch<1, 256>(P, B, plan.smem_bytes, stream);
      break;
    case TopkDtype::kF32:
      wide ? launch<2, 512>(P, B, plan.smem_bytes, stream) : launch<2, 256>(P, B, plan.smem_bytes, stream);
      break;
    default:
      throw std::runtime_error("deepfuse: topk: bad dtype code");
  }
}

}  // namespace deepfuse
