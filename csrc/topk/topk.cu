// Row-wise top-k: a sampled threshold, one streaming pass that keeps only candidates, and a
// select over the candidates alone.
//
// Keys: a float's bits become an unsigned integer of the same width whose order is the
// float order (negative: all bits flipped; non-negative: sign bit set). Every NaN maps to
// the all-ones key, above +inf. bf16/fp16 give 16-bit keys, fp32 32-bit keys.
//
// Why not a radix select over the whole row: for real-valued data the top digit of the key
// falls into a few dozen bins, so a histogram of every element serialises on shared-memory
// atomics to the same addresses. Only ~1K samples and the ~K candidates are histogrammed.
// Small rows are a chain of dependent steps on one SM, so the design counts barriers and
// round trips (tools/topk_probe.cu times each phase; docs/notes/topk-perf.md).
//
// Work split: a row is handled by G CTAs (G in {1, 2, 4, 8}; a thread-block cluster when
// G > 1). G > 1 only while B * G fits one CTA per SM and each part keeps >= 16K elements.
// CTAs: 512 threads (one per SM, 128 registers) while B <= #SMs, else 256 (up to 4 per SM).
//
// Per row, with K = min(k, L) (L: the row's length) and a candidate buffer of C >= 2K + 1024
// (raw bits, index) pairs in rank 0's shared memory:
//   sample   (L > C or L > 2K + 2048) 1024 elements in runs of 8 (16-bit) / 4 (fp32) spread
//            over the row; two histogram levels (top 11 key bits, then 5) give thr = the
//            r-th largest sample (16-bit keys; fp32: to 16 bits), r = Ks + 3 sqrt(Ks) + 6
//            (Ks = K * 1024 / L). Every CTA of a cluster reads the same samples: the same
//            thr, no exchange. The row's first loads are in flight meanwhile.
//   stream   each CTA reads its part once (16-byte loads, two sets of U per thread in
//            flight); a float compare against thr (exact while thr < key(+inf)) drops almost
//            every element; survivors go to rank 0's buffer with one reservation per warp
//            and round (warp scan + one atomic, DSMEM for G > 1): no barrier in the loop.
//   fallback rank 0 alone, rare: the buffer overflowed (thr far too low; keep thr) or fewer
//            than K keys were above thr (restart from 0). The whole row is streamed again
//            with block-wide appends (a barrier per round); on overflow the CTA keeps the K
//            largest buffered keys (select + in-place compaction) and raises thr.
//   select   rank 0: histograms of (key - base) >> shift over the current range [base,
//            base + span] (shift: the range fits 2048 bins), starting from [thr, max key];
//            one level resolves any range of < 2048 keys (bf16 candidates usually), at most
//            three for fp32. Bucket search: the warps sum 16 rows of 128 bins, warp 0
//            scans rows then bins (find_bucket).
//   output   one block scan of packed (above, equal) counts over runs of candidates gives
//            every thread its slots: keys above the K-th to [0, K - krem), the first krem
//            equal to it after them. sorted: (key, index) pairs are bitonic-sorted in
//            shared memory first. Rows shorter than k are padded (index -1, value -inf).
// Invariants: every dropped element has key <= thr; every buffered key is >= thr; after a
// compaction the buffer holds >= K keys >= thr (a valid top-K of what was read).
// L <= k: every element is selected and goes to the slot equal to its index (rank 0).
#include <cooperative_groups.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "common/cuda_utils.h"
#include "topk/topk.h"

namespace deepfuse {
namespace {

namespace cg = cooperative_groups;

constexpr int kBins = 2048;  // digit: 11 bits
constexpr int kMaxCluster = 8;
constexpr int kMinPart = 16384;  // do not split rows into parts smaller than this
constexpr int kSamples = 1024;   // elements in the threshold sample
constexpr int kBig = 512;        // threads per CTA while B <= #SMs (one per SM, 128 registers)
constexpr unsigned kFull = 0xffffffffu;

// Build with -DDEEPFUSE_TOPK_PROBE (tools/topk_probe.cu) to record per-CTA phase clocks.
#ifdef DEEPFUSE_TOPK_PROBE
__device__ unsigned long long g_topk_probe[4096][32];
#define TOPK_PROBE(i, v) \
  do { if (threadIdx.x == 0 && blockIdx.x < 4096) g_topk_probe[blockIdx.x][i] = (v); } while (0)
#define TOPK_PROBE_ADD(i) \
  do { if (threadIdx.x == 0 && blockIdx.x < 4096) g_topk_probe[blockIdx.x][i] += 1; } while (0)
#else
#define TOPK_PROBE(i, v) do {} while (0)
#define TOPK_PROBE_ADD(i) do {} while (0)
#endif

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
  uint32_t hist[2][kBins];  // zero between uses (find_bucket clears them after its search)
  uint32_t res_bin, res_above, res_cnt, res_total;  // find_bucket result
  uint32_t cnt;   // buffer entries; fast path: the reservation counter (rank 0's for a cluster)
  uint32_t fail;  // fast path (rank 0's): some reservation did not fit
  uint32_t mx;    // largest buffered key (0: none)
  uint32_t wa[2][32], wb[2][32];   // per-warp counts / max keys of a block scan (two phases)
  uint32_t rowt[16];               // find_bucket: totals of the 16 rows of 128 bins
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

// Finds bucket b with S(b+1) < krem <= S(b), S(b) = sum of H over bins >= b, if S(0) >= krem,
// into sh.res_bin / res_above (= S(b+1)) / res_cnt (= H[b]); S(0) into sh.res_total.
// NB = 2048: the warps sum the 16 rows of 128 bins (four per lane, one warp reduction per
// row); warp 0 scans the row totals, then the bins of the row found. NB <= 32: warp 0 scans
// the bins directly. Block-collective (H complete on entry); ends with a barrier after
// which the bins are cleared (the next use of H is always a barrier later).
template <int NT, int NB = kBins>
__device__ __forceinline__ void find_bucket(Shared& sh, uint32_t* H, uint32_t krem) {
  static_assert(NB == 2048 || NB <= 32, "bins");
  constexpr int NW = NT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint4* h4 = reinterpret_cast<uint4*>(H);
  if constexpr (NB == 2048) {
#pragma unroll
    for (int q = warp; q < 16; q += NW) {
      const uint4 v = h4[q * 32 + lane];
      const uint32_t t = __reduce_add_sync(kFull, v.x + v.y + v.z + v.w);
      if (lane == 0) sh.rowt[q] = t;
    }
    __syncthreads();
  }
  if (warp == 0) {
    uint32_t c = NB == 2048 ? (lane < 16 ? sh.rowt[lane] : 0u) : (lane < NB ? H[lane] : 0u);
    uint32_t suf = c;  // inclusive suffix sum over the lanes >= this one
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const uint32_t o = __shfl_down_sync(kFull, suf, off);
      if (lane + off < 32) suf += o;
    }
    const uint32_t above = suf - c;
    if (lane == 0) sh.res_total = suf;
    const uint32_t who = __ballot_sync(kFull, above < krem && above + c >= krem);
    if (who) {
      const int row = __ffs(who) - 1;
      if constexpr (NB == 2048) {
        const uint32_t a0 = __shfl_sync(kFull, above, row);
        const uint4 v = h4[row * 32 + lane];
        const uint32_t t4 = v.x + v.y + v.z + v.w;
        uint32_t s4 = t4;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const uint32_t o = __shfl_down_sync(kFull, s4, off);
          if (lane + off < 32) s4 += o;
        }
        uint32_t run = a0 + s4 - t4;  // bins of the row above this lane's four
        const uint32_t cc[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 3; j >= 0; --j) {
          if (run < krem && run + cc[j] >= krem) {
            sh.res_bin = row * 128 + lane * 4 + j;
            sh.res_above = run;
            sh.res_cnt = cc[j];
          }
          run += cc[j];
        }
      } else if (lane == row) {
        sh.res_bin = row;
        sh.res_above = above;
        sh.res_cnt = c;
      }
    }
  }
  __syncthreads();
  if constexpr (NB == 2048) {
    for (int i = threadIdx.x; i < 512; i += NT) h4[i] = make_uint4(0u, 0u, 0u, 0u);
  } else {
    if (threadIdx.x < NB) H[threadIdx.x] = 0u;
  }
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

// Result of a select over the buffer: whole: the keys >= T are selected; else the keys > T
// and `krem` of those equal to T (T is the K-th largest key).
struct Sel {
  uint32_t T, krem;
  bool whole, ok;
  __device__ __forceinline__ bool gt(uint32_t key) const { return whole ? key >= T : key > T; }
  __device__ __forceinline__ bool eq(uint32_t key) const { return !whole && key == T; }
};

struct Compacted {
  uint32_t thr;
  int ph;
};

template <int FMT, int NT, int U>
__device__ __noinline__ Compacted compact_buffer(Shared& sh, uint32_t* craw, uint32_t* cidx, uint32_t cap, uint32_t kk,
                                                 uint32_t thr, uint32_t cnt, uint32_t mx, int ph);

template <int FMT, int NT, int U>
struct Ctx {
  using F = Fmt<FMT>;
  using Raw = typename F::Raw;
  static constexpr int VEC = 16 / sizeof(Raw);
  static constexpr int KB = F::kBits;

  Shared& sh;      // this CTA's
  Shared* rsh;     // rank 0's (appends, max key, fail flag); &sh for G = 1
  uint32_t* craw;  // this CTA's buffer: raw bits
  uint32_t* cidx;  // this CTA's buffer: element index
  uint32_t* rraw;  // rank 0's buffer (appends)
  uint32_t* ridx;
  Part<F> c;
  int G;  // CTAs of the row (a cluster when > 1); 1 on the fallback path
  uint32_t cap, kk;
  uint32_t thr;  // drop threshold: elements with key <= thr are not buffered
  float tf;      // thr as a float compare (exact while fast)
  bool fast;     // thr < key(+inf): the float compare decides
  bool robust;   // block appends with compaction on overflow (G = 1); else per-warp appends
  bool dead;     // fast path: this warp's append did not fit (it stops; rank 0 sees `fail`)
  int ph;        // block-scan phase (0/1)
  uint32_t cnt;  // G = 1: buffer entries written
  uint32_t mx;   // robust: largest buffered key (0: none); fast: this thread's appended max

  // Exclusive prefix over the warps of a per-warp value published in a[ph][warp] by lane 0
  // (after the caller's barrier): returns the sum over lower warps; `tot` gets the total.
  __device__ __forceinline__ uint32_t warp_prefix(const uint32_t (&a)[2][32], uint32_t& tot) const {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t w = lane < NT / 32 ? a[ph][lane] : 0u;
    tot = __reduce_add_sync(kFull, w);
    return __reduce_add_sync(kFull, lane < warp ? w : 0u);
  }

  __device__ __forceinline__ void set_thr(uint32_t t) {
    thr = t;
    tf = thr_float<F>(t);
    fast = t < F::kKeyPosInf;
  }

  // Fast path: appends this warp's elements of masks m[q] (bit i: element e0[q] + i of v[q])
  // with one reservation on rank 0's counter (no barrier). Warp-collective. Returns false
  // (whole warp, nothing written, rank 0's `fail` set) if it does not fit the buffer.
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
      base = atomicAdd(&rsh->cnt, total);
      if (base + total > cap) rsh->fail = 1u;
    }
    base = __shfl_sync(kFull, base, 31);
    if (base + total > cap) return false;
    uint32_t pos = base + incl - n;
#pragma unroll
    for (int q = 0; q < NV; ++q) {
      for (uint32_t mm = m[q]; mm; mm &= mm - 1u, ++pos) {  // usually zero or one bit
        const int i = __ffs(mm) - 1;
        const uint32_t raw = elem_dyn<VEC>(v[q], i);
        rraw[pos] = raw;
        ridx[pos] = static_cast<uint32_t>(e0[q] + i);
        mx = max(mx, F::key(raw));
      }
    }
    return true;
  }

  // Appends every thread's elements of masks m[q] (bit i: element e0[q] + i of v[q]) at
  // positions from a block scan (no contended atomics). Block-collective. Returns false
  // (uniform; nothing written) if they do not fit the buffer.
  template <int NV>
  __device__ __forceinline__ bool append(const uint4 (&v)[NV], const int (&e0)[NV], const uint32_t (&m)[NV]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint32_t n = 0, mk = 0;
#pragma unroll
    for (int q = 0; q < NV; ++q) {
      n += __popc(m[q]);
      for (uint32_t mm = m[q]; mm; mm &= mm - 1u) mk = max(mk, F::key(elem_dyn<VEC>(v[q], __ffs(mm) - 1)));
    }
    uint32_t incl = n;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const uint32_t o = __shfl_up_sync(kFull, incl, off);
      if (lane >= off) incl += o;
    }
    mk = __reduce_max_sync(kFull, mk);
    if (lane == 31) sh.wa[ph][warp] = incl;
    if (lane == 0) sh.wb[ph][warp] = mk;
    TOPK_PROBE(16, clock64());
    __syncthreads();
    TOPK_PROBE(17, clock64());
    uint32_t tot;
    const uint32_t before = warp_prefix(sh.wa, tot);
    mk = __reduce_max_sync(kFull, lane < NT / 32 ? sh.wb[ph][lane] : 0u);
    const uint32_t base = cnt;
    ph ^= 1;
    if (base + tot > cap) return false;
    uint32_t pos = base + before + incl - n;
#pragma unroll
    for (int q = 0; q < NV; ++q) {
      for (uint32_t mm = m[q]; mm; mm &= mm - 1u, ++pos) {  // usually zero or one bit
        const int i = __ffs(mm) - 1;
        rraw[pos] = elem_dyn<VEC>(v[q], i);
        ridx[pos] = static_cast<uint32_t>(e0[q] + i);
      }
    }
    cnt += tot;
    mx = max(mx, mk);
    return true;
  }

  __device__ __forceinline__ uint32_t exact_mask(const uint4& v) const {
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < VEC; ++i) m |= static_cast<uint32_t>(F::key(elem<VEC>(v, i)) > thr) << i;
    return m;
  }

  // Select of the `need` largest keys >= lo of this CTA's buffer[0, n); every key is <= hi.
  // Each level histograms (key - base) >> shift over the current range [base, base + span]
  // (shift: the range fits 2048 bins), so one level resolves any range of < 2048 keys (bf16
  // candidates usually) and the bins follow the candidates, not fixed digits. ok = false if
  // fewer than `need` keys are >= lo. Uses and clears sh.hist.
  __device__ __forceinline__ Sel select(uint32_t n, uint32_t lo, uint32_t hi, uint32_t need) {
    const int tid = threadIdx.x;
    uint32_t base = lo, span = hi >= lo ? hi - lo : 0u, krem = need;
#pragma unroll 1
    for (int level = 0;; ++level) {
      const int shift = span < kBins ? 0 : 21 - __clz(span);  // (span >> shift) < 2048
      uint32_t* h = sh.hist[(level + 1) & 1];  // level 0: hist[1] (clear), level 1: hist[0], ...
      for (uint32_t i = tid; i < n; i += NT) {
        const uint32_t d = F::key(craw[i]) - base;
        if (d <= span) atomicAdd(h + (d >> shift), 1u);
      }
      __syncthreads();
      if (level == 0) TOPK_PROBE(11, clock64());
      find_bucket<NT>(sh, h, krem);
      if (level == 0) TOPK_PROBE(12, clock64());
      TOPK_PROBE(14, level + 1);
      if (level == 0 && sh.res_total < need) return Sel{0u, 0u, false, false};
      const uint32_t b = sh.res_bin, cnt = sh.res_cnt;
      krem -= sh.res_above;
      base += b << shift;
      if (cnt == krem) return Sel{base, 0u, true, true};  // the whole bucket is selected
      if (shift == 0) return Sel{base, krem, false, true};
      span = min(span - (b << shift), (1u << shift) - 1u);
    }
  }

  // Keeps exactly the selection s of buffer[0, n) at its front, in place: each NT-entry
  // chunk is read, ranked (block scans) and written below its end.
  __device__ void compact_pass(uint32_t n, const Sel& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t lt = (1u << lane) - 1u;
    uint32_t qb = 0, kb = 0;  // equal keys seen, entries kept
    for (uint32_t s0 = 0; s0 < n; s0 += NT) {  // uniform trip count
      const uint32_t i = s0 + threadIdx.x;
      uint32_t raw = 0, idx = 0;
      bool gt = false, eq = false;
      if (i < n) {
        raw = craw[i];
        idx = cidx[i];
        const uint32_t key = F::key(raw);
        gt = s.gt(key);
        eq = s.eq(key);
      }
      const uint32_t qm = __ballot_sync(kFull, eq);
      if (lane == 0) sh.wa[ph][warp] = __popc(qm);
      __syncthreads();
      uint32_t qt;
      const uint32_t qbw = warp_prefix(sh.wa, qt);
      const bool keep = gt || (eq && qb + qbw + __popc(qm & lt) < s.krem);
      qb += qt;
      const uint32_t am = __ballot_sync(kFull, keep);
      if (lane == 0) sh.wb[ph][warp] = __popc(am);
      __syncthreads();  // also: the chunk is read before any of it is overwritten
      uint32_t kt;
      const uint32_t kbw = warp_prefix(sh.wb, kt);
      ph ^= 1;
      if (keep) {
        const uint32_t pos = kb + kbw + __popc(am & lt);
        craw[pos] = raw;
        cidx[pos] = idx;
      }
      kb += kt;
    }
  }

  // Robust path, the buffer [0, cnt) (cnt > K) cannot take the next append: keep its K
  // largest keys and raise thr. Block-collective.
  __device__ __forceinline__ uint32_t compact_now() {
    TOPK_PROBE_ADD(8);
    const uint32_t lo = thr;
    const Sel s = select(cnt, lo, mx, kk);  // cnt > K keys >= lo: cannot fail
    compact_pass(cnt, s);
    __syncthreads();
    return s.T;  // the K kept keys are >= T >= lo
  }

  __device__ __forceinline__ void load(uint4 (&v)[U], int r, int n_in) const {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = (r * U + u) * NT + static_cast<int>(threadIdx.x);
      v[u] = j < n_in ? c.load_interior(1 + j) : make_uint4(0u, 0u, 0u, 0u);
    }
  }

  __device__ __forceinline__ uint32_t mask(const uint4& v) const {
    return fast ? F::ge_mask(v, tf) : exact_mask(v);
  }

  // G = 1: the next append does not fit. Compacts the buffer to K entries, raises thr and
  // loads the next round again (no vector register lives across the out-of-line call).
  __device__ __forceinline__ void compact_reload(uint4 (&nxt)[U], int r, int n_in) {
    const Compacted cp = compact_buffer<FMT, NT, U>(sh, craw, cidx, cap, kk, thr, cnt, mx, ph);
    set_thr(cp.thr);
    ph = cp.ph;
    cnt = kk;
    load(nxt, r + 1, n_in);
  }

  // Robust path: filters the U vectors of round r (interior slots 1 + (r*U + u)*NT + tid)
  // into the buffer (one block append per round); `nxt` holds round r + 1 (in flight). If
  // the append does not fit, the buffer is compacted (when it holds more than K) and the
  // round is appended vector by vector, each read again: one vector per thread adds
  // <= NT * VEC <= C - K entries, so it fits once the buffer holds <= K.
  __device__ __forceinline__ void process(const uint4 (&v)[U], uint4 (&nxt)[U], int r, int n_in) {
    uint32_t m[U];
    int e0[U];
    bool any = false;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = (r * U + u) * NT + static_cast<int>(threadIdx.x);
      e0[u] = c.seg0 + (1 + j) * VEC;
      m[u] = j < n_in ? mask(v[u]) : 0u;
      any |= m[u] != 0u;
    }
#ifdef DEEPFUSE_TOPK_PROBE
    if (r == 0) {  // clock read after the masks exist (data dependency)
      unsigned long long t;
      asm volatile("mov.u64 %0, %%clock64;" : "=l"(t) : "r"(m[0] | m[U - 1]));
      TOPK_PROBE(7, t);
    }
#endif
    if (!robust) {
      if (__any_sync(kFull, any) && !warp_insert<U>(v, e0, m)) dead = true;
      return;
    }
    if (append<U>(v, e0, m)) return;
    if (cnt > kk) compact_reload(nxt, r, n_in);  // else: vector by vector fits as it is
#pragma unroll 1
    for (int u = 0; u < U; ++u) {
      const int j = (r * U + u) * NT + static_cast<int>(threadIdx.x);
#pragma unroll 1
      for (;;) {
        const uint4 v1[1] = {j < n_in ? c.load_interior(1 + j) : make_uint4(0u, 0u, 0u, 0u)};
        const int e1[1] = {c.seg0 + (1 + j) * VEC};
        const uint32_t m1[1] = {j < n_in ? mask(v1[0]) : 0u};
        if (append<1>(v1, e1, m1)) break;
        compact_reload(nxt, r, n_in);
      }
    }
  }

  // Threshold from kSamples elements spread over the row [0, L) (runs of VEC): the lower
  // edge of the bucket (two 11-bit levels) holding the r-th largest sample. 0: keep all.
  // `sv` holds this thread's samples (kSamples / NT). Block-collective.
  __device__ __forceinline__ uint32_t estimate(const uint32_t (&sv)[kSamples / NT], int L) {
    constexpr int SPT = kSamples / NT;
    constexpr int s1 = KB - 11;                 // level 1: top 11 bits
    constexpr int b2 = s1 < 5 ? s1 : 5, s2 = s1 - b2;  // level 2: the next b2 <= 5 bits
#pragma unroll
    for (int i = 0; i < SPT; ++i) atomicAdd(sh.hist[0] + (F::key(sv[i]) >> s1), 1u);
    __syncthreads();
    const float ks = __fdividef(static_cast<float>(kk) * kSamples, static_cast<float>(L));
    float sq;
    asm("sqrt.approx.f32 %0, %1;" : "=f"(sq) : "f"(ks));
    const uint32_t r = static_cast<uint32_t>(ks + 3.f * sq + 6.f);
    find_bucket<NT>(sh, sh.hist[0], min(r, static_cast<uint32_t>(kSamples)));
    if (r >= kSamples) return 0u;
    const uint32_t b1 = sh.res_bin, above = sh.res_above;
#pragma unroll
    for (int i = 0; i < SPT; ++i) {
      const uint32_t key = F::key(sv[i]);
      if ((key >> s1) == b1) atomicAdd(sh.hist[1] + ((key >> s2) & ((1u << b2) - 1u)), 1u);
    }
    __syncthreads();
    find_bucket<NT, (1 << b2)>(sh, sh.hist[1], r - above);
    const uint32_t edge = ((b1 << b2) | sh.res_bin) << s2;
    return edge ? edge - 1u : 0u;  // buffer keys >= the edge
  }

  // One pass over this CTA's part: buffer every element with key > thr (thr0, or from a
  // sample of the row when `estimate` and the row does not fit the buffer).
  __device__ void stream(bool est, uint32_t thr0, int L) {
    constexpr int SPT = kSamples / NT;
    const int tid = threadIdx.x;
    const int n_in = c.nslots - 2;  // interior slots 1 .. nslots - 2
    const int R = (n_in + NT * U - 1) / (NT * U);
    const bool sample = est && (static_cast<uint32_t>(L) > cap || static_cast<uint32_t>(L) > 2 * kk + 2048);
    uint4 A[U], B[U];
    uint32_t sv[SPT];
    if (sample) {
      constexpr int runs = kSamples / VEC;
#pragma unroll
      for (int i = 0; i < SPT; ++i) {
        const int s = i * NT + tid, run = s / VEC;
        const int64_t e = static_cast<int64_t>(run) * (L - VEC) / (runs - 1) + s % VEC;
        sv[i] = __ldg(c.p + e);
      }
    }
    load(A, 0, n_in);  // in flight during the estimate (B after it: registers)
    uint4 ev = make_uint4(0u, 0u, 0u, 0u);  // the two edge slots (lanes 0 and 1 of warp 0)
    const int es = tid == 0 ? 0 : c.nslots - 1;
    if (tid < 2) ev = c.load_edge(es);
    set_thr(sample ? estimate(sv, L) : thr0);
    TOPK_PROBE(9, clock64());
    TOPK_PROBE(10, thr);
    if (G > 1) cluster_wait();  // rank 0's counters are initialised before any append
    if (c.lo < c.seg0 + VEC || c.hi > c.seg0 + (c.nslots - 1) * VEC) {  // uniform: edge elements exist
      const uint4 v1[1] = {ev};
      const int e1[1] = {c.seg0 + es * VEC};
      uint32_t m1[1] = {0u};
      if (tid < 2) {
#pragma unroll
        for (int i = 0; i < VEC; ++i)
          m1[0] |= static_cast<uint32_t>(c.in(e1[0] + i) && F::key(elem<VEC>(ev, i)) > thr) << i;
      }
      if (robust) {
        append<1>(v1, e1, m1);  // the buffer is empty: fits
      } else if (tid < 32 && !warp_insert<1>(v1, e1, m1)) {
        dead = true;
      }
    }
    TOPK_PROBE(13, clock64());
    load(B, 1, n_in);  // all zero (no loads) when R == 1
#pragma unroll 1
    for (int r = 0; r < R && !dead; r += 2) {  // robust: dead stays false
      process(A, B, r, n_in);
      if (r == 0) TOPK_PROBE(15, clock64());
      if (r + 2 < R) load(A, r + 2, n_in);
      if (r + 1 < R && !dead) {
        process(B, A, r + 1, n_in);
        if (r + 3 < R) load(B, r + 3, n_in);
      }
    }
    if (robust) {
      if (tid == 0) {
        sh.cnt = cnt;
        sh.mx = mx;
      }
    } else {
      const uint32_t m = __reduce_max_sync(kFull, mx);
      if ((tid & 31) == 0 && m) atomicMax(&rsh->mx, m);
    }
  }

  // Writes the selection s of buffer[0, n): keys above T to slots [0, K - krem), of those
  // equal to T the first krem (in buffer order) to the slots after them. Each thread takes a
  // run of q = ceil(n / NT) entries; one block scan of the packed (above, equal) counts
  // (n <= C < 2^16) gives every thread its slots.
  __device__ void emit_pass(const Out<F>& o, uint32_t n, const Sel& s, uint32_t above_total) {
    const int lane = threadIdx.x & 31;
    const uint32_t q = (n + NT - 1) / NT;
    const uint32_t i0 = min(threadIdx.x * q, n), i1 = min(i0 + q, n);
    uint32_t mine = 0;
    for (uint32_t i = i0; i < i1; ++i) {
      const uint32_t key = F::key(craw[i]);
      mine += (s.gt(key) ? 0x10000u : 0u) + (s.eq(key) ? 1u : 0u);
    }
    uint32_t incl = mine;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const uint32_t o2 = __shfl_up_sync(kFull, incl, off);
      if (lane >= off) incl += o2;
    }
    if (lane == 31) sh.wa[ph][threadIdx.x >> 5] = incl;
    __syncthreads();
    uint32_t tot;
    const uint32_t excl = warp_prefix(sh.wa, tot) + incl - mine;
    ph ^= 1;
    uint32_t gp = excl >> 16, ep = excl & 0xFFFFu;
    for (uint32_t i = i0; i < i1; ++i) {
      const uint32_t raw = craw[i], key = F::key(raw);
      if (s.gt(key)) {
        o.emit(gp++, static_cast<int>(cidx[i]), raw, key);
      } else if (s.eq(key)) {
        if (ep < s.krem) o.emit(above_total + ep, static_cast<int>(cidx[i]), raw, key);
        ++ep;
      }
    }
  }
};

// Out of line (runs rarely): the streaming loop keeps its registers.
template <int FMT, int NT, int U>
__device__ __noinline__ Compacted compact_buffer(Shared& sh, uint32_t* craw, uint32_t* cidx, uint32_t cap, uint32_t kk,
                                                 uint32_t thr, uint32_t cnt, uint32_t mx, int ph) {
  Ctx<FMT, NT, U> cx{sh, &sh, craw, cidx, craw, cidx, {}, 1, cap, kk, thr, 0.f, true, true, false, ph, cnt, mx};
  const uint32_t t = cx.compact_now();
  return Compacted{t, cx.ph};
}

template <int FMT, int NT, int U>
__global__ void __launch_bounds__(NT, NT == 256 ? 4 : 1) topk_kernel(const Params P) {
  using C_ = Ctx<FMT, NT, U>;
  using F = typename C_::F;
  using Raw = typename F::Raw;
  constexpr int VEC = C_::VEC;

  extern __shared__ __align__(16) unsigned char smem[];
  Shared& sh = *reinterpret_cast<Shared*>(smem);
  unsigned char* dyn = smem + sizeof(Shared);
  unsigned long long* sel = reinterpret_cast<unsigned long long*>(dyn);
  if (P.sorted) dyn += kTopkMaxK * sizeof(unsigned long long);
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
  TOPK_PROBE(0, clock64());
  TOPK_PROBE(8, 0ull);

  for (int i = tid; i < 2 * kBins / 4; i += NT) reinterpret_cast<uint4*>(sh.hist)[i] = make_uint4(0u, 0u, 0u, 0u);
  if (tid == 0) {
    sh.cnt = 0;
    sh.fail = 0;
    sh.mx = 0;
  }
  __syncthreads();
  if (G > 1) cluster_arrive();  // waited for before the first remote access

  // Part r of [0, L): whole 16-byte vectors [v0, v1) after the unaligned head [0, head);
  // rank 0 also takes the head, the last rank the tail [head + V * VEC, L).
  const int head = min(static_cast<int>(((16u - (static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p)) & 15u)) &
                                         15u) / sizeof(Raw)), L);
  const int V = (L - head) / VEC;
  auto part = [&](int r, int g) {
    const int vpc = (V + g - 1) / g;
    const int v0 = min(r * vpc, V), v1 = min(v0 + vpc, V);
    Part<F> c;
    c.p = p;
    c.lo = r == 0 ? 0 : head + v0 * VEC;
    c.hi = r == g - 1 ? L : head + v1 * VEC;
    c.seg0 = head + v0 * VEC - VEC;
    c.nslots = v1 - v0 + 2;
    return c;
  };
  auto make_out = [&]() {  // built where used: not live across the streaming loop
    Out<F> o;
    o.values = P.values ? static_cast<Raw*>(P.values) + row * P.k : nullptr;
    o.indices = P.idx64 ? static_cast<void*>(static_cast<int64_t*>(P.indices) + row * P.k)
                        : static_cast<void*>(static_cast<int32_t*>(P.indices) + row * P.k);
    o.sel = sel;
    o.idx64 = P.idx64 != 0;
    o.sorted = P.sorted != 0;
    return o;
  };

  if (kk == L) {
    // Every element is selected (L <= k, including L == 0): rank 0, slot = index.
    if (G > 1) cluster_wait();
    if (rank != 0) return;
    const Out<F> o = make_out();
    for (int e = tid; e < L; e += NT) {
      const uint32_t raw = __ldg(p + e);
      o.emit(e, e, raw, F::key(raw));
    }
  } else {
    cg::cluster_group cl = cg::this_cluster();
    Shared* rsh = G > 1 ? cl.map_shared_rank(&sh, 0) : &sh;
    uint32_t* rraw = G > 1 ? cl.map_shared_rank(craw, 0) : craw;
    uint32_t* ridx = G > 1 ? cl.map_shared_rank(cidx, 0) : cidx;
    C_ cx{sh, rsh, craw, cidx, rraw, ridx, part(rank, G), G, static_cast<uint32_t>(P.C),
          static_cast<uint32_t>(kk), 0u, 0.f, true, false, false, 0, 0u, 0u};
    cx.stream(true, 0u, L);
    TOPK_PROBE(1, clock64());
    if (G > 1) {
      cluster_sync();  // every append landed in rank 0's buffer
      if (rank != 0) return;
    } else {
      __syncthreads();
    }
    TOPK_PROBE(2, clock64());
    TOPK_PROBE(5, sh.cnt);
    TOPK_PROBE(4, 1);
    Sel s{0u, 0u, 0, false};
    const bool overflow = sh.fail != 0;
    if (!overflow) s = cx.select(sh.cnt, cx.thr, sh.mx, static_cast<uint32_t>(kk));
    TOPK_PROBE(3, clock64());
    if (!s.ok) {
      // Rare: the cluster's buffer overflowed (keep thr: more than C keys are above it) or
      // fewer than K keys are above thr (start from 0). Rank 0 streams the whole row with
      // compaction on overflow; that select cannot fail.
      TOPK_PROBE(4, 2);
      const uint32_t t = overflow ? cx.thr : 0u;
      cx.cnt = 0;
      cx.mx = 0;
      cx.robust = true;
      cx.c = part(0, 1);
      cx.G = 1;
      cx.rsh = &sh;
      cx.rraw = craw;
      cx.ridx = cidx;
      cx.dead = false;
      cx.stream(false, t, L);
      __syncthreads();
      s = cx.select(sh.cnt, cx.thr, sh.mx, static_cast<uint32_t>(kk));
    }
    cx.emit_pass(make_out(), sh.cnt, s, static_cast<uint32_t>(kk) - s.krem);
    TOPK_PROBE(6, clock64());
  }

  // Rank 0 from here on.
  const Out<F> o = make_out();
  {
    Out<F> og = o;
    og.sorted = false;
    for (int pos = kk + tid; pos < P.k; pos += NT) og.pad(pos);
  }
  if (o.sorted) {
    __syncthreads();
    if (kk == 0) return;
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
  }
}

constexpr int kU = 4;  // 16-byte loads per thread and set (two sets in flight)

template <int FMT>
void set_attrs(int dev) {
  (void)dev;
  check_cuda(cudaFuncSetAttribute(topk_kernel<FMT, 256, kU>, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024),
             "topk: cudaFuncSetAttribute");
  check_cuda(cudaFuncSetAttribute(topk_kernel<FMT, kBig, kU>, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024),
             "topk: cudaFuncSetAttribute");
  check_cuda(cudaFuncSetAttribute(topk_kernel<FMT, kBig, kU>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1),
             "topk: cudaFuncSetAttribute");
}

// Opts every kernel variant into large dynamic shared memory, once per device (on the
// first call, so that a later first use of a variant inside a graph capture needs no
// attribute call).
void set_smem_attributes() {
  static bool done[64] = {};
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev < 64 && done[dev]) return;
  set_attrs<0>(dev);
  set_attrs<1>(dev);
  set_attrs<2>(dev);
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
  cfg.numAttrs = P.G > 1 ? 1 : 0;
  check_cuda(cudaLaunchKernelEx(&cfg, kern, P), "topk: launch");
  check_launch("topk");
}

// Candidate buffer entries: >= 2K + 1024 (room to append between compactions). Big CTAs
// (one per SM) take a large buffer so that a sampled threshold practically never overflows
// it; 256-thread CTAs stay small enough for four per SM up to k = 512 (three above).
int buffer_entries(int k, int nt) { return nt == kBig ? 16384 : (k <= 512 ? 4096 : 2 * k + 3072); }

}  // namespace

TopkPlan topk_plan(TopkDtype dtype, int64_t B, int64_t N, int k, bool sorted) {
  (void)dtype;
  const int64_t sms = num_sms();
  int g = 1;  // a cluster per row while B * G fits one CTA per SM and parts stay long
  while (g < kMaxCluster && B * 2 * g <= sms && N / (2 * g) >= kMinPart) g *= 2;
  const int nt = B <= sms ? kBig : 256;
  const int C = buffer_entries(k, nt);
  const int64_t smem = static_cast<int64_t>(sizeof(Shared)) +
                       (sorted ? kTopkMaxK * static_cast<int64_t>(sizeof(unsigned long long)) : 0) +
                       8 * static_cast<int64_t>(C);
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
  P.C = buffer_entries(k, plan.threads);
  if (P.C - k < plan.threads * 8) throw std::runtime_error("deepfuse: topk: buffer too small for the plan");
  P.idx64 = idx64;
  P.sorted = sorted;
  set_smem_attributes();
  const bool wide = plan.threads == kBig;
  switch (dtype) {
    case TopkDtype::kBf16:
      wide ? launch<0, kBig>(P, B, plan.smem_bytes, stream) : launch<0, 256>(P, B, plan.smem_bytes, stream);
      break;
    case TopkDtype::kF16:
      wide ? launch<1, kBig>(P, B, plan.smem_bytes, stream) : launch<1, 256>(P, B, plan.smem_bytes, stream);
      break;
    case TopkDtype::kF32:
      wide ? launch<2, kBig>(P, B, plan.smem_bytes, stream) : launch<2, 256>(P, B, plan.smem_bytes, stream);
      break;
    default:
      throw std::runtime_error("deepfuse: topk: bad dtype code");
  }
}

#ifdef DEEPFUSE_TOPK_PROBE
void topk_probe_read(unsigned long long* host, int ctas) {
  check_cuda(cudaMemcpyFromSymbol(host, g_topk_probe, sizeof(unsigned long long) * 32 * ctas), "probe read");
}
#endif

}  // namespace deepfuse
