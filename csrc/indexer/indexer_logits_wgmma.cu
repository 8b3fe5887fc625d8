// indexer_logits_paged on sm_90a (indexer.h): FP8 wgmma with the keys as A and q as B.
//
// One CTA (one warpgroup, 128 threads) per (group of G consecutive tokens, run of 64-entry key
// tiles). The keys of a tile (64 rows of 128 e4m3) land in a 128-byte-swizzled tile (4 stages,
// slot indices prefetched one tile ahead), the A operand of wgmma m64nNk32 e4m3 (M = the 64
// entries, K = the 128 dims): gathered row by row with cp.async, or (a.tma: DEEPFUSE_INDEXER_TMA=1,
// off by default, see kTmaDefault) by TMA when its entries are runs of 16 consecutive rows of one
// page (one box of keys and one of scales per run, thread 0, completing on the stage's mbarrier;
// the CTA decides per tile). q of the group's tokens is quantised once per CTA into B tiles: per
// (token, head) a power-of-two scale s (amax / s in [128, 256)), x = q / s, hi = e4m3(x) and,
// with two terms, lo = e4m3(16 (x - hi)) (exact for |x| >= 2^-6); the B rows of a token are its
// H hi heads, then its H lo heads (N = H * terms), the tokens' B tiles one after the other, so
// one wgmma covers up to kChunkN columns (several tokens). Accumulator column h of row e is
// code_e . hi_h; a thread holds whole rows' quads of columns, so the head sum (ReLU, w_h * s_h)
// runs in registers and over the 4 lanes of a quad: no cross-warp reduction. Every output
// element's products and sums run in the same order whatever G, the chunking or the load path,
// so none of them changes a bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <stdexcept>
#include <type_traits>

#include "common/arch.h"
#include "common/cuda_utils.h"
#include "gemm/tma_sm90.cuh"
#include "gemm/wgmma_e4m3.cuh"
#include "indexer/indexer.h"

#include <cstdlib>

namespace deepfuse {
namespace {

constexpr int kThreads = 128;
constexpr int kTile = 64;    // entries per tile (wgmma M)
constexpr int kRow = 128;    // bytes per key row (K)
constexpr int kTileBytes = kTile * kRow;
constexpr int kStages = 4;   // key tiles per CTA: 3 in flight while one is computed
constexpr int kChunkN = 128;  // most wgmma columns (B rows) per chunk of a group's tokens
// The TMA tile path (indexer_logits_paged_wgmma: DEEPFUSE_INDEXER_TMA overrides this default). Off:
// slower than the gather in every measured case, and an illegal instruction at one GPU test shape
// (docs/notes/indexer.md, "Load paths").
constexpr bool kTmaDefault = false;
// The slot ring (DEEPFUSE_INDEXER_SLOT_RING overrides this default).
constexpr bool kSlotRingDefault = false;

struct WArgs {
  const __nv_bfloat16* q;
  const float* weights;
  const uint8_t* pages;
  int64_t page_bytes, num_pages;
  int page_size, page_shift;  // page_shift >= 0: page_size == 1 << page_shift
  const int64_t* entry_slots;
  int64_t slots_ld;
  const int64_t* token_req;
  const int32_t* n_vis;
  int C;
  float scale;
  float* out;
  int64_t N;
  int tiles_per_cta;
  int tma;   // != 0: key tiles whose entries are runs of 16 consecutive rows of one page come by TMA
  int ring;  // != 0: slot indices staged in shared memory kRingAhead tiles ahead (cp.async)
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 8 : 0));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0));
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}
__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// K-major, 128-byte swizzle, 8-row groups 1024 bytes apart (csrc/gemm's descriptor).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
__device__ __forceinline__ void wgmma_m64n96k32(float (&d)[48], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n96k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,"
      "%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,"
      "%45,%46,%47}, %48, %49, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
      : "l"(da), "l"(db), "r"(scale_d));
}
template <int N>
__device__ __forceinline__ void wgmma_n(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (N == 32) gemm::wgmma_m64n32k32(d, da, db, scale_d);
  else if constexpr (N == 64) gemm::wgmma_m64n64k32(d, da, db, scale_d);
  else if constexpr (N == 96) wgmma_m64n96k32(d, da, db, scale_d);
  else gemm::wgmma_m64n128k32(d, da, db, scale_d);
}
// A box of the 3-D key map (128 bytes x rows x pages) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// Key scales of a stage: rows 16 j .. 16 j + 15 at floats 32 j .. 32 j + 15, so that every run of
// 16 rows (a TMA box) starts on 128 bytes.
constexpr int kScaleSlots = 2 * kTile;
// Slot ring (a.ring): the slots of tile j sit in entry j % kRingTiles, copied kRingAhead tiles
// before the tile's slots are read (they complete kStages - 1 loop groups after being issued).
constexpr int kRingTiles = 8, kRingAhead = kRingTiles - 1;
__device__ __forceinline__ int sidx(int stage, int r) { return stage * kScaleSlots + (r >> 4) * 32 + (r & 15); }

// Byte offset of 16-byte chunk c of row r in a 128-byte-swizzled tile (1024-byte aligned).
__device__ __forceinline__ uint32_t swz(int r, int c) { return r * kRow + ((c ^ (r & 7)) << 4); }

// Shared memory (dynamic, 1024-byte aligned by hand): key stages, the B tiles of G tokens,
// key scales, weights times q scales.
template <int H, int TERMS, int G, int S>
struct Layout {
  static constexpr int kQBytes = TERMS * H * kRow;  // one token's B tile
  static constexpr int kKeys = 0;
  static constexpr int kQ = S * kTileBytes;
  static constexpr int kScale = kQ + G * kQBytes;
  static constexpr int kW = kScale + S * kScaleSlots * 4;
  static constexpr int kBar = (kW + G * H * 4 + 7) / 8 * 8;  // S mbarriers (TMA tiles)
  static constexpr int kRing = kBar + S * 8;                  // kRingTiles x 64 slot indices
  static constexpr int kBytes = kRing + kRingTiles * kTile * 8;
  static constexpr int kAlloc = kBytes + 1024;
};

// Tokens n0 .. n0 + R - 1 (all of request `req`) against entries [e_begin, e_end). `phase`: the
// parity bits of the S stage mbarriers (the kernel's, kept over calls).
template <int H, int TERMS, int G, int R, int S>
__device__ __forceinline__ void rows_pass(const WArgs& a, const CUtensorMap* kmap, const CUtensorMap* smap,
                                          uint8_t* sm, int64_t n0, int64_t req, int e_begin, int e_end,
                                          uint32_t& phase) {
  using L = Layout<H, TERMS, G, S>;
  constexpr int N = H * TERMS;
  constexpr int TPC = N >= kChunkN ? 1 : (R < kChunkN / N ? R : kChunkN / N);  // tokens per wgmma chunk
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int64_t* srow = a.entry_slots + req * a.slots_ld;
  // The CTA's slot indices into L2 first: the tile loop reads them one tile ahead, which would
  // otherwise wait for DRAM once per tile.
  for (int e = e_begin + 16 * tid; e < e_end; e += 16 * kThreads) prefetch_l2(srow + e);
  int live[R];
  int live_end = e_begin;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int nv = min(__ldg(a.n_vis + n0 + r), a.C);
    float* orow = a.out + (n0 + r) * a.C;
    for (int e = max(e_begin, nv) + tid; e < e_end; e += kThreads) orow[e] = -INFINITY;
    live[r] = min(e_end, nv);
    live_end = max(live_end, live[r]);
  }
  if (e_begin >= live_end) return;  // uniform over the CTA
  const uint32_t keys_u32 = smem_u32(sm + L::kKeys), q_u32 = smem_u32(sm + L::kQ);
  const uint32_t ks_u32 = smem_u32(sm + L::kScale), bar_u32 = smem_u32(sm + L::kBar);
  const float* ksc = reinterpret_cast<const float*>(sm + L::kScale);
  float* wq = reinterpret_cast<float*>(sm + L::kW);

  auto page_of = [&](int64_t slot, int64_t& page, int64_t& prow) {
    if (a.page_shift >= 0) {
      page = slot >> a.page_shift;
      prow = slot & ((int64_t(1) << a.page_shift) - 1);
    } else {
      page = slot / a.page_size;
      prow = slot - page * a.page_size;
    }
  };
  // Gather: thread tid copies chunk (tid & 7) of rows (tid >> 3) + 16 k, k < 4, and the scale of
  // those rows (chunk-0 threads). Slot indices come one tile ahead, in registers. With a.tma it
  // also says whether its rows allow the TMA tile: each run of 16 rows that starts before
  // live_end starts at a valid slot whose page holds the whole run, and its visible rows follow
  // that slot one by one (the CTA's AND of this decides the tile).
  const int ch = tid & 7, row0 = tid >> 3;
  const int64_t* ring = reinterpret_cast<const int64_t*>(sm + L::kRing);
  const uint32_t ring_u32 = smem_u32(sm + L::kRing);
  // from_ring: the tile's slots from the ring (a.ring; tiles >= S), else from global memory
  auto fetch_slots = [&](int64_t (&s)[4], int e0, bool from_ring) -> bool {
    const int64_t* rt = ring + ((e0 - e_begin) / kTile % kRingTiles) * kTile;  // rt[i]: entry e0 + i
    auto slot = [&](int i) { return from_ring ? rt[i] : __ldg(srow + e0 + i); };
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int e = e0 + row0 + 16 * k;
      s[k] = e < live_end ? slot(row0 + 16 * k) : -1;
    }
    bool ok = true;
    if (a.tma) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int ec = e0 + 16 * k;  // the run's first entry
        if (row0 == 0) {
          if (ec < live_end) {
            int64_t page, prow;
            page_of(s[k], page, prow);
            ok = ok && s[k] >= 0 && page < a.num_pages && prow + 16 <= a.page_size;
          }
        } else if (ec + row0 < live_end) {
          ok = ok && s[k] == slot(16 * k) + row0;
        }
      }
    }
    return ok;
  };
  auto load_tile = [&](int stage, const int64_t (&s)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int row = row0 + 16 * k;
      const int64_t slot = s[k];
      int64_t page, prow;
      page_of(slot, page, prow);
      const bool ok = slot >= 0 && page < a.num_pages;
      const uint8_t* pbase = a.pages + (ok ? page * a.page_bytes : 0);
      cp_async16(keys_u32 + stage * kTileBytes + swz(row, ch), ok ? pbase + prow * kRow + ch * 16 : a.pages, ok);
      if (ch == 0)
        cp_async4(ks_u32 + sidx(stage, row) * 4, ok ? pbase + int64_t(a.page_size) * kRow + prow * 4 : a.pages,
                  ok);
    }
  };
  // The TMA tile (thread 0, which holds the slots of rows 0, 16, 32, 48: every run's first row):
  // per run that starts before live_end one box of keys (128-byte swizzle, as the cp.async tile)
  // and one of their scales.
  auto tma_tile = [&](int stage, const int64_t (&s)[4], int e0) {
    const int runs = min(kTile, live_end - e0 + 15) / 16;
    const uint32_t bar = bar_u32 + stage * 8;
    tma::mbar_expect_tx(bar, runs * 16 * (kRow + 4));
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int row = 16 * k;
      if (k >= runs) continue;
      int64_t page, prow;
      page_of(s[k], page, prow);
      tma_load_3d(keys_u32 + stage * kTileBytes + row * kRow, kmap, 0, static_cast<int>(prow),
                  static_cast<int>(page), bar);
      tma::tma_load_2d(ks_u32 + sidx(stage, row) * 4, smap, static_cast<int>(prow), static_cast<int>(page), bar);
    }
  };

  const int ntiles = (live_end - e_begin + kTile - 1) / kTile;
  // The slots of tile j into the ring (threads 0..63, one each; past live_end: none).
  auto ring_issue = [&](int j) {
    const int e = e_begin + j * kTile + tid;
    if (tid < kTile) cp_async8(ring_u32 + ((j % kRingTiles) * kTile + tid) * 8, e < live_end ? srow + e : srow,
                               e < live_end);
  };
  uint32_t via_tma = 0;  // stages whose tile comes by TMA
  int64_t nxt[4];
  bool nxt_ok = false;
  {
    int64_t s[S - 1][4];
    bool oks[S - 1];
    if (a.ring)
      for (int j = S; j < S + kRingAhead && j < ntiles; ++j) ring_issue(j);
#pragma unroll
    for (int st = 0; st < S - 1; ++st)
      if (st < ntiles) oks[st] = fetch_slots(s[st], e_begin + st * kTile, false);
    if (S - 1 < ntiles) nxt_ok = fetch_slots(nxt, e_begin + (S - 1) * kTile, false);
#pragma unroll
    for (int st = 0; st < S - 1; ++st) {
      if (st < ntiles) {
        if (a.tma && __syncthreads_and(oks[st])) {
          if (tid == 0) tma_tile(st, s[st], e_begin + st * kTile);
          __syncwarp();
          via_tma |= 1u << st;
        } else {
          load_tile(st, s[st]);
        }
      }
      cp_commit();
    }
  }

  // q of the R tokens -> B tiles (8 threads per (token, head) row, 16 dims each) and w * s.
#pragma unroll
  for (int k = 0; k < R * H / 16; ++k) {
    const int idx = tid + kThreads * k, rr = idx >> 3, c = idx & 7, r = rr / H, h = rr % H;
    const uint4* qp = reinterpret_cast<const uint4*>(a.q + ((n0 + r) * H + h) * kIndexerDim + 16 * c);
    const uint4 v0 = __ldg(qp), v1 = __ldg(qp + 1);
    float x[16];
    const uint32_t wds[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wds[i]));
      x[2 * i] = f.x;
      x[2 * i + 1] = f.y;
    }
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(x[i]));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
    // s = 2^(E - 7) for amax in [2^E, 2^(E + 1)) (biased exponent clamped to >= 8)
    const int eb = max(static_cast<int>((__float_as_uint(amax) >> 23) & 0xff), 8);
    const float inv = __uint_as_float(static_cast<uint32_t>(261 - eb) << 23);
    const float s = __uint_as_float(static_cast<uint32_t>(eb - 7) << 23);
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float a0 = x[2 * i] * inv, a1 = x[2 * i + 1] * inv;
      const __nv_fp8x2_storage_t p = __nv_cvt_float2_to_fp8x2(make_float2(a0, a1), __NV_SATFINITE, __NV_E4M3);
      if (i & 1) hi[i >> 1] |= static_cast<uint32_t>(p) << 16;
      else hi[i >> 1] = p;
      if constexpr (TERMS == 2) {
        const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(p, __NV_E4M3);
        const float2 hf = __half22float2(*reinterpret_cast<const __half2*>(&hr));
        const __nv_fp8x2_storage_t pl = __nv_cvt_float2_to_fp8x2(
            make_float2((a0 - hf.x) * 16.0f, (a1 - hf.y) * 16.0f), __NV_SATFINITE, __NV_E4M3);
        if (i & 1) lo[i >> 1] |= static_cast<uint32_t>(pl) << 16;
        else lo[i >> 1] = pl;
      }
    }
    uint8_t* qt = sm + L::kQ + r * L::kQBytes;
    *reinterpret_cast<uint4*>(qt + swz(h, c)) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    if constexpr (TERMS == 2) *reinterpret_cast<uint4*>(qt + swz(H + h, c)) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    if (c == 0) wq[r * H + h] = __ldg(a.weights + (n0 + r) * H + h) * s;
  }
  fence_proxy_async();  // the B tiles (generic stores) before the wgmmas (async proxy); barrier below

  const int r0 = 16 * warp + g, r1 = r0 + 8;
  // Chunk C0 of the tokens: tokens C0 .. C0 + T - 1 in one wgmma of T * N columns (their B tiles
  // are contiguous), then each token's head sum from its columns.
  auto chunk_issue = [&](auto c0, auto& acc, uint32_t ka) {
    constexpr int C0 = decltype(c0)::value;
    constexpr int NC = (R - C0 < TPC ? R - C0 : TPC) * N;
    __syncwarp();
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k)
      wgmma_n<NC>(acc, smem_desc(ka + 32 * k), smem_desc(q_u32 + C0 * L::kQBytes + 32 * k), k);
    wgmma_commit();
  };
  auto chunk_epilogue = [&](auto c0, auto& acc, int e0, float s0, float s1) {
    constexpr int C0 = decltype(c0)::value;
    constexpr int T = R - C0 < TPC ? R - C0 : TPC;
    wgmma_wait0();
    fence_regs(acc);
#pragma unroll
    for (int u = 0; u < T; ++u) {
      const int r = C0 + u;
      const float* w = wq + r * H;
      float p0 = 0.0f, p1 = 0.0f;
#pragma unroll
      for (int j = 0; j < H / 8; ++j) {
        const float2 w2 = *reinterpret_cast<const float2*>(w + 8 * j + 2 * t);
        const int jj = u * (N / 8) + j;
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          float d0 = acc[4 * jj + b], d1 = acc[4 * jj + 2 + b];
          if constexpr (TERMS == 2) {
            d0 = fmaf(acc[4 * (jj + H / 8) + b], 0.0625f, d0);
            d1 = fmaf(acc[4 * (jj + H / 8) + 2 + b], 0.0625f, d1);
          }
          const float wb = b ? w2.y : w2.x;
          p0 = fmaf(wb, fmaxf(d0, 0.0f), p0);
          p1 = fmaf(wb, fmaxf(d1, 0.0f), p1);
        }
      }
      p0 += __shfl_xor_sync(0xffffffffu, p0, 1);
      p1 += __shfl_xor_sync(0xffffffffu, p1, 1);
      p0 += __shfl_xor_sync(0xffffffffu, p0, 2);
      p1 += __shfl_xor_sync(0xffffffffu, p1, 2);
      float* orow = a.out + (n0 + r) * a.C + e0;
      if (t == 0 && e0 + r0 < live[r]) orow[r0] = s0 * p0;
      if (t == 1 && e0 + r1 < live[r]) orow[r1] = s1 * p1;
    }
  };
  auto chunk = [&](auto c0, uint32_t ka, int e0, float s0, float s1) {
    constexpr int C0 = decltype(c0)::value;
    if constexpr (C0 < R) {
      float acc[(R - C0 < TPC ? R - C0 : TPC) * N / 2];
      chunk_issue(c0, acc, ka);
      chunk_epilogue(c0, acc, e0, s0, s1);
    }
  };

  for (int it = 0; it < ntiles; ++it) {
    const int st = it % S, e0 = e_begin + it * kTile;
    cp_wait<S - 2>();
    fence_proxy_async();
    bool refill_tma = false;
    if (a.tma) {
      refill_tma = __syncthreads_and(nxt_ok);
    } else {
      __syncthreads();
    }
    if ((via_tma >> st) & 1) {
      tma::mbar_wait(bar_u32 + st * 8, (phase >> st) & 1);
      phase ^= 1u << st;
    }
    if (a.ring && it + S + kRingAhead < ntiles) ring_issue(it + S + kRingAhead);
    __syncwarp();
    const uint32_t ka = keys_u32 + st * kTileBytes;
    float acc[(R < TPC ? R : TPC) * N / 2];
    chunk_issue(std::integral_constant<int, 0>{}, acc, ka);
    // refill the stage freed by tile it - 1 while the wgmmas run
    if (it + S - 1 < ntiles) {
      const int rs = (it + S - 1) % S;
      if (refill_tma) {
        if (tid == 0) tma_tile(rs, nxt, e0 + (S - 1) * kTile);
        via_tma |= 1u << rs;
      } else {
        load_tile(rs, nxt);
        via_tma &= ~(1u << rs);
      }
      if (it + S < ntiles) nxt_ok = fetch_slots(nxt, e0 + S * kTile, a.ring != 0);
      // else the slots of the tile after into L1 (4 lines), so that fetch reads L1 next time
      const int ep = e0 + (S + 1) * kTile + 16 * tid;
      if (!a.ring && tid < 4 && ep < live_end) prefetch_l1(srow + ep);
    }
    cp_commit();
    __syncwarp();  // converged before the wgmma wait (.aligned)
    const float s0 = a.scale * ksc[sidx(st, r0)], s1 = a.scale * ksc[sidx(st, r1)];
    chunk_epilogue(std::integral_constant<int, 0>{}, acc, e0, s0, s1);
    chunk(std::integral_constant<int, TPC>{}, ka, e0, s0, s1);
    chunk(std::integral_constant<int, 2 * TPC>{}, ka, e0, s0, s1);
    chunk(std::integral_constant<int, 3 * TPC>{}, ka, e0, s0, s1);
  }
}

template <int H, int TERMS, int G, int S>
__global__ void __launch_bounds__(kThreads, (TERMS == 1 && G <= 2 && H == 64) ? 4 : (TERMS == 2 && G == 2) ? 3 : 0)
    indexer_wgmma_kernel(const WArgs a, const __grid_constant__ CUtensorMap kmap,
                         const __grid_constant__ CUtensorMap smap) {
#if DEEPFUSE_SM90A_DEVICE
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sm = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const int64_t n0 = int64_t(blockIdx.x) * G;
  const int rows = a.N - n0 < G ? static_cast<int>(a.N - n0) : G;
  const int e_begin = blockIdx.y * a.tiles_per_cta * kTile;
  const int e_end = min(a.C, e_begin + a.tiles_per_cta * kTile);
  const int64_t req = __ldg(a.token_req + n0);
  if (a.tma) {
    if (threadIdx.x == 0) {
      const uint32_t bar = smem_u32(sm + Layout<H, TERMS, G, S>::kBar);
#pragma unroll
      for (int st = 0; st < S; ++st) tma::mbar_init(bar + 8 * st, 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
      fence_proxy_async();
    }
    __syncthreads();
  }
  uint32_t phase = 0;
  bool shared = rows == G;
  if constexpr (G > 1) {
#pragma unroll
    for (int r = 1; r < G; ++r) shared = shared && (r >= rows || __ldg(a.token_req + n0 + r) == req);
  }
  if (shared) {
    rows_pass<H, TERMS, G, G, S>(a, &kmap, &smap, sm, n0, req, e_begin, e_end, phase);
  } else {
    for (int r = 0; r < rows; ++r) {
      if (r) __syncthreads();
      rows_pass<H, TERMS, G, 1, S>(a, &kmap, &smap, sm, n0 + r, __ldg(a.token_req + n0 + r), e_begin, e_end, phase);
    }
  }
#else
  __trap();  // wgmma: sm_90a only (the launcher picks the mma.sync kernel elsewhere)
#endif
}

// A positive integer from the environment (the launch's tuning knobs), else `fallback`.
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  const int x = v != nullptr ? std::atoi(v) : 0;
  return x > 0 ? x : fallback;
}

template <int H, int TERMS, int G, int S>
void launch(const WArgs& a, const CUtensorMap& kmap, const CUtensorMap& smap, cudaStream_t stream) {
  constexpr int smem = Layout<H, TERMS, G, S>::kAlloc;
  auto* kern = indexer_wgmma_kernel<H, TERMS, G, S>;
  static int resident_of[64] = {};  // per device: the attribute is set once on each
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  int resident = dev < 64 ? resident_of[dev] : 0;
  if (resident == 0) {
    check_cuda(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
               "cudaFuncSetAttribute");
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kern, kThreads, smem) != cudaSuccess) {
      (void)cudaGetLastError();
      resident = 0;
    }
    resident = resident > 0 ? resident : 1;
    if (dev < 64) resident_of[dev] = resident;
  }
  const int64_t groups = ceil_div<int64_t>(a.N, G);
  const int64_t tiles = ceil_div<int64_t>(a.C, kTile);
  // About two waves of resident CTAs: each group's tiles split evenly over at most target / groups
  // CTAs (no short extra wave when the lengths are equal; a second wave evens out ragged ones), at
  // most 128 tiles per CTA; both tunable for measurements.
  const int64_t target = int64_t(num_sms()) * resident * env_int("DEEPFUSE_INDEXER_WAVES", 2);
  const int most = env_int("DEEPFUSE_INDEXER_MAX_TILES", 128);
  const int64_t want = target / groups > 1 ? target / groups : 1;
  int64_t per = ceil_div<int64_t>(tiles, want);
  per = per < 1 ? 1 : per > most ? most : per;
  const int64_t splits = ceil_div<int64_t>(tiles, per);
  WArgs b = a;
  b.tiles_per_cta = static_cast<int>(per);
  kern<<<dim3(static_cast<unsigned>(groups), static_cast<unsigned>(splits)), kThreads, smem, stream>>>(b, kmap, smap);
  check_launch("indexer_wgmma_kernel");
}

template <int H, int TERMS, int S>
void launch_g(const WArgs& a, const CUtensorMap& kmap, const CUtensorMap& smap, int G, cudaStream_t stream) {
  switch (G) {
    case 4: launch<H, TERMS, 4, S>(a, kmap, smap, stream); break;
    case 3: launch<H, TERMS, 3, S>(a, kmap, smap, stream); break;
    case 2: launch<H, TERMS, 2, S>(a, kmap, smap, stream); break;
    default: launch<H, TERMS, 1, S>(a, kmap, smap, stream); break;
  }
}

// A flag from the environment ("0": off, other non-empty values: on), else `fallback`.
bool env_flag(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == 0) return fallback;
  return *v != '0';
}

// The key and scale tensor maps of the TMA tile path: boxes of 16 rows of one page and their
// scales; 0 where the path does not apply (pages of fewer rows, no driver entry point), else 1.
int tma_maps(const uint8_t* pages, int64_t page_bytes, int64_t num_pages, int page_size, CUtensorMap& kmap,
             CUtensorMap& smap) {
  const int box = 16;
  if (page_size < box || num_pages <= 0 || num_pages > 0x7fffffff || page_bytes % 16 != 0 ||
      reinterpret_cast<uintptr_t>(pages) % 16 != 0)
    return 0;
  const auto encode = tma::encode_tiled();
  if (encode == nullptr) return 0;
  const cuuint32_t es[3] = {1, 1, 1};
  const cuuint64_t kdims[3] = {static_cast<cuuint64_t>(kRow), static_cast<cuuint64_t>(page_size),
                               static_cast<cuuint64_t>(num_pages)};
  const cuuint64_t kstrides[2] = {static_cast<cuuint64_t>(kRow), static_cast<cuuint64_t>(page_bytes)};
  const cuuint32_t kbox[3] = {static_cast<cuuint32_t>(kRow), static_cast<cuuint32_t>(box), 1};
  if (encode(&kmap, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<uint8_t*>(pages), kdims, kstrides, kbox, es,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return 0;
  const cuuint64_t sdims[2] = {static_cast<cuuint64_t>(page_size), static_cast<cuuint64_t>(num_pages)};
  const cuuint64_t sstrides[1] = {static_cast<cuuint64_t>(page_bytes)};
  const cuuint32_t sbox[2] = {static_cast<cuuint32_t>(box), 1};
  if (encode(&smap, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<uint8_t*>(pages) + int64_t(page_size) * kRow,
             sdims, sstrides, sbox, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return 0;
  return 1;
}

}  // namespace

void indexer_logits_paged_wgmma(const void* q, int H, int q_terms, const float* weights, const uint8_t* pages,
                                int64_t page_bytes, int64_t num_pages, int page_size, const int64_t* entry_slots,
                                int64_t slots_ld, int64_t num_reqs, const int64_t* token_req, const int32_t* n_vis,
                                int64_t N, int C, float scale, float* out, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  if (N > 0x7fffffff) throw std::invalid_argument("deepfuse: indexer_logits_paged: too many tokens");
  int shift = -1;
  if (page_size > 0 && (page_size & (page_size - 1)) == 0) {
    shift = 0;
    while ((1 << shift) < page_size) ++shift;
  }
  const WArgs a{static_cast<const __nv_bfloat16*>(q), weights, pages, page_bytes, num_pages, page_size, shift,
                entry_slots, slots_ld, token_req, n_vis, C, scale, out, N, 1, 0, 0};
  CUtensorMap kmap{}, smap{};
  WArgs b = a;
  if (env_flag("DEEPFUSE_INDEXER_TMA", kTmaDefault))
    b.tma = tma_maps(pages, page_bytes, num_pages, page_size, kmap, smap);
  b.ring = env_flag("DEEPFUSE_INDEXER_SLOT_RING", kSlotRingDefault) ? 1 : 0;
  const int G = indexer_rows_per_cta(N, num_reqs);
  if (H == 64 && q_terms == 2) launch_g<64, 2, kStages>(b, kmap, smap, G, stream);
  else if (H == 64 && q_terms == 1) launch_g<64, 1, kStages>(b, kmap, smap, G, stream);
  else if (H == 32 && q_terms == 2) launch_g<32, 2, kStages>(b, kmap, smap, G, stream);
  else if (H == 32 && q_terms == 1) launch_g<32, 1, kStages>(b, kmap, smap, G, stream);
  else throw std::invalid_argument("deepfuse: indexer_logits_paged: H must be 32 or 64, q_terms 1 or 2");
}

}  // namespace deepfuse
