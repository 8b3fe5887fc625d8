// The general row-wise top-k kernel: a sampled threshold, one streaming pass that keeps only candidates, and a
// select over the candidates alone.
//
// Keys: a float's bits become an unsigned integer of the same width whose order is the
// float order (negative: all bits flipped; non-negative: sign bit set). Every NaN maps to
// the all-ones key, above +inf. bf16/fp16 give 16-bit keys, fp32 32-bit keys.
//
// Why not a radix select over the whole row: for real-valued data the top digit of the key
// falls into a few dozen bins, so a histogram of every element serialises on shared-memory
// atomics to the same addresses, and every element costs a pass of integer work. Only 1-4K
// samples and the ~K candidates are histogrammed. (Aligned rows of <= 2048 16-byte vectors
// go to topk_rows_kernel.cuh, a select over the whole row, cheaper there than this chain of
// phases.) Small rows are a chain of dependent steps on one SM, so the design counts
// barriers and round trips (tools/probes/topk_probe.cu times each phase).
//
// Work split (topk_plan.cpp): a row is handled by G CTAs (G in {1, 2, 4, 8}; a thread-block
// cluster when G > 1). G > 1 only while B * G fits one CTA per SM and each part keeps >= 16K
// elements. B <= #SMs: 512-thread CTAs, one per SM. G = 1: min(B, #SMs) CTAs loop over rows
// and stream through a shared-memory ring filled by bulk copies (TMA); G > 1 (short parts):
// a kernel without the ring, register double buffering. B > #SMs: a 256-thread CTA per row
// (up to 4 per SM, their phases overlap), register double buffering.
//
// Per row, with K = min(k, L) (L: the row's length) and a candidate buffer of C >= 2K + 2048
// (raw bits, index) pairs in rank 0's shared memory:
//   sample   (L > C or L > 2K + 2048) whole 16-byte vectors spread evenly over the row,
//            L / 32 elements clamped to [1024, 4096] (G = 1 with 512 threads: split so
//            that each thread holds >= 2; else a vector per thread); two histogram levels
//            (top 11 key bits, then 5) give thr = the r-th largest sample (16-bit keys;
//            fp32: to 16 bits), r = Ks + z (sqrt(Ks) + 2) (Ks = K * samples / L; z = 3 to
//            4.5, growing with B: see topk_plan.cpp). Every CTA of a cluster reads the same
//            samples: the same thr, no exchange. The row's first rounds are in flight.
//   stream   each CTA reads its part once; packed compares against thr (exact while thr <
//            key(+inf)) give an element mask per 16-byte vector; a warp scan or a ballot
//            ranks the survivors, one warp-aggregated atomic reserves their slots in rank
//            0's buffer (DSMEM for G > 1); rows >= 64K elements (G = 1): each warp first
//            fills its own segment (no atomic), then the pool. Sampling long rows more
//            finely keeps the candidates (the costly part of the loop) near K.
//   fallback rank 0 alone, rare (512 threads: out of line): the buffer overflowed (thr
//            far too low; keep thr) or fewer than K keys were above thr (512 threads:
//            retry from the same sample at z + 3, then from 0; 256 threads: from 0).
//            The whole row is streamed again with block-wide appends (a barrier per
//            round); on overflow the CTA keeps the K largest buffered keys (select +
//            in-place compaction) and raises thr.
//   select   rank 0: histograms of (key - base) >> shift over the current range [base,
//            base + span] (shift: the range fits 2048 bins), starting from [thr, max key];
//            one level resolves any range of < 2048 keys (bf16 candidates usually), at most
//            three for fp32. Bucket search: the warps sum 16 rows of 128 bins, warp 0
//            scans rows then bins (find_bucket).
//   ties     (only when more keys equal the K-th, T, than the krem slots left for them;
//            in bf16 most rows): the krem lowest indices among the n entries == T win, so
//            the selection is the canonical one whatever the buffer's order. n <= 256 (the
//            output): the output pass lists the n entries in shared memory instead of
//            writing them, then each is ranked by its index among them. Else (and for a
//            compaction): the select again over the index among the entries == T (L - 1 -
//            index; 1 level for L <= 2048, 2 up to 4M) gives the largest index kept.
//   output   one block scan of packed (above, equal) counts gives every thread (contiguous
//            buffer: a run of entries each) or warp (segments: ballots rank the lanes) its
//            slots: keys above the K-th to [0, K - krem), the krem chosen equal to it after
//            them. sorted: (key, index) pairs are bitonic-
//            sorted in shared memory first. Rows shorter than k are padded (index -1, -inf).
// Invariants: every dropped element has key <= thr; every buffered key is >= thr; after a
// compaction the buffer holds >= K keys >= thr (a valid top-K of what was read). Canonical
// ties through compactions: the robust stream appends in ascending index order (head,
// rounds, then the tail), a compaction keeps the lowest indices among keys == its T, so an
// element dropped later with key == T (<= thr) has a higher index than the K kept.
// L <= k: every element is selected and goes to the slot equal to its index (rank 0).
#pragma once
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/cuda_utils.h"
#include "topk/topk.h"
#include "topk/topk_common.cuh"
#include "topk/topk_config.h"

// Phase-clock hooks: tools/probes/topk_probe.cu defines them before including this file; the
// library build compiles them to nothing. TOPK_PROBE(i, v): thread 0 records v in slot i;
// TOPK_PROBE_ADD(i): adds 1; TOPK_PROBE_AFTER(i, dep): the clock once `dep` is computed.
#ifndef TOPK_PROBE
#define TOPK_PROBE(i, v) do {} while (0)
#define TOPK_PROBE_ADD(i) do {} while (0)
#define TOPK_PROBE_AFTER(i, dep) do {} while (0)
#endif

namespace deepfuse {
namespace {

namespace cg = cooperative_groups;
using namespace topk_detail;

// The value t of key thr + 1, clamped to [-inf, +inf]: key(x) > thr implies !(x < t) (NaN
// included). For thr < key(+inf) the converse holds too (-0.0 and +0.0 share a key, and
// compare equal as floats).
template <class F>
__device__ __forceinline__ float thr_float(uint32_t thr) {
  const uint32_t t1 = thr >= F::kKeyPosInf ? F::kKeyPosInf : max(thr + 1u, F::kKeyNegInf);
  constexpr uint32_t sign = 1u << (F::kBits - 1);
  constexpr uint32_t all = F::kBits == 32 ? 0xFFFFFFFFu : 0xFFFFu;
  return F::to_float((t1 & sign) ? (t1 ^ sign) : (~t1 & all));
}

__device__ __forceinline__ void mbar_wait(unsigned long long* bar, uint32_t parity) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
  } while (!done);
}

// Where the candidates of rank 0's buffer lie: segment u in [u * S, u * S + segcnt[u]) for
// u < nseg (fast path: one per warp of the row, written without atomics), then the pool
// [pool0, pool0 + pooln) (fast path: reserved with atomics once a warp's segment is full;
// robust path: the whole buffer, nseg = 0).
struct Layout {
  uint32_t S, nseg, pool0, pooln;
};

struct Params : TopkArgs {
  int64_t B;
  int G, C;
  float z;  // threshold margin in standard deviations of the sampled count (TopkPlan::margin)
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


// Elements of a row before its first 16-byte boundary (at most L).
template <class Raw>
__device__ __forceinline__ int row_head(const Raw* p, int L) {
  return min(static_cast<int>(((16u - (static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p)) & 15u)) & 15u) /
                              sizeof(Raw)),
             L);
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

// Result of a select over the buffer: whole: the keys >= T are selected; else the keys > T
// and of the n equal to T the krem with the lowest indices: those with index <= imax, or
// (listed) ranked by the output pass (T is the K-th largest key).
struct Sel {
  uint32_t T, krem;
  bool whole, ok;
  uint32_t imax = 0xFFFFFFFFu;
  uint32_t n = 0;
  bool listed = false;
  __device__ __forceinline__ bool gt(uint32_t key) const { return whole ? key >= T : key > T; }
  // An entry == T (not whole): selected when take(its index).
  __device__ __forceinline__ bool eq(uint32_t key) const { return !whole && key == T; }
  __device__ __forceinline__ bool take(uint32_t idx) const { return idx <= imax; }
};

struct Compacted {
  uint32_t thr;
  int ph;
};

template <int FMT, int NT, int U, bool Ring>
__device__ __noinline__ Compacted compact_buffer(Shared& sh, uint32_t* craw, uint32_t* cidx, uint32_t cap, uint32_t kk,
                                                 uint32_t thr, uint32_t cnt, uint32_t mx, int ph, uint32_t len);

template <int FMT, int NT, int U, bool Ring>
struct Ctx {
  using F = Fmt<FMT>;
  using Raw = typename F::Raw;
  static constexpr int VEC = 16 / sizeof(Raw);
  static constexpr int KB = F::kBits;
  static constexpr bool kRing = Ring;  // bulk copies into a ring (512 threads, G = 1); else registers

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
  int ph;        // block-scan phase (0/1)
  uint32_t cnt;  // G = 1: buffer entries written
  uint32_t mx;   // robust: largest buffered key (0: none); fast: this thread's appended max
  uint32_t S = 0;      // fast path: entries per segment
  uint32_t seg = 0;    // fast path: this warp's segment of rank 0's buffer
  uint32_t pool0 = 0;  // fast path: the pool [pool0, cap) of rank 0's buffer
  uint32_t wc = 0;     // fast path: entries in this warp's segment
  uint4* ring = nullptr;  // streaming stages (see issue)
  uint32_t g0 = 0;        // rounds streamed by this CTA before this stream
  float z = 4.f;          // threshold margin (Params::z)

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
  // to its own segment of rank 0's buffer (no atomic, no barrier; DSMEM for a cluster), or
  // once that is full to the pool (one atomic). Warp-collective. A pool overflow sets rank
  // 0's `fail` (the row restarts on the robust path) and writes nothing.
  template <int NV>
  __device__ __forceinline__ void warp_insert(const uint4 (&v)[NV], const int (&e0)[NV], const uint32_t (&m)[NV]) {
    const int lane = threadIdx.x & 31;
    uint32_t n = 0;
#pragma unroll
    for (int q = 0; q < NV; ++q) n += __popc(m[q]);
    const uint32_t b1 = __ballot_sync(kFull, n != 0u);
    if (b1 == 0u) return;
    uint32_t excl, total;
    if (__all_sync(kFull, n <= 1u)) {  // common: a ballot ranks them
      excl = __popc(b1 & ((1u << lane) - 1u));
      total = __popc(b1);
    } else {
      uint32_t incl = n;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const uint32_t o = __shfl_up_sync(kFull, incl, off);
        if (lane >= off) incl += o;
      }
      excl = incl - n;
      total = __shfl_sync(kFull, incl, 31);
    }
    uint32_t pos;
    if (wc + total <= S) {
      pos = seg * S + wc + excl;
      wc += total;
    } else {
      uint32_t base = 0;
      if (lane == 0) {
        base = atomicAdd(&rsh->cnt, total);
        if (pool0 + base + total > cap) rsh->fail = 1u;
      }
      base = __shfl_sync(kFull, base, 0);
      if (pool0 + base + total > cap) return;
      pos = pool0 + base + excl;
    }
    uint32_t mm = 0;
#pragma unroll
    for (int q = 0; q < NV; ++q) mm |= m[q] << (q * VEC);
    for (; mm; mm &= mm - 1u, ++pos) {  // usually zero or one bit
      const int b = __ffs(mm) - 1, q = b / VEC, i = b % VEC;
      uint4 vq = v[0];
      int e = e0[0];
#pragma unroll
      for (int t = 1; t < NV; ++t) {
        if (q == t) {
          vq = v[t];
          e = e0[t];
        }
      }
      const uint32_t raw = elem_dyn<VEC>(vq, i);
      rraw[pos] = raw;
      ridx[pos] = static_cast<uint32_t>(e + i);
      mx = max(mx, F::key(raw));
    }
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

  // Calls f(i, valid) for each 32-entry chunk of the candidates in `lay` that this warp
  // owns: segments warp, warp + NW, ..., then pool chunks round-robin over the warps. Trip
  // counts are warp-uniform (f may vote); i is an entry of this CTA's buffer when valid.
  template <class Fn>
  __device__ __forceinline__ void for_chunks(const Layout& lay, Fn&& f) const {
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (uint32_t u = warp; u < lay.nseg; u += NT / 32) {
      const uint32_t n = sh.segcnt[u], b = u * lay.S;
      for (uint32_t c = 0; c < n; c += 32) f(b + c + lane, c + lane < n);
    }
    for (uint32_t c = warp * 32; c < lay.pooln; c += NT) f(lay.pool0 + c + lane, c + lane < lay.pooln);
  }

  // Select of the `need` largest keys >= lo of this CTA's candidates `lay`; every key is <= hi;
  // the key of entry i is keyof(i). Each level histograms (key - base) >> shift over the
  // current range [base, base + span] (shift: the range fits 2048 bins), so one level
  // resolves any range of < 2048 keys (bf16 candidates usually) and the bins follow the
  // candidates, not fixed digits. ok = false if fewer than `need` keys are >= lo. Uses and
  // clears sh.hist.
  template <class KeyOf>
  __device__ __forceinline__ Sel select_keys(const Layout& lay, uint32_t lo, uint32_t hi, uint32_t need,
                                             KeyOf&& keyof) {
    uint32_t base = lo, span = hi >= lo ? hi - lo : 0u, krem = need;
#pragma unroll 1
    for (int level = 0;; ++level) {
      const int shift = span < kBins ? 0 : 21 - __clz(span);  // (span >> shift) < 2048
      uint32_t* h = sh.hist[(level + 1) & 1];  // level 0: hist[1] (clear), level 1: hist[0], ...
      for_chunks(lay, [&](uint32_t i, bool ok) {
        if (ok) {
          const uint32_t d = keyof(i) - base;
          if (d <= span) atomicAdd(h + (d >> shift), 1u);
        }
      });
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
      if (shift == 0) return Sel{base, krem, false, true, 0xFFFFFFFFu, cnt};
      span = min(span - (b << shift), (1u << shift) - 1u);
    }
  }

  // The canonical select of the `need` largest keys >= lo (see select_keys) in a row of len
  // elements: when more keys equal the K-th, T, than the krem slots left for them, the krem
  // lowest indices among them win. listed (for the output pass) and <= kTieList of them:
  // left to emit_pass; else a select of the krem largest len - 1 - index over the entries
  // == T (indices are unique, so it ends whole: those with index <= imax).
  __device__ __forceinline__ Sel select(const Layout& lay, uint32_t lo, uint32_t hi, uint32_t need, uint32_t len,
                                        bool listed = false) {
    Sel s = select_keys(lay, lo, hi, need, [&](uint32_t i) { return F::key(craw[i]); });
    if (!s.ok || s.whole) return s;
    if (listed && s.n <= kTieList) {
      s.listed = true;
      return s;
    }
    __syncthreads();  // find_bucket's clearing of sh.hist is done
    const uint32_t T = s.T, top = len - 1u;
    const Sel r = select_keys(lay, 0u, top, s.krem, [&](uint32_t i) {
      return F::key(craw[i]) == T ? top - cidx[i] : 0xFFFFFFFFu;  // not == T: outside [0, top]
    });
    s.imax = top - r.T;
    return s;
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
        eq = s.eq(key) && s.take(idx);
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
  __device__ __forceinline__ uint32_t compact_now(uint32_t len) {
    TOPK_PROBE_ADD(8);
    const uint32_t lo = thr;
    const Sel s = select(Layout{0u, 0u, 0u, cnt}, lo, mx, kk, len);  // cnt > K keys >= lo: cannot fail
    compact_pass(cnt, s);
    __syncthreads();
    return s.T;  // the K kept keys are >= T >= lo
  }

  // The ring: kStages stages of U * NT vectors. Round r (interior slots 1 + r*U*NT .. +
  // U*NT, thread tid's vectors at u*NT + tid) is one bulk copy (TMA) by thread 0 into stage
  // g % kStages, g = g0 + r counting rounds over the CTA's life; full[stage] completes with
  // its bytes, empty[stage] once every warp has read it. The streaming loop also puts a
  // block barrier between reading round r and refilling the stage of round r - 1, for
  // compute-sanitizer: racecheck does not see mbarrier ordering of raw cp.async.bulk writes
  // and reports the refill against those reads (a known false positive; with the barrier
  // it reports nothing; docs/notes/topk-perf.md).
  __device__ __forceinline__ void issue(int r, int n_in) const {
    if (threadIdx.x != 0) return;
    const int first = r * U * NT, nv = min(U * NT, n_in - first);
    if (nv <= 0) return;
    const uint32_t g = g0 + static_cast<uint32_t>(r), st = g & (kStages - 1);
    if (g >= static_cast<uint32_t>(kStages)) mbar_wait(&sh.empty[st], ((g / kStages) - 1) & 1);
    const uint32_t bytes = static_cast<uint32_t>(nv) * 16u;
    const uint32_t full = static_cast<uint32_t>(__cvta_generic_to_shared(&sh.full[st]));
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(ring + st * U * NT));
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(full), "r"(bytes) : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
        "l"(c.p + static_cast<int64_t>(c.seg0 + (1 + first) * VEC)), "r"(bytes), "r"(full)
        : "memory");
  }
  // Register path (no ring): round r's vectors straight from global memory.
  __device__ __forceinline__ void load(uint4 (&v)[U], int r, int n_in) const {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = (r * U + u) * NT + static_cast<int>(threadIdx.x);
      v[u] = j < n_in ? c.load_interior(1 + j) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
  // Round r's vectors (after its bulk copy landed); then this warp releases the stage.
  __device__ __forceinline__ void fetch(uint4 (&v)[U], int r, int n_in) const {
    const uint32_t g = g0 + static_cast<uint32_t>(r), st = g & (kStages - 1);
    mbar_wait(&sh.full[st], (g / kStages) & 1);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = (r * U + u) * NT + static_cast<int>(threadIdx.x);
      v[u] = j < n_in ? ring[(st * U + u) * NT + threadIdx.x] : make_uint4(0u, 0u, 0u, 0u);
    }
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(
                       static_cast<uint32_t>(__cvta_generic_to_shared(&sh.empty[st])))
                   : "memory");
    }
  }

  __device__ __forceinline__ uint32_t mask(const uint4& v) const {
    if (!fast) return exact_mask(v);
    return F::ge_mask(v, tf);
  }

  // G = 1: the next append does not fit. Compacts the buffer to K entries and raises thr.
  __device__ __forceinline__ void compact() {
    const Compacted cp = compact_buffer<FMT, NT, U, Ring>(sh, craw, cidx, cap, kk, thr, cnt, mx, ph,
                                                          static_cast<uint32_t>(c.hi));  // G = 1: c.hi = L
    set_thr(cp.thr);
    ph = cp.ph;
    cnt = kk;
  }

  // Filters round r (the U vectors v) into the buffer. Fast: per-warp appends. Robust: one
  // block append; if it does not fit, the buffer is compacted (when it holds more than K)
  // and the round is appended vector by vector, each read again: one vector per thread
  // adds <= NT * VEC <= C - K entries, so it fits once the buffer holds <= K.
  template <bool Robust>
  __device__ __forceinline__ void process(const uint4 (&v)[U], int r, int n_in) {
    uint32_t m[U];
    int e0[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = (r * U + u) * NT + static_cast<int>(threadIdx.x);
      e0[u] = c.seg0 + (1 + j) * VEC;
      m[u] = j < n_in ? mask(v[u]) : 0u;
    }
    if (r == 0) TOPK_PROBE_AFTER(7, m[0] | m[U - 1]);  // after the masks exist
    if constexpr (!Robust) {
      uint32_t any = 0;
#pragma unroll
      for (int u = 0; u < U; ++u) any |= m[u];
      if (__any_sync(kFull, any != 0u)) warp_insert<U>(v, e0, m);
      if (r == 0) {  // after the insert
        TOPK_PROBE_AFTER(16, wc | mx);
        TOPK_PROBE_AFTER(17, wc | mx);
      }
    } else {
      if (append<U>(v, e0, m)) return;
      if (cnt > kk) compact();  // else: vector by vector fits as it is
#pragma unroll 1
      for (int u = 0; u < U; ++u) {
        const int j = (r * U + u) * NT + static_cast<int>(threadIdx.x);
#pragma unroll 1
        for (;;) {
          const uint4 v1[1] = {j < n_in ? c.load_interior(1 + j) : make_uint4(0u, 0u, 0u, 0u)};
          const int e1[1] = {c.seg0 + (1 + j) * VEC};
          const uint32_t m1[1] = {j < n_in ? mask(v1[0]) : 0u};
          if (append<1>(v1, e1, m1)) break;
          compact();
        }
      }
    }
  }

  // Threshold from a sample of the row: the lower edge of the bucket (11 key bits, then up
  // to 5 more) holding the r-th largest of the ns sampled keys. 0: keep all.
  // Block-collective. sv: this thread's P sampled elements (threads < ns / P hold some).
  template <int P>
  __device__ __forceinline__ uint32_t estimate(const uint4& sv, int ns, int L) {
    constexpr int s1 = KB - 11;                 // level 1: top 11 bits
    constexpr int b2 = s1 < 5 ? s1 : 5, s2 = s1 - b2;  // level 2: the next b2 <= 5 bits
    const bool mine = static_cast<int>(threadIdx.x) * P < ns;
    if (mine) {
#pragma unroll
      for (int i = 0; i < P; ++i) atomicAdd(sh.hist[0] + (F::key(elem<VEC>(sv, i)) >> s1), 1u);
    }
    __syncthreads();
    const float ks = __fdividef(static_cast<float>(kk) * static_cast<float>(ns), static_cast<float>(L));
    float sq;
    asm("sqrt.approx.f32 %0, %1;" : "=f"(sq) : "f"(ks));
    const uint32_t r = static_cast<uint32_t>(fmaxf(ks + z * (sq + 2.f), 1.f));  // z sigma + 2z above the K-th
    find_bucket<NT>(sh, sh.hist[0], min(r, static_cast<uint32_t>(ns)));
    if (r >= static_cast<uint32_t>(ns)) return 0u;
    const uint32_t b1 = sh.res_bin, above = sh.res_above;
    if (mine) {
#pragma unroll
      for (int i = 0; i < P; ++i) {
        const uint32_t key = F::key(elem<VEC>(sv, i));
        if ((key >> s1) == b1) atomicAdd(sh.hist[1] + ((key >> s2) & ((1u << b2) - 1u)), 1u);
      }
    }
    __syncthreads();
    find_bucket<NT, (1 << b2)>(sh, sh.hist[1], r - above);
    const uint32_t edge = ((b1 << b2) | sh.res_bin) << s2;
    return edge ? edge - 1u : 0u;  // buffer keys >= the edge
  }

  // This thread's P elements of the sample: ns elements in whole 16-byte vectors spread
  // evenly over the row, each vector split over VEC / P threads (few elements per thread:
  // the histogram loops are a dependent chain per thread).
  template <int P>
  __device__ __forceinline__ uint4 sample_load(int ns, int L) const {
    constexpr int TPV = VEC / P;
    const int tid = threadIdx.x;
    const int head = row_head(c.p, L);
    const int V = (L - head) / VEC;  // whole vectors of the row (>= ns / VEC: L > 2048)
    const int nv = ns / VEC;
    if (tid * P >= ns) return make_uint4(0u, 0u, 0u, 0u);
    // float, not a 64-bit division (hundreds of cycles of latency)
    const float step = __fdividef(static_cast<float>(V - 1), static_cast<float>(nv - 1));
    const int64_t v = min(static_cast<int>(static_cast<float>(tid / TPV) * step), V - 1);
    const Raw* a = c.p + head + v * VEC + (tid % TPV) * P;
    if constexpr (P * sizeof(Raw) == 16) {
      return __ldg(reinterpret_cast<const uint4*>(a));
    } else if constexpr (P * sizeof(Raw) == 8) {
      const uint2 h = __ldg(reinterpret_cast<const uint2*>(a));
      return make_uint4(h.x, h.y, 0u, 0u);
    } else {
      return make_uint4(__ldg(reinterpret_cast<const uint32_t*>(a)), 0u, 0u, 0u);
    }
  }

  // One pass over this CTA's part: buffer every element with key > thr (thr0, or from a
  // sample of the row when `estimate` and the row does not fit the buffer).
  template <bool Robust>
  __device__ __forceinline__ void stream(bool est, uint32_t thr0, int L) {
    const int tid = threadIdx.x;
    const int n_in = c.nslots - 2;  // interior slots 1 .. nslots - 2
    const int R = (n_in + NT * U - 1) / (NT * U);
    const bool sample = est && (static_cast<uint32_t>(L) > cap || static_cast<uint32_t>(L) > 2 * kk + 2048);
    // ns = L / 32 elements in [1024, 4096] (long rows: fewer candidates per element); P
    // per thread: ns / NT, at least 2, at most a vector
    const int ns = min(min(max(L / 32, 1024), 4096), NT * VEC);
    // (clusters and 256-thread CTAs: a whole vector each, measured faster there; the
    // fallback's retry too: the same samples, the same thr, less code there)
    constexpr bool kSplit = kRing && !Robust;
    const int P = kSplit && G == 1 ? min(max(ns / NT, 2), VEC) : VEC;
    uint4 sv = make_uint4(0u, 0u, 0u, 0u);
    if (sample) {
      if constexpr (kSplit) {
        sv = P == 2 ? sample_load<2>(ns, L) : (P == 4 ? sample_load<4>(ns, L) : sample_load<VEC>(ns, L));
      } else {
        sv = sample_load<VEC>(ns, L);
      }
    }
    uint4 A[kRing ? 1 : U], Bv[kRing ? 1 : U];  // register path: two rounds in flight
    if constexpr (kRing) {
#pragma unroll
      for (int r = 0; r < kStages - 1; ++r) issue(r, n_in);  // in flight during the estimate
    } else {
      load(A, 0, n_in);
    }
    // The two edge slots (lanes 0 and 1 of warp 0). Robust: the head only; the tail after the
    // rounds (appends in index order: see the invariants above).
    constexpr int kEdges = Robust ? 1 : 2;
    uint4 ev = make_uint4(0u, 0u, 0u, 0u);
    const int es = tid == 0 ? 0 : c.nslots - 1;
    if (tid < kEdges) ev = c.load_edge(es);
    if (!sample) {
      set_thr(thr0);
    } else {
      if constexpr (kSplit) {
        set_thr(P == 2 ? estimate<2>(sv, ns, L) : (P == 4 ? estimate<4>(sv, ns, L) : estimate<VEC>(sv, ns, L)));
      } else {
        set_thr(estimate<VEC>(sv, ns, L));
      }
    }
    TOPK_PROBE(9, clock64());
    TOPK_PROBE(10, thr);
    if (G > 1) cluster_wait();  // rank 0's counters are initialised before any append
    if (c.lo < c.seg0 + VEC || c.hi > c.seg0 + (c.nslots - 1) * VEC) {  // uniform: edge elements exist
      const uint4 v1[1] = {ev};
      const int e1[1] = {c.seg0 + es * VEC};
      uint32_t m1[1] = {0u};
      if (tid < kEdges) {
#pragma unroll
        for (int i = 0; i < VEC; ++i)
          m1[0] |= static_cast<uint32_t>(c.in(e1[0] + i) && F::key(elem<VEC>(ev, i)) > thr) << i;
      }
      if constexpr (Robust) {
        append<1>(v1, e1, m1);  // the buffer is empty: fits
      } else {
        if (tid < 32) warp_insert<1>(v1, e1, m1);
      }
    }
    TOPK_PROBE(13, clock64());
    if constexpr (kRing) {
#pragma unroll 1
      for (int r = 0; r < R; ++r) {
        uint4 v[U];
        fetch(v, r, n_in);
        __syncthreads();               // every thread has read rounds <= r (see issue)
        issue(r + kStages - 1, n_in);  // into the stage of round r - 1
        process<Robust>(v, r, n_in);
        if (r == 0) TOPK_PROBE(15, clock64());
      }
      g0 += static_cast<uint32_t>(R);  // every issued round was read
    } else {
      load(Bv, 1, n_in);
#pragma unroll 1
      for (int r = 0; r < R; r += 2) {
        process<Robust>(A, r, n_in);
        if (r == 0) TOPK_PROBE(15, clock64());
        if (r + 2 < R) load(A, r + 2, n_in);
        if (r + 1 < R) {
          process<Robust>(Bv, r + 1, n_in);
          if (r + 3 < R) load(Bv, r + 3, n_in);
        }
      }
    }
    if constexpr (Robust) {
      if (c.hi > c.seg0 + (c.nslots - 1) * VEC) {  // uniform: the tail
        const int e1[1] = {c.seg0 + (c.nslots - 1) * VEC};
        const uint4 v1[1] = {tid == 0 ? c.load_edge(c.nslots - 1) : make_uint4(0u, 0u, 0u, 0u)};
#pragma unroll 1
        for (;;) {
          uint32_t m1[1] = {0u};
          if (tid == 0) {
#pragma unroll
            for (int i = 0; i < VEC; ++i)
              m1[0] |= static_cast<uint32_t>(c.in(e1[0] + i) && F::key(elem<VEC>(v1[0], i)) > thr) << i;
          }
          if (append<1>(v1, e1, m1)) break;
          compact();  // the buffer holds > K (C >= 2K + 2048): then <= VEC entries fit
        }
      }
      if (tid == 0) {
        sh.cnt = cnt;
        sh.mx = mx;
      }
    } else {
      const uint32_t m = __reduce_max_sync(kFull, mx);
      if ((tid & 31) == 0 && m) atomicMax(&rsh->mx, m);
      if ((tid & 31) == 0 && S) rsh->segcnt[seg] = wc;  // S = 0: no segments
    }
  }

  // emit_pass for one contiguous run buffer[b, b + n): each thread takes q = ceil(n / NT)
  // consecutive entries (independent loads, no votes); one block scan of the packed
  // (above, equal) counts gives every thread its first slots.
  __device__ void emit_runs(const Out<F>& o, uint32_t b, uint32_t n, const Sel& s, uint32_t above_total) {
    const int lane = threadIdx.x & 31;
    const uint32_t q = (n + NT - 1) / NT;
    const uint32_t i0 = b + min(threadIdx.x * q, n), i1 = min(i0 + q, b + n);
    uint32_t mine = 0;
    for (uint32_t i = i0; i < i1; ++i) {
      const uint32_t key = F::key(craw[i]);
      mine += (s.gt(key) ? 0x10000u : 0u) + (s.eq(key) && s.take(cidx[i]) ? 1u : 0u);
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
      } else if (s.eq(key) && s.take(cidx[i])) {
        if (s.listed) {
          sh.hist[0][ep] = cidx[i];
          sh.hist[1][ep] = raw;
        } else if (ep < s.krem) {
          o.emit(above_total + ep, static_cast<int>(cidx[i]), raw, key);
        }
        ++ep;
      }
    }
  }

  // Writes the selection s of the candidates `lay`: keys above T to slots [0, K - krem), of
  // those equal to T the krem chosen (s.take) to the slots after them. One block scan
  // of each warp's packed (above << 16 | equal) counts (< C <= 2^16 each) gives every warp
  // its first slots; in each chunk ballots rank the lanes.
  __device__ void emit_pass(const Out<F>& o, const Layout& lay, const Sel& s, uint32_t above_total) {
    if (lay.nseg == 0) {
      emit_runs(o, lay.pool0, lay.pooln, s, above_total);
    } else {
      emit_segs(o, lay, s, above_total);
    }
    if (!s.listed) return;
    // The n entries == T listed (index in hist[0], raw bits in hist[1]; the hist is cleared
    // at the next row's start): each one's rank is the number of lower indices among them.
    __syncthreads();
    for (uint32_t t = threadIdx.x; t < s.n; t += NT) {
      const uint32_t e = sh.hist[0][t];
      uint32_t r = 0;
#pragma unroll 4
      for (uint32_t j = 0; j < s.n; ++j) r += sh.hist[0][j] < e ? 1u : 0u;
      if (r < s.krem) o.emit(above_total + r, static_cast<int>(e), sh.hist[1][t], s.T);
    }
  }

  // emit_pass over per-warp segments and the pool.
  __device__ void emit_segs(const Out<F>& o, const Layout& lay, const Sel& s, uint32_t above_total) {
    const uint32_t lane = threadIdx.x & 31, lt = (1u << lane) - 1u;
    uint32_t mine = 0;
    for_chunks(lay, [&](uint32_t i, bool ok) {
      const uint32_t key = ok ? F::key(craw[i]) : 0u;
      const bool e = ok && s.eq(key) && s.take(cidx[i]);
      mine += (__popc(__ballot_sync(kFull, ok && s.gt(key))) << 16) + __popc(__ballot_sync(kFull, e));
    });
    if (lane == 0) sh.wa[ph][threadIdx.x >> 5] = mine;
    __syncthreads();
    uint32_t tot;
    const uint32_t excl = warp_prefix(sh.wa, tot);
    ph ^= 1;
    uint32_t gp = excl >> 16, ep = excl & 0xFFFFu;
    for_chunks(lay, [&](uint32_t i, bool ok) {
      const uint32_t raw = ok ? craw[i] : 0u, key = F::key(raw);
      const bool g = ok && s.gt(key), e = ok && s.eq(key) && s.take(cidx[i]);
      const uint32_t gb = __ballot_sync(kFull, g), eb = __ballot_sync(kFull, e);
      if (g) {
        o.emit(gp + __popc(gb & lt), static_cast<int>(cidx[i]), raw, key);
      } else if (e) {
        const uint32_t r = ep + __popc(eb & lt);
        if (s.listed) {
          sh.hist[0][r] = cidx[i];
          sh.hist[1][r] = raw;
        } else if (r < s.krem) {
          o.emit(above_total + r, static_cast<int>(cidx[i]), raw, key);
        }
      }
      gp += __popc(gb);
      ep += __popc(eb);
    });
  }
};

// Out of line (runs rarely): the streaming loop keeps its registers.
template <int FMT, int NT, int U, bool Ring>
__device__ __noinline__ Compacted compact_buffer(Shared& sh, uint32_t* craw, uint32_t* cidx, uint32_t cap, uint32_t kk,
                                                 uint32_t thr, uint32_t cnt, uint32_t mx, int ph, uint32_t len) {
  Ctx<FMT, NT, U, Ring> cx{sh, &sh, craw, cidx, craw, cidx, {}, 1, cap, kk, thr, 0.f, true, ph, cnt, mx};
  const uint32_t t = cx.compact_now(len);
  return Compacted{t, cx.ph};
}

struct Refiltered {
  Sel s;
  uint32_t n;  // buffer entries
  int ph;
  uint32_t g0;
};

// The fallback (rare; out of line: the fast path's code stays short, one call site): rank 0
// alone streams the whole row c with block appends and compaction on overflow, then
// selects. After an overflow from thr (more than C keys are above it); else (fewer than K
// keys were above thr) first from thr2, the same sample's threshold at margin z (z + 3:
// the K-th key is below thr2 with P ~ 1 - 1e-9 where thr missed at ~1e-3; few candidates,
// no compaction), and only if that misses too from 0. From thr or 0 the select cannot fail.
template <int FMT, int NT, int U, bool Ring>
__device__ __noinline__ Refiltered refilter(Shared& sh, uint32_t* craw, uint32_t* cidx, Part<Fmt<FMT>> c, uint32_t cap,
                                            uint32_t kk, uint32_t thr, bool overflow, float z, int ph, uint4* ring,
                                            uint32_t g0, int L) {
  Ctx<FMT, NT, U, Ring> cx{sh, &sh, craw, cidx, craw, cidx, c, 1, cap, kk, 0u, 0.f, true, ph, 0u, 0u};
  cx.ring = ring;
  cx.g0 = g0;
  cx.z = z;
  for (int attempt = overflow ? 1 : 0;; ++attempt) {
    if (attempt > 0) TOPK_PROBE(4, 4);
    cx.cnt = 0;
    cx.mx = 0;
    cx.template stream<true>(attempt == 0, overflow ? thr : 0u, L);
    __syncthreads();
    const uint32_t n = sh.cnt;
    const Sel s = cx.select(Layout{0u, 0u, 0u, n}, cx.thr, sh.mx, kk, static_cast<uint32_t>(L), true);
    if (s.ok || attempt > 0) return Refiltered{s, n, cx.ph, cx.g0};
  }
}

template <int FMT, int NT, int U, bool Ring>
__device__ __forceinline__ void topk_row(const Params& P, int64_t row, int rank, uint32_t& rounds) {
  using C_ = Ctx<FMT, NT, U, Ring>;
  using F = typename C_::F;
  using Raw = typename F::Raw;
  constexpr int VEC = C_::VEC;

  extern __shared__ __align__(16) unsigned char smem[];
  Shared& sh = *reinterpret_cast<Shared*>(smem);
  // 512 threads: [Shared][ring (the sorted pairs after streaming)][buffer]; 256 threads:
  // [Shared][sorted pairs, if sorted][buffer].
  uint4* ring = reinterpret_cast<uint4*>(smem + sizeof(Shared));
  unsigned long long* sel = reinterpret_cast<unsigned long long*>(ring);
  const int mid = C_::kRing ? kRingBytes : (P.sorted ? kTopkMaxK * 8 : 0);
  uint32_t* craw = reinterpret_cast<uint32_t*>(smem + sizeof(Shared) + mid);
  uint32_t* cidx = craw + P.C;

  const int G = P.G;
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
  const int head = row_head(p, L);
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
    o.map = P.slot_map ? P.slot_map + (P.map_rows ? __ldg(P.map_rows + row) : int64_t(row)) * P.map_ld : nullptr;
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
          static_cast<uint32_t>(kk), 0u, 0.f, true, 0, 0u, 0u};
    // Per-warp segments (no atomic per append) pay off on long rows; elsewhere one
    // contiguous buffer (a warp-aggregated atomic per append) keeps select and output dense.
    // (the 512-thread register kernel runs clusters only: no segments)
    const uint32_t nseg = (Ring || NT != kBig) && G == 1 && L >= kSegMinLen ? static_cast<uint32_t>(NT / 32) : 0u;
    cx.S = nseg ? static_cast<uint32_t>(P.C) / 2u / nseg : 0u;     // half the buffer; the rest: the pool
    cx.seg = static_cast<uint32_t>(rank) * (NT / 32) + (tid >> 5);
    cx.pool0 = nseg * cx.S;
    cx.ring = ring;
    cx.z = P.z;
    cx.g0 = rounds;
    cx.template stream<false>(true, 0u, L);
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
    Layout lay{cx.S, nseg, cx.pool0, min(sh.cnt, cx.cap - cx.pool0)};
    if (!overflow) s = cx.select(lay, cx.thr, sh.mx, static_cast<uint32_t>(kk), static_cast<uint32_t>(L), true);
    TOPK_PROBE(3, clock64());
    if (!s.ok) {
      // Rare: the cluster's buffer overflowed or fewer than K keys were above thr (see
      // refilter). 256 threads (B > #SMs; inline): from thr after an overflow, else from 0 at
      // once (the sampled retry inline spills there).
      TOPK_PROBE(4, 2);
      const uint32_t t = overflow ? cx.thr : 0u;
      if constexpr (NT == kBig) {  // out of line (measured: faster with 512 threads, slower with 256)
        const Refiltered rf = refilter<FMT, NT, U, Ring>(sh, craw, cidx, part(0, 1), cx.cap, cx.kk, cx.thr, overflow,
                                                         P.z + 3.f, cx.ph, ring, cx.g0, L);
        s = rf.s;
        cx.ph = rf.ph;
        cx.g0 = rf.g0;
        lay = Layout{0u, 0u, 0u, rf.n};
      } else {
        cx.cnt = 0;
        cx.mx = 0;
        cx.c = part(0, 1);
        cx.G = 1;
        cx.rsh = &sh;
        cx.rraw = craw;
        cx.ridx = cidx;
        cx.template stream<true>(false, t, L);
        __syncthreads();
        lay = Layout{0u, 0u, 0u, sh.cnt};
        s = cx.select(lay, cx.thr, sh.mx, static_cast<uint32_t>(kk), static_cast<uint32_t>(L), true);
      }
    }
    rounds = cx.g0;
    cx.emit_pass(make_out(), lay, s, static_cast<uint32_t>(kk) - s.krem);
    TOPK_PROBE(6, clock64());
  }

  // Rank 0 from here on.
  const Out<F> o = make_out();
  finish_row<F, NT>(o, sel, p, kk, P.k);
}

// G > 1: one cluster of G CTAs per row (grid B * G). G = 1: min(B, #SMs) CTAs, each taking
// rows blockIdx.x, + gridDim.x, ... (persistent).
template <int FMT, int NT, int U, bool Ring>
__global__ void __launch_bounds__(NT, NT == kBig ? 1 : 4) topk_kernel(const Params P) {
  extern __shared__ __align__(16) unsigned char smem[];
  Shared& sh = *reinterpret_cast<Shared*>(smem);
  if (Ring && threadIdx.x == 0) {
    for (int st = 0; st < kStages; ++st) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(
                       static_cast<uint32_t>(__cvta_generic_to_shared(&sh.full[st]))));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(
                       static_cast<uint32_t>(__cvta_generic_to_shared(&sh.empty[st]))),
                   "r"(NT / 32));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  uint32_t rounds = 0;  // ring rounds streamed so far (stage and barrier phase)
  if (P.G > 1) {
    const int lg_g = __ffs(P.G) - 1;
    topk_row<FMT, NT, U, Ring>(P, blockIdx.x >> lg_g, static_cast<int>(blockIdx.x & (P.G - 1)), rounds);
    return;
  }
  for (int64_t row = blockIdx.x; row < P.B; row += gridDim.x) {
    topk_row<FMT, NT, U, Ring>(P, row, 0, rounds);
    // The next row reuses shared memory; the ring (the sorted pairs' space) is then written
    // by bulk copies: order this row's generic accesses before them.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
  }
}

template <int FMT>
void set_attrs() {
  check_cuda(cudaFuncSetAttribute(topk_kernel<FMT, kBig, kU, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  227 * 1024),
             "topk: cudaFuncSetAttribute");
  check_cuda(cudaFuncSetAttribute(topk_kernel<FMT, kBig, kU512, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  227 * 1024),
             "topk: cudaFuncSetAttribute");
  check_cuda(cudaFuncSetAttribute(topk_kernel<FMT, kBig, kU512, false>, cudaFuncAttributeNonPortableClusterSizeAllowed,
                                  1),
             "topk: cudaFuncSetAttribute");
  check_cuda(cudaFuncSetAttribute(topk_kernel<FMT, 256, kU256, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  227 * 1024),
             "topk: cudaFuncSetAttribute");
}

// Opts every variant of the general kernel into large dynamic shared memory (current device).
inline void set_general_attributes() {
  set_attrs<0>();
  set_attrs<1>();
  set_attrs<2>();
}

template <int FMT>
void launch(const Params& P, int threads, int smem, cudaStream_t stream) {
  const bool big = threads == kBig;
  cudaLaunchConfig_t cfg = {};
  // 512 threads: a cluster per row (G > 1) or min(B, #SMs) persistent CTAs; 256: a CTA per row.
  const int64_t grid = P.G > 1 ? P.B * P.G : (big ? std::min<int64_t>(P.B, num_sms()) : P.B);
  cfg.gridDim = dim3(static_cast<unsigned>(grid), 1, 1);
  cfg.blockDim = dim3(static_cast<unsigned>(threads), 1, 1);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(P.G);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = P.G > 1 ? 1 : 0;
  if (big) {
    if (P.G > 1) {
      check_cuda(cudaLaunchKernelEx(&cfg, topk_kernel<FMT, kBig, kU512, false>, P), "topk: launch");
    } else {
      check_cuda(cudaLaunchKernelEx(&cfg, topk_kernel<FMT, kBig, kU, true>, P), "topk: launch");
    }
  } else {
    check_cuda(cudaLaunchKernelEx(&cfg, topk_kernel<FMT, 256, kU256, false>, P), "topk: launch");
  }
  check_launch("topk");
}

// The general kernel (plan.kernel == 0) over B rows of `a` (attributes set).
inline void launch_general(const TopkArgs& a, TopkDtype dtype, int64_t B, const TopkPlan& plan, cudaStream_t stream) {
  Params P;
  static_cast<TopkArgs&>(P) = a;
  P.B = B;
  P.G = plan.ctas_per_row;
  P.C = plan.buffer;
  P.z = plan.margin;
  switch (dtype) {
    case TopkDtype::kBf16: launch<0>(P, plan.threads, plan.smem_bytes, stream); break;
    case TopkDtype::kF16: launch<1>(P, plan.threads, plan.smem_bytes, stream); break;
    case TopkDtype::kF32: launch<2>(P, plan.threads, plan.smem_bytes, stream); break;
    default: throw std::runtime_error("deepfuse: topk: bad dtype code");
  }
}

}  // namespace
}  // namespace deepfuse
