// indexer_logits_paged on sm_90a (indexer.h): FP8 wgmma with the keys as A and q as B.
//
// One CTA (one warpgroup, 128 threads) per (group of G consecutive tokens, run of 64-entry key
// tiles). The keys of a tile (64 rows of 128 e4m3) are gathered from their pages with cp.async
// straight into a 128-byte-swizzled tile (4 stages, slot indices prefetched one tile ahead; H 64
// single-token CTAs whose entries are whole pages in order: one TMA box per tile instead), the
// A operand of wgmma m64nNk32 e4m3 (M = the 64 entries, K = the 128 dims). q of the group's
// tokens is quantised once per CTA into B tiles: per (token, head) a power-of-two scale s
// (amax / s in [128, 256)), x = q / s, hi = e4m3(x) and, with two terms, lo = e4m3(16 (x - hi))
// (exact for |x| >= 2^-6); the B rows of a token are its H hi heads, then its H lo heads
// (N = H * terms). Accumulator column h of row e is code_e . hi_h; a thread holds whole rows'
// quads of columns, so the head sum (ReLU, w_h * s_h) runs in registers and over the 4 lanes of
// a quad: no cross-warp reduction. Consecutive tokens of a group may share one wgmma chain (N up
// to 256 columns: chain_cols); each token's products and sums are the same operations in the same
// order whatever G and the chain, so neither changes a bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdlib>
#include <stdexcept>

#include "common/arch.h"
#include "common/cuda_utils.h"
#include "gemm/tma_sm90.cuh"
#include "gemm/wgmma_e4m3.cuh"
#include "indexer/indexer.h"

namespace deepfuse {
namespace {

constexpr int kThreads = 128;
constexpr int kTile = 64;    // entries per tile (wgmma M)
constexpr int kRow = 128;    // bytes per key row (K)
constexpr int kTileBytes = kTile * kRow;
constexpr int kStages = 4;   // key tiles per CTA: 3 in flight while one is computed

// The launcher's choices and their defaults; each has an environment variable, read per call
// (Switches below: benchmarks and tests toggle them; the defaults are the kernel's behaviour).
constexpr int kChainDecode = 256;     // DEEPFUSE_INDEXER_CHAIN: columns per wgmma chain, decode groups
constexpr int kChainPrefill = 256;    // DEEPFUSE_INDEXER_CHAIN_PREFILL: the same, prefill launches
constexpr int kMaxTilesDecode = 32;   // DEEPFUSE_INDEXER_MAX_TILES (8-256): tiles per CTA at most, decode
constexpr int kMaxTilesPrefill = 128; //   and prefill launches (one variable sets both)
constexpr int kPrefillG = 4;          // DEEPFUSE_INDEXER_PREFILL_G (2 / 4): tokens per CTA, prefill
constexpr int kDecodeG = 0;           // DEEPFUSE_INDEXER_DECODE_G (1-4; 0 auto): tokens per CTA at most, decode
constexpr int kDecodeG2Jobs = 192;    //   auto: groups of 4 split in two below this many (group, tile) jobs per SM
constexpr int kStagesSingle = 4;      // DEEPFUSE_INDEXER_STAGES (4 / 5 / 6): key stages, one-token CTAs
// H 64 single-token CTAs (decode next_n 1): whole-page key tiles by TMA, else the gather of 4 whole rows
// per copy instruction (kCopyTma | kCopyLines); off: kTma = 0, kGather = 2 (the sector-pair gather)
constexpr int kTma = 0;               // DEEPFUSE_INDEXER_TMA (0 / 1)
constexpr int kGather = 3;            // DEEPFUSE_INDEXER_GATHER (2 / 3)
constexpr int kQK2 = 1;               // DEEPFUSE_INDEXER_QK2 (0 / 1): exact q's two terms along K (H 64)
constexpr int kSplitWait = 0;         // DEEPFUSE_INDEXER_SPLIT (0 / 1): groups of 4 as two chains, split waits
constexpr int kMaxCtas = 0;           // DEEPFUSE_INDEXER_CTAS (0; 1-8): CTAs per SM at most (padded shared memory)
constexpr int kWaves = 4;             // DEEPFUSE_INDEXER_WAVES (1-16): waves of resident CTAs the grid aims at
// DEEPFUSE_INDEXER_PROBE (0-7, default 0): timing-only kernel variants (kProbe* below).

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
  int tiles_per_cta;  // launch(): the cap in, the CTA's tile count out
  int copy;        // the key copies' scheme (kCopy* bits; the kernels take it as their CP argument)
  int probe;       // DEEPFUSE_INDEXER_PROBE (timing only, wrong scores): kProbe* bits
  int split_wait;  // DEEPFUSE_INDEXER_SPLIT: groups of 4 as two chains of 2 tokens, both issued, waited one by one
  int max_ctas;    // launch(): CTAs per SM at most (0: as many as fit; DEEPFUSE_INDEXER_CTAS)
  int waves;       // launch(): the grid's waves of resident CTAs (DEEPFUSE_INDEXER_WAVES)
  int tma_ok;      // kCopyTma: the key tensor map is valid (a page size that is a multiple of 64)
};

// Key copy schemes (rows_pass; bits of the CP template argument, fixed at compile time so that no
// kernel carries a runtime choice in its copy code): 0 a row's chunks per two threads (the kernels
// of groups of 2-4 tokens and of H 32), kCopyLines 4 whole rows per copy instruction
// (DEEPFUSE_INDEXER_GATHER=3), kCopyTma whole-page tiles by TMA when a CTA's entries allow, else
// the gather (DEEPFUSE_INDEXER_TMA=1). The H 64 single-token kernels exist with each combination.
constexpr int kCopyLines = 1;
constexpr int kCopyTma = 4;

// Measurement probes (DEEPFUSE_INDEXER_PROBE, a kernel variant of its own: the default kernels do
// not carry them): parts of the tile loop switched off to time what is left. Scores are wrong.
constexpr int kProbeNoSums = 1;    // no head sums: each token stores one accumulator per row
constexpr int kProbeNoMma = 2;     // no wgmma: the head sums run on zeros
constexpr int kProbeNoGather = 4;  // no key copies: the tiles keep what shared memory holds

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
// 16 bytes src -> shared dst (zero fill unless ok) with an L2 prefetch of the 128-byte line around
// src (the key copies; 1-2.4% faster than without at decode, H200 2026-12-03; 256 bytes: no gain)
__device__ __forceinline__ void cp_async16_l2(uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// wgmma.wait_group n for n known after unrolling (0-3)
__device__ __forceinline__ void wgmma_wait_n(int n) {
  switch (n) {
    case 0: asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); break;
    case 1: asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); break;
    case 2: asm volatile("wgmma.wait_group.sync.aligned 2;\n" ::: "memory"); break;
    default: asm volatile("wgmma.wait_group.sync.aligned 3;\n" ::: "memory"); break;
  }
}
__device__ __forceinline__ void wgmma_m64n256k32(float (&d)[128], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(scale_d));
}
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// K-major, 128-byte swizzle, 8-row groups 1024 bytes apart (csrc/gemm's descriptor).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
template <int N>
__device__ __forceinline__ void wgmma_n(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (N == 32) gemm::wgmma_m64n32k32(d, da, db, scale_d);
  else if constexpr (N == 64) gemm::wgmma_m64n64k32(d, da, db, scale_d);
  else if constexpr (N == 128) gemm::wgmma_m64n128k32(d, da, db, scale_d);
  else wgmma_m64n256k32(d, da, db, scale_d);
}

// Byte offset of 16-byte chunk c of row r in a 128-byte-swizzled tile (1024-byte aligned).
__device__ __forceinline__ uint32_t swz(int r, int c) { return r * kRow + ((c ^ (r & 7)) << 4); }

// q modes (the TERMS template argument): 1 one e4m3 term (q_fp8); 2 two terms as columns: B rows
// = a token's H hi heads then its H lo heads (N = 2H per token), lo = e4m3(16 (x - hi)), merged
// in the head sums; 3 two terms along K (DEEPFUSE_INDEXER_QK2): B = [hi | lo] over K = 256 against
// the key tile twice (8 k-steps into one accumulator of H columns per token), lo = e4m3(x - hi)
// unscaled (exact for |x| >= 2^-2, i.e. elements >= 2^-9 of their head's amax; below, an error
// <= 2^-10 s): the tensor work of 2, the accumulators, chains and head sums of 1. Mode 3 keeps
// the hi rows of all G tokens in one block and their lo rows in a second (G H rows each).
constexpr int q_cols(int TERMS) { return TERMS == 2 ? 2 : 1; }   // B columns per head
constexpr int q_bytes(int TERMS) { return TERMS == 1 ? 1 : 2; }  // B bytes per head and dim

// Shared memory (dynamic, 1024-byte aligned by hand): key stages, the B tiles of G tokens,
// key scales, weights times q scales.
template <int H, int TERMS, int G, int S>
struct Layout {
  static constexpr int kQBytes = q_bytes(TERMS) * H * kRow;  // one token's B tile (mode 3: hi and lo blocks)
  static constexpr int kKeys = 0;
  static constexpr int kQ = S * kTileBytes;
  static constexpr int kScale = kQ + G * kQBytes;
  static constexpr int kW = kScale + S * kTile * 4;
  static constexpr int kBar = (kW + G * H * 4 + 7) / 8 * 8;  // S mbarriers (kCopyTma)
  static constexpr int kBytes = kBar + S * 8;
  static constexpr int kAlloc = kBytes + 1024;
  // The kernel's register bound (__launch_bounds__ minimum CTAs per SM): as many CTAs as shared
  // memory allows (228 KB per SM, 1 KB reserved per CTA), at most 5, so that registers never allow
  // fewer (ptxas otherwise took 130 registers where 128 fit: 3 CTAs per SM instead of 4). Kernels
  // that shared memory limits to 2 CTAs get none (0): a bound of 2 lets ptxas spend up to 255
  // registers, and the exact-q prefill kernel ran 8% slower so (176 registers; 158 without).
  static constexpr int kSmemCtas = (228 * 1024) / (kAlloc + 1024);
  static constexpr int kMinCtas = kSmemCtas < 3 ? 0 : kSmemCtas < 5 ? kSmemCtas : 5;
};

// Tokens n0 .. n0 + R - 1 (all of request `req`) against entries [e_begin, e_end). Per tile, the
// tokens run in jobs of TPJ consecutive tokens: one wgmma chain over their B tiles (contiguous:
// N = TPJ * H * TERMS columns), then the head sums of each token from the one accumulator.
template <int H, int TERMS, int G, int R, int S, int TPJ, bool PROBE = false, bool SW = false, int CP = 0>
__device__ __forceinline__ void rows_pass(const WArgs& a, const CUtensorMap* kmap, uint8_t* sm, int64_t n0,
                                          int64_t req, int e_begin, int e_end) {
  using L = Layout<H, TERMS, G, S>;
  static_assert(R % TPJ == 0, "jobs of whole tokens");
  constexpr int NT = H * q_cols(TERMS), N = TPJ * NT, J = R / TPJ;  // columns per token, per job; jobs
  constexpr int KS = TERMS == 3 ? 8 : 4;  // k-steps of 32 per chain
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
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
  const int64_t* srow = a.entry_slots + req * a.slots_ld;
  const uint32_t keys_u32 = smem_u32(sm + L::kKeys), q_u32 = smem_u32(sm + L::kQ);
  const uint32_t ks_u32 = smem_u32(sm + L::kScale);
  const float* ksc = reinterpret_cast<const float*>(sm + L::kScale);
  float* wq = reinterpret_cast<float*>(sm + L::kW);

  // Gather, slot indices one tile ahead in registers: thread tid holds the slot, page address and
  // (even threads) the scale copy of row tid >> 1, so each warp gathers 16 rows. Copy schemes (CP):
  // pairs (default): thread tid copies chunks 2 i + (tid & 1), i < 4, of its own row: each copy
  // instruction of a warp reads 16 rows x one whole 32-byte sector; kCopyLines: the row addresses
  // go round the warp by shuffle and copy instruction i reads rows 4 i .. 4 i + 3 whole (lane l:
  // chunk l & 7 of row 4 i + (l >> 3)): 4 128-byte lines per instruction instead of 16.
  // Every scheme fills the same bytes.
  auto fetch_slots = [&](int64_t& s, int e0) {
    const int e = e0 + (tid >> 1);
    s = e < live_end ? __ldg(srow + e) : -1;
  };
  auto load_tile = [&](int stage, int64_t slot) {
    if constexpr (PROBE) {
      if (a.probe & kProbeNoGather) return;
    }
    const int row = tid >> 1;
    int64_t page, prow;
    if (a.page_shift >= 0) {
      page = slot >> a.page_shift;
      prow = slot & ((int64_t(1) << a.page_shift) - 1);
    } else {
      page = slot / a.page_size;
      prow = slot - page * a.page_size;
    }
    const bool ok = slot >= 0 && page < a.num_pages;
    const uint8_t* pbase = a.pages + (ok ? page * a.page_bytes : 0);
    const uint8_t* src = ok ? pbase + prow * kRow : a.pages;
    const uint32_t kst = keys_u32 + stage * kTileBytes;
    if constexpr (CP & kCopyLines) {
      // bit 0 of the (16-byte aligned) row address: the row has no key (zero fill)
      const uint64_t v = reinterpret_cast<uint64_t>(src) | (ok ? 0u : 1u);
      const int c = lane & 7;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int rl = 4 * i + (lane >> 3);
        const uint64_t u = __shfl_sync(0xffffffffu, v, 2 * rl);
        cp_async16_l2(kst + swz(16 * warp + rl, c), reinterpret_cast<const uint8_t*>(u & ~uint64_t(1)) + 16 * c,
                      (u & 1) == 0);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int c = 2 * i + (tid & 1);
        cp_async16_l2(kst + swz(row, c), src + 16 * c, ok);
      }
    }
    if ((tid & 1) == 0)
      cp_async4(ks_u32 + (stage * kTile + row) * 4, ok ? pbase + int64_t(a.page_size) * kRow + prow * 4 : a.pages,
                ok);
  };

  const int ntiles = (live_end - e_begin + kTile - 1) / kTile;
  // kCopyTma: when every live entry of the CTA's tiles is row e - t0 of the page that tile t0's
  // first slot starts (a page size that is a multiple of 64, a.tma_ok: the engine's page-ordered
  // lists), each tile is one TMA box of 64 rows (128-byte swizzle: the gather's layout) + one bulk
  // copy of their 256 bytes of scales, issued by thread 0 on the stage's mbarrier; else the gather.
  // Decided once per CTA (its slots read once, one barrier).
  bool tma = false;
  const uint32_t bar_u32 = smem_u32(sm + L::kBar);
  if constexpr (CP & kCopyTma) {
    bool ok = a.tma_ok != 0;
    if (ok) {
      for (int e = e_begin + tid; e < live_end; e += kThreads) {
        const int t0 = e_begin + ((e - e_begin) & ~(kTile - 1));
        const int64_t s0 = __ldg(srow + t0), se = __ldg(srow + e);
        ok = s0 >= 0 && (s0 & (kTile - 1)) == 0 && (s0 >> a.page_shift) < a.num_pages && se == s0 + (e - t0);
        if (!ok) break;
      }
    }
    if (tid == 0) {
      for (int st = 0; st < S; ++st) tma::mbar_init(bar_u32 + 8 * st, 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    tma = __syncthreads_and(ok);
  }
  // thread 0: the tile whose first slot is s0 into stage st by TMA (kCopyTma)
  auto tma_tile = [&](int st, int64_t s0) {
    const int64_t page = s0 >> a.page_shift, prow = s0 & ((int64_t(1) << a.page_shift) - 1);
    const uint32_t bar = bar_u32 + 8 * st;
    tma::mbar_expect_tx(bar, kTileBytes + kTile * 4);
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
            keys_u32 + st * kTileBytes),
        "l"(reinterpret_cast<uint64_t>(kmap)), "r"(0), "r"(static_cast<int>(prow)), "r"(static_cast<int>(page)), "r"(bar)
        : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     ks_u32 + st * kTile * 4),
                 "l"(a.pages + page * a.page_bytes + int64_t(a.page_size) * kRow + prow * 4), "r"(kTile * 4), "r"(bar)
                 : "memory");
  };
  int64_t nxt = -1;
  if (tma) {  // thread 0 holds the first slot of the next tile to copy in nxt
    if (tid == 0) {
      for (int st = 0; st < S - 1 && st < ntiles; ++st) tma_tile(st, __ldg(srow + e_begin + st * kTile));
      if (S - 1 < ntiles) nxt = __ldg(srow + e_begin + (S - 1) * kTile);
    }
  } else {
    int64_t s[S - 1];
#pragma unroll
    for (int st = 0; st < S - 1; ++st)
      if (st < ntiles) fetch_slots(s[st], e_begin + st * kTile);
    if (S - 1 < ntiles) fetch_slots(nxt, e_begin + (S - 1) * kTile);
#pragma unroll
    for (int st = 0; st < S - 1; ++st) {
      if (st < ntiles) load_tile(st, s[st]);
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
      if constexpr (TERMS >= 2) {
        const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(p, __NV_E4M3);
        const float2 hf = __half22float2(*reinterpret_cast<const __half2*>(&hr));
        constexpr float kLo = TERMS == 2 ? 16.0f : 1.0f;
        const __nv_fp8x2_storage_t pl = __nv_cvt_float2_to_fp8x2(
            make_float2((a0 - hf.x) * kLo, (a1 - hf.y) * kLo), __NV_SATFINITE, __NV_E4M3);
        if (i & 1) lo[i >> 1] |= static_cast<uint32_t>(pl) << 16;
        else lo[i >> 1] = pl;
      }
    }
    if constexpr (TERMS == 3) {  // row r H + h of the hi block and of the lo block
      uint8_t* qt = sm + L::kQ;
      *reinterpret_cast<uint4*>(qt + swz(r * H + h, c)) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
      *reinterpret_cast<uint4*>(qt + G * H * kRow + swz(r * H + h, c)) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    } else {
      uint8_t* qt = sm + L::kQ + r * L::kQBytes;
      *reinterpret_cast<uint4*>(qt + swz(h, c)) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
      if constexpr (TERMS == 2) *reinterpret_cast<uint4*>(qt + swz(H + h, c)) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
    if (c == 0) wq[r * H + h] = __ldg(a.weights + (n0 + r) * H + h) * s;
  }
  fence_proxy_async();  // the B tiles (generic stores) before the wgmmas (async proxy); barrier below

  // B of job k (tokens k TPJ ..), k-step kk: mode 3 reads the hi block for kk < 4, the lo block after
  auto b_addr = [&](int k, int kk) -> uint32_t {
    if constexpr (TERMS == 3)
      return q_u32 + (kk >= 4 ? G * H * kRow : 0) + k * TPJ * H * kRow + 32 * (kk & 3);
    else
      return q_u32 + k * TPJ * L::kQBytes + 32 * kk;
  };
  const int r0 = 16 * warp + g, r1 = r0 + 8;
  for (int it = 0; it < ntiles; ++it) {
    const int st = it % S, e0 = e_begin + it * kTile;
    if (tma) {
      tma::mbar_wait(bar_u32 + 8 * st, (it / S) & 1);
    } else {
      cp_wait<S - 2>();
      fence_proxy_async();
    }
    __syncthreads();
    const uint32_t ka = keys_u32 + st * kTileBytes;
    // SW: the chains of all J jobs issued at once into J accumulators, each waited for before its
    // head sums (the later chains run while the earlier sums are computed); else one accumulator,
    // one chain at a time
    constexpr int NA = SW ? J : 1;
    float acc[NA][N / 2];
    const bool mma = !PROBE || !(a.probe & kProbeNoMma);
    if constexpr (PROBE) {
      if (!mma) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) acc[0][i] = 0.0f;
      }
    }
    if (mma) {
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < NA; ++k) {
#pragma unroll
        for (int kk = 0; kk < KS; ++kk)
          wgmma_n<N>(acc[k], smem_desc(ka + 32 * (kk & 3)), smem_desc(b_addr(k, kk)), kk);
        wgmma_commit();
      }
    }
    static_assert(TERMS == 3 || L::kQBytes == NT * kRow, "a job's B tiles are contiguous");
    // refill the stage freed by tile it - 1 while the wgmmas run
    if (tma) {
      if (tid == 0 && it + S - 1 < ntiles) {
        tma_tile((it + S - 1) % S, nxt);
        if (it + S < ntiles) nxt = __ldg(srow + e0 + S * kTile);
      }
    } else {
      if (it + S - 1 < ntiles) {
        load_tile((it + S - 1) % S, nxt);
        if (it + S < ntiles) fetch_slots(nxt, e0 + S * kTile);
      }
      cp_commit();
    }
    const float s0 = a.scale * ksc[st * kTile + r0], s1 = a.scale * ksc[st * kTile + r1];
#pragma unroll
    for (int k = 0; k < J; ++k) {
      float(&ac)[N / 2] = acc[SW ? k : 0];
      if (!SW && k > 0 && mma) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) wgmma_n<N>(ac, smem_desc(ka + 32 * (kk & 3)), smem_desc(b_addr(k, kk)), kk);
        wgmma_commit();
      }
      if constexpr (SW) wgmma_wait_n(J - 1 - k);
      else wgmma_wait0();
      fence_regs(ac);
#pragma unroll
      for (int u = 0; u < TPJ; ++u) {  // token r = k TPJ + u: accumulator columns u NT ..
        const int r = k * TPJ + u, c0 = u * NT / 2;
        const float* w = wq + r * H;
        float p0 = 0.0f, p1 = 0.0f;
        const int jn = PROBE && (a.probe & kProbeNoSums) ? 0 : H / 8;
        if (jn == 0) p0 = ac[c0], p1 = ac[c0 + 2];
#pragma unroll
        for (int j = 0; j < H / 8; ++j) {
          if constexpr (PROBE) {
            if (j >= jn) break;
          }
          const float2 w2 = *reinterpret_cast<const float2*>(w + 8 * j + 2 * t);
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            float d0 = ac[c0 + 4 * j + b], d1 = ac[c0 + 4 * j + 2 + b];
            if constexpr (TERMS == 2) {
              d0 = fmaf(ac[c0 + 4 * (j + H / 8) + b], 0.0625f, d0);
              d1 = fmaf(ac[c0 + 4 * (j + H / 8) + 2 + b], 0.0625f, d1);
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
    }
  }
}

template <int H, int TERMS, int G, int S, int TPJ, bool PROBE = false, bool SW = false, int CP = 0>
__global__ void __launch_bounds__(kThreads, (Layout<H, TERMS, G, S>::kMinCtas))
    indexer_wgmma_kernel(const WArgs a, const __grid_constant__ CUtensorMap kmap) {
#if DEEPFUSE_SM90A_DEVICE
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sm = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const int64_t n0 = int64_t(blockIdx.x) * G;
  const int rows = a.N - n0 < G ? static_cast<int>(a.N - n0) : G;
  const int e_begin = blockIdx.y * a.tiles_per_cta * kTile;
  const int e_end = min(a.C, e_begin + a.tiles_per_cta * kTile);
  const int64_t req = __ldg(a.token_req + n0);
  bool shared = rows == G;
  if constexpr (G > 1) {
#pragma unroll
    for (int r = 1; r < G; ++r) shared = shared && (r >= rows || __ldg(a.token_req + n0 + r) == req);
  }
  if (shared) {
    rows_pass<H, TERMS, G, G, S, TPJ, PROBE, SW, CP>(a, &kmap, sm, n0, req, e_begin, e_end);
  } else {
    for (int r = 0; r < rows; ++r) {
      if (r) __syncthreads();
      rows_pass<H, TERMS, G, 1, S, 1, false, false, CP>(a, &kmap, sm, n0 + r, __ldg(a.token_req + n0 + r), e_begin,
                                                         e_end);
    }
  }
#else
  __trap();  // wgmma: sm_90a only (the launcher picks the mma.sync kernel elsewhere)
#endif
}

// The switches of one call (the constants at the top are their defaults; out-of-range values fall
// back to them). Tiles per CTA: decode 32 (ragged lengths: the CTAs of a long request must not
// finish alone), prefill 128 (one request's keys for many groups: fewer q quantisations and
// pipeline fills). Chains: tokens of a group sharing one accumulator (fewer reads of the key tile
// and fewer waits, more registers); below one token's columns (e.g. 0): one token per chain.
// Decode groups: a smaller cap than indexer_rows_per_cta's group reads each key tile once per
// group (the other groups from L2). Stages: more tiles in flight per one-token CTA, more shared
// memory. Gather 2 / 3 and TMA: the key copy schemes (kCopy*; rows_pass).
int env_int(const char* name, int lo, int hi, int dflt) {
  const char* v = std::getenv(name);
  const int x = v != nullptr ? std::atoi(v) : dflt;
  return x < lo || x > hi ? dflt : x;
}
struct Switches {
  int chain_decode, chain_prefill, max_tiles_decode, max_tiles_prefill, prefill_g, decode_g, stages_single;
  int copy, qk2, split_wait, probe, max_ctas, waves;
  static Switches read() {
    Switches w;
    w.chain_decode = env_int("DEEPFUSE_INDEXER_CHAIN", -1, 1 << 20, kChainDecode);
    w.chain_prefill = env_int("DEEPFUSE_INDEXER_CHAIN_PREFILL", -1, 1 << 20, kChainPrefill);
    const int mt = env_int("DEEPFUSE_INDEXER_MAX_TILES", 8, 256, 0);
    w.max_tiles_decode = mt ? mt : kMaxTilesDecode;
    w.max_tiles_prefill = mt ? mt : kMaxTilesPrefill;
    w.prefill_g = env_int("DEEPFUSE_INDEXER_PREFILL_G", 2, 4, kPrefillG) >= 4 ? 4 : 2;
    w.decode_g = env_int("DEEPFUSE_INDEXER_DECODE_G", 0, 4, kDecodeG);
    const int st = env_int("DEEPFUSE_INDEXER_STAGES", 4, 6, kStagesSingle);
    w.stages_single = st;
    w.copy = (env_int("DEEPFUSE_INDEXER_GATHER", 2, 3, kGather) == 3 ? kCopyLines : 0) |
             (env_int("DEEPFUSE_INDEXER_TMA", 0, 1, kTma) ? kCopyTma : 0);
    w.qk2 = env_int("DEEPFUSE_INDEXER_QK2", 0, 1, kQK2);
    w.split_wait = env_int("DEEPFUSE_INDEXER_SPLIT", 0, 1, kSplitWait);
    w.probe = env_int("DEEPFUSE_INDEXER_PROBE", 0, 7, 0);
    w.max_ctas = env_int("DEEPFUSE_INDEXER_CTAS", 0, 8, kMaxCtas);
    w.waves = env_int("DEEPFUSE_INDEXER_WAVES", 1, 16, kWaves);
    return w;
  }
  // tokens per CTA of a decode group of G (indexer_rows_per_cta) under the cap; auto (0): groups of
  // 4 run as two groups of 2 when there are few (group, tile) jobs (short contexts, few requests:
  // CTAs of a few tiles, whose q and pipeline fill a group of 2 halves; B 64 x C 8K next_n 4 1.14x
  // (q_fp8) / 1.24x (exact), B 64 x C 64K: G 4 1.10x faster (q_fp8), equal (exact))
  int decode_group(int G, int64_t N, int C) const {
    int cap = decode_g;
    if (cap == 0) {
      const int64_t jobs = ceil_div<int64_t>(N, 4) * ceil_div<int64_t>(C, kTile);
      cap = G == 4 && jobs < int64_t(kDecodeG2Jobs) * num_sms() ? 2 : 4;
    }
    return G <= cap ? G : G % 2 == 0 && cap >= 2 ? 2 : 1;
  }
};

// Tokens per wgmma chain: the most of 4, 2, 1 that divides G with at most `cols` columns.
constexpr int chain_tokens(int G, int cols_per_token, int cols) {
  return G % 4 == 0 && 4 * cols_per_token <= cols ? 4 : G % 2 == 0 && 2 * cols_per_token <= cols ? 2 : 1;
}

template <int H, int TERMS, int G, int S, int TPJ, bool PROBE = false, bool SW = false, int CP = 0>
void launch(const WArgs& a, const CUtensorMap& km, cudaStream_t stream) {
  // the probes exist for H 64 at one and four tokens per CTA with the default chain (decode's
  // next_n 1 and 4, prefill)
  if constexpr (!PROBE && !SW && CP == 0 && H == 64 && TERMS <= 2 && (G == 1 || G == 4) && S == kStages &&
                TPJ == chain_tokens(G, H * TERMS, 256)) {
    if (a.probe != 0) return launch<H, TERMS, G, S, TPJ, true>(a, km, stream);
  }
  // the other copy schemes: H 64 single-token CTAs (q_fp8 and exact q's default mode 3)
  if constexpr (!PROBE && !SW && CP == 0 && H == 64 && TERMS != 2 && G == 1 && S == kStages) {
    switch (a.copy) {
      case kCopyLines: return launch<H, TERMS, G, S, TPJ, false, false, kCopyLines>(a, km, stream);
      case kCopyTma: return launch<H, TERMS, G, S, TPJ, false, false, kCopyTma>(a, km, stream);
      case kCopyTma | kCopyLines: return launch<H, TERMS, G, S, TPJ, false, false, kCopyTma | kCopyLines>(a, km, stream);
      default: break;
    }
  }
  constexpr int smem = Layout<H, TERMS, G, S>::kAlloc;
  auto* kern = indexer_wgmma_kernel<H, TERMS, G, S, TPJ, PROBE, SW, CP>;
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
  int smem_launch = smem;
  if (a.max_ctas > 0 && a.max_ctas < resident) {  // fewer CTAs per SM: shared memory padded to 1 / max_ctas
    resident = a.max_ctas;
    smem_launch = (228 * 1024) / resident - 1024;
    smem_launch = smem_launch > 227 * 1024 ? 227 * 1024 : smem_launch;
    static bool padded_of[64] = {};
    if (dev >= 64 || !padded_of[dev]) {
      check_cuda(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024),
                 "cudaFuncSetAttribute");
      if (dev < 64) padded_of[dev] = true;
    }
  }
  const int64_t groups = ceil_div<int64_t>(a.N, G);
  const int64_t tiles = ceil_div<int64_t>(a.C, kTile);
  // about a.waves (4) waves of resident CTAs (a short last wave costs little), at most a.tiles_per_cta
  // tiles per CTA (the launcher's max_tiles_per_cta; q quantisation and pipeline fill are per CTA)
  const int64_t target = int64_t(num_sms()) * resident * a.waves;
  int per = static_cast<int>(ceil_div<int64_t>(groups * tiles, target));
  const int cap = a.tiles_per_cta;
  per = per < 1 ? 1 : per > cap ? cap : per;
  const int64_t splits = ceil_div<int64_t>(tiles, per);
  WArgs b = a;
  b.tiles_per_cta = per;
  kern<<<dim3(static_cast<unsigned>(groups), static_cast<unsigned>(splits)), kThreads, smem_launch, stream>>>(b, km);
  check_launch("indexer_wgmma_kernel");
}

template <int H, int TERMS, int G, int S>
void launch_chain(const WArgs& a, const CUtensorMap& km, int cols, cudaStream_t stream) {
  constexpr int NT = H * q_cols(TERMS);
  // DEEPFUSE_INDEXER_SPLIT (H 64, q modes 1 and 3, groups of 4): two chains of two tokens, waited
  // one by one, instead of one chain of four (the same accumulator registers)
  if constexpr (G == 4 && H == 64 && TERMS != 2) {
    if (a.split_wait && cols >= 2 * NT) return launch<H, TERMS, G, S, 2, false, true>(a, km, stream);
  }
  if constexpr (G > 1) {
    if (chain_tokens(G, NT, cols) == 4) {
      if constexpr (chain_tokens(G, NT, 256) == 4) return launch<H, TERMS, G, S, 4>(a, km, stream);
    }
    if (chain_tokens(G, NT, cols) >= 2) {
      if constexpr (chain_tokens(G, NT, 256) >= 2) return launch<H, TERMS, G, S, 2>(a, km, stream);
    }
  }
  launch<H, TERMS, G, S, 1>(a, km, stream);
}

template <int H, int TERMS, int S>
void launch_g(const WArgs& a, const CUtensorMap& km, int G, int cols, int stages_single, cudaStream_t stream) {
  switch (G) {
    case 4: launch_chain<H, TERMS, 4, S>(a, km, cols, stream); break;
    case 3: launch_chain<H, TERMS, 3, S>(a, km, cols, stream); break;
    case 2: launch_chain<H, TERMS, 2, S>(a, km, cols, stream); break;
    default:
      switch (stages_single) {
        case 6:
          if constexpr (TERMS <= 2) return launch<H, TERMS, 1, 6, 1>(a, km, stream);
          [[fallthrough]];
        case 5:
          if constexpr (TERMS <= 2) return launch<H, TERMS, 1, 5, 1>(a, km, stream);
          [[fallthrough]];
        default: launch<H, TERMS, 1, S, 1>(a, km, stream); break;
      }
  }
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
  const Switches w = Switches::read();
  int G = indexer_rows_per_cta(N, num_reqs);
  const bool prefill = G == 4 && N >= 8 * num_reqs;
  G = prefill ? w.prefill_g : w.decode_group(G, N, C);
  // kCopyTma's key map: 3-D over the pages (128 bytes x page_size rows x pages), boxes of 64 rows of
  // one page, 128-byte swizzle; power-of-two page sizes of at least 64 rows only
  CUtensorMap km{};
  int tma_ok = 0;
  if ((w.copy & kCopyTma) && shift >= 6 && num_pages < (int64_t(1) << 31)) {
    const auto encode = tma::encode_tiled();
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(kRow), static_cast<cuuint64_t>(page_size),
                                static_cast<cuuint64_t>(num_pages)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(kRow), static_cast<cuuint64_t>(page_bytes)};
    const cuuint32_t box[3] = {kRow, kTile, 1}, es[3] = {1, 1, 1};
    tma_ok = encode != nullptr &&
             encode(&km, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<uint8_t*>(pages), dims, strides, box, es,
                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  }
  const WArgs a{static_cast<const __nv_bfloat16*>(q), weights, pages, page_bytes, num_pages, page_size, shift,
                entry_slots, slots_ld, token_req, n_vis, C, scale, out, N,
                prefill ? w.max_tiles_prefill : w.max_tiles_decode, w.copy, w.probe, w.split_wait,
                w.max_ctas, w.waves, tma_ok};
  const int cols = G > 1 ? (prefill ? w.chain_prefill : w.chain_decode) : 0;
  const int st = w.stages_single;
  // q mode 3 (H 64, exact q, DEEPFUSE_INDEXER_QK2): the two q terms along K instead of as columns
  if (H == 64 && q_terms == 2 && w.qk2) launch_g<64, 3, kStages>(a, km, G, cols, st, stream);
  else if (H == 64 && q_terms == 2) launch_g<64, 2, kStages>(a, km, G, cols, st, stream);
  else if (H == 64 && q_terms == 1) launch_g<64, 1, kStages>(a, km, G, cols, st, stream);
  else if (H == 32 && q_terms == 2) launch_g<32, 2, kStages>(a, km, G, cols, st, stream);
  else if (H == 32 && q_terms == 1) launch_g<32, 1, kStages>(a, km, G, cols, st, stream);
  else throw std::invalid_argument("deepfuse: indexer_logits_paged: H must be 32 or 64, q_terms 1 or 2");
}

}  // namespace deepfuse
