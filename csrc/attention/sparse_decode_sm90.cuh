// Sparse attention over paged FP8 KV, sm90a: the warp-specialised wgmma kernel (decode and
// any T with one query row per CTA group, G = 1, FP8 pages). Semantics: ops/attention.py;
// host selection: sparse_attn_sm90_bf16.cu (sparse_decode_enabled).
//
// CTA = 3 warpgroups (384 threads), 64 query heads of one query row t. H = 128 (C = 2): the two
// CTAs of row t form a cluster; each dequantises half of every block's keys into both CTAs'
// tiles (st.async into the peer, completing on its "rfull" mbarrier), so a key is converted
// once per row (the default; DEEPFUSE_SPARSE_DECODE_CLUSTER=0: two independent CTAs, C = 1).
// Keys in blocks of 64 positions of the virtual list (source 0's columns, then source 1's).
// - Warpgroup 0 (producer, 88 registers): per block, each of its 64 / C key rows by 2 C
//   threads: slot index, validity (0 <= slot < num_slots, position < length), the 36 16-byte
//   chunks of the 584-byte row: the 28 e4m3 ones loaded into registers (before waiting for
//   the stage), e4m3 x 2^(s-127) -> bf16 (bit-exact with kv_dequantise_rows), the 8 bf16 RoPE
//   ones copied (cp.async; C = 2 through registers, for the peer's copy); stored into a
//   64 x 512 bf16 tile in the wgmma 128-byte-swizzle layout ([8 sub-tiles of 64 dims][64 keys]
//   [128 B]); invalid keys are written as zeros and flagged in a per-stage byte mask. Two
//   stages, "full" / "empty" mbarriers. Slot indices are copied two blocks ahead by cp.async
//   into a 3-block ring in shared memory (one rolled step body per block, no slot register
//   waiting on a load; kOldProd: the previous producer, indices in registers three blocks
//   ahead and its loop unrolled by three), block i + 2's rows are prefetched into L2; the
//   consumers load Q (cp.async) meanwhile.
// - Warpgroups 1 and 2 (consumers, 208 registers): warpgroup w owns dims / output columns
//   256 w .. 256 w + 255. S_w = Q[:, half w] K[:, half w]^T by 16 wgmma m64n64k16 (both
//   operands K-major from shared memory); the two partial logit tiles are exchanged through
//   shared memory (two named barriers), both warpgroups run the same online softmax (log2
//   domain, lazy rescaling past 2^8, so both hold identical P), P goes to bf16 register
//   fragments and O_w += P V[:, half w] by 4 wgmma m64n256k16 (A from registers, B = the
//   same key tile read N-major: LBO = 8 KB between 64-column sub-tiles, SBO = 1 KB between
//   8-key groups). The 64 x 256 fp32 accumulator is 128 registers per thread.
// Splits (gridDim.y) take contiguous ranges of blocks and write the unnormalised partials
// that sparse_attn_combine_kernel merges; with one split the epilogue (sink, lse, inverse
// RoPE, bf16 or MXFP8; attn_dev::write_output) stages the output tile in shared memory and
// stores it with coalesced 16-byte stores.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "attention/attn_device.cuh"
#include "attention/sparse_attention.h"
#include "common/arch.h"
#include "common/fp8_utils.cuh"

namespace deepfuse {
namespace attn_wg {

using attn_dev::dequant16;
using attn_dev::load_i;
using attn_dev::pack_bf16;

constexpr int kThreads = 384;
constexpr int kDim = 512;
constexpr int kSub = 8192;                     // [64 rows][128 B]: one 64-dim sub-tile
constexpr int kTile = 8 * kSub;                // 64 rows x 512 dims bf16
constexpr int kQOff = 0;
constexpr int kKOff = kTile;                   // 2 stages
constexpr int kXOff = 3 * kTile;               // logit exchange: 2 warpgroups x 32 x 128 fp32
constexpr int kMaskOff = kXOff + 2 * 32 * 128 * 4;
constexpr int kBarOff = kMaskOff + 2 * 64;     // full[2], empty[2], rfull[2] (the peer's half, C = 2)
constexpr int kRingOff = kBarOff + 64;         // the producer's slot indices: 3 blocks x 64 keys x 8 bytes
constexpr int kSmemBytes = kRingOff + 3 * 64 * 8 + 1024;  // + alignment slack (1024-byte swizzle atoms)
// In-cluster split-KV reduction (kRed): a CTA's unnormalised output, fp32 rows kRS floats apart (float2
// stores of a warp: two wavefronts), then (max, sum) per head row, over Q and the key stages.
constexpr int kRS = 520;
constexpr int kRedMlOff = 64 * kRS * 4;
constexpr int kMaxRed = 16;  // splits per cluster (a non-portable cluster size above 8)
static_assert(kRedMlOff + 64 * 8 <= kXOff, "reduction buffers");
constexpr int kProducerRegs = 88;
constexpr int kConsumerRegs = 208;
constexpr float kLn2 = 0.69314718055994530942f;
constexpr float kLog2e = 1.44269504088896340736f;

static_assert(kSmemBytes <= 232448, "shared memory");
// setmaxnreg moves registers through a per-CTA pool: what the consumers take (.inc blocks until it
// is there) must not exceed what the producer releases from the launch allocation (168 each).
constexpr int kLaunchRegs = 168;
static_assert(256 * (kConsumerRegs - kLaunchRegs) <= 128 * (kLaunchRegs - kProducerRegs), "register pool");

// Byte offset of 16-byte chunk c (0..63, dims 8c..8c+7) of row r (0..63) in a tile.
__device__ __forceinline__ uint32_t toff(int r, int c) {
  return static_cast<uint32_t>((c >> 3) * kSub + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// K-major operand, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t desc_k(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
// N-major (transposed) B operand, 128-byte swizzle: 64-column sub-tiles kSub apart (LBO),
// 8-key groups 1024 bytes apart (SBO).
__device__ __forceinline__ uint64_t desc_mn(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(kSub >> 4) << 16) | (64ull << 32) |
         (1ull << 62);
}

// 2^x by one MUFU.EX2 (exp2f adds a range fix-up for results below 2^-126, which are flushed
// to zero here: weights that small do not change the bf16 / fp32 sums they enter).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// Softmax steps on one n8 tile of a thread's logits s[0..3] (rows g, g + 8; keys 2 qd + {0, 1}),
// shared by the full-tile and the split softmax.
// The other warpgroup's partial logits v added, masked keys (mask bytes m[0], m[1]) to -inf, the
// rest scaled to log2 units.
__device__ __forceinline__ void finish_logits(float* s, const float4 v, const uint8_t* m, float scale) {
  const uint32_t m2 = *reinterpret_cast<const uint16_t*>(m);
  const bool v0 = (m2 & 0xffu) != 0, v1 = (m2 >> 8) != 0;
  s[0] = v0 ? (s[0] + v.x) * scale : -INFINITY;
  s[1] = v1 ? (s[1] + v.y) * scale : -INFINITY;
  s[2] = v0 ? (s[2] + v.z) * scale : -INFINITY;
  s[3] = v1 ? (s[3] + v.w) * scale : -INFINITY;
}
// The same without a partner's partial (the key-split QK holds whole logits).
__device__ __forceinline__ void mask_scale(float* s, const uint8_t* m, float scale) {
  const uint32_t m2 = *reinterpret_cast<const uint16_t*>(m);
  const bool v0 = (m2 & 0xffu) != 0, v1 = (m2 >> 8) != 0;
  s[0] = v0 ? s[0] * scale : -INFINITY;
  s[1] = v1 ? s[1] * scale : -INFINITY;
  s[2] = v0 ? s[2] * scale : -INFINITY;
  s[3] = v1 ? s[3] * scale : -INFINITY;
}
__device__ __forceinline__ void tile_max(float (&mx)[2], const float* s) {
  mx[0] = fmaxf(mx[0], fmaxf(s[0], s[1]));
  mx[1] = fmaxf(mx[1], fmaxf(s[2], s[3]));
}
// Row sums l += the tile's weights 2^(s - mu); the weights packed as bf16 pairs (row g, row g + 8).
__device__ __forceinline__ void exp_pack(const float* s, float mu0, float mu1, float (&l)[2], uint32_t& a,
                                         uint32_t& b) {
  const float p0 = ex2(s[0] - mu0), p1 = ex2(s[1] - mu0);
  const float p2 = ex2(s[2] - mu1), p3 = ex2(s[3] - mu1);
  l[0] += p0 + p1;
  l[1] += p2 + p3;
  a = pack_bf16(p0, p1);
  b = pack_bf16(p2, p3);
}
// Lazy online-softmax rescaling (as in the mma.sync kernel): only when a row maximum grew by more
// than 2^8 somewhere in the warp are m_run, l_run and the output accumulators moved to it.
__device__ __forceinline__ void rescale_lazy(const float (&mx)[2], float (&m_run)[2], float (&l_run)[2],
                                             float (&o)[128]) {
  bool need = false;
#pragma unroll
  for (int h = 0; h < 2; ++h) need |= mx[h] > m_run[h] + 8.f;
  if (__any_sync(0xffffffffu, need)) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float mn = fmaxf(m_run[h], mx[h]);
      const float alpha = mn == -INFINITY ? 1.f : exp2f(m_run[h] - mn);
      m_run[h] = mn;
      l_run[h] *= alpha;
#pragma unroll
      for (int j = 0; j < 32; ++j) o[4 * j + 2 * h] *= alpha, o[4 * j + 2 * h + 1] *= alpha;
    }
  }
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void named_bar(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ uint32_t mapa(uint32_t a, int rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}
__device__ __forceinline__ void mbar_arrive_remote(uint32_t cluster_bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_bar) : "memory");
}
// 16 bytes into the peer CTA's shared memory, completing on its mbarrier.
__device__ __forceinline__ void st_async16(uint32_t cluster_addr, const uint4& v, uint32_t cluster_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                   cluster_addr),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(cluster_bar)
               : "memory");
}
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ float2 ld_dsmem_f2(uint32_t cluster_addr) {
  float2 v;
  asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(cluster_addr) : "memory");
  return v;
}
__device__ __forceinline__ float4 ld_dsmem_f4(uint32_t cluster_addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(cluster_addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void cluster_sync_all() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok = 0;
  do {
    asm volatile("{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; selp.u32 %0, 1, 0, q; }\n"
                 : "=r"(ok)
                 : "r"(bar), "r"(parity)
                 : "memory");
  } while (!ok);
}

__device__ __forceinline__ uint4 ld_nc16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// A slot index as loaded (lo, hi words; hi only for int64 indices), zero when !pred. Nothing
// reads the destination registers here, so the load stays in flight until the slot is used.
struct RawSlot {
  uint32_t lo, hi;
};
__device__ __forceinline__ RawSlot ld_slot(const void* p, int is64, bool pred) {
  RawSlot r;
  if (is64) {
    asm volatile("{ .reg .pred q; setp.ne.b32 q, %3, 0; mov.b32 %0, 0; mov.b32 %1, 0;\n"
                 "@q ld.global.nc.v2.b32 {%0, %1}, [%2]; }\n"
                 : "=r"(r.lo), "=r"(r.hi)
                 : "l"(p), "r"(pred ? 1 : 0));
  } else {
    asm volatile("{ .reg .pred q; setp.ne.b32 q, %2, 0; mov.b32 %0, 0;\n"
                 "@q ld.global.nc.b32 %0, [%1]; }\n"
                 : "=r"(r.lo)
                 : "l"(p), "r"(pred ? 1 : 0));
    r.hi = 0;
  }
  return r;
}

__device__ __forceinline__ void wgmma_ss_m64n64k16(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_ss_m64n32k16(float (&d)[16], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(da), "l"(db), "r"(scale_d));
}

// A from registers (a0..a3: the m64k16 bf16 fragment), B N-major (transposed) from shared memory.
__device__ __forceinline__ void wgmma_rs_m64n256k16_tb(float (&d)[128], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                    uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(scale_d));
}


// kSplit: the split softmax (each consumer warpgroup finishes half of the keys); kKeys (with kSplit):
// QK itself split by keys (warpgroup w: keys 32 w .. 32 w + 31 over all 512 dims), so only the row
// maxima and the P halves are exchanged. kRed (C = 1, splits > 1): the P.splits CTAs of a row form a
// cluster (rank = split) and reduce their partial outputs through DSMEM instead of the workspace and
// sparse_attn_combine_kernel. kPersist (one split): each cluster of C CTAs takes work items (row t)
// u, u + U, .. (U clusters in the grid); the mbarrier phases run on over the items, so the producer
// fills the next item's first stages while the consumers finish the last one; the output is staged
// in the Q tile (free after the item's last QK).
template <int C, bool kSplit, bool kKeys = false, bool kRed = false, bool kPersist = false, bool kOldProd = false>
__global__ void __launch_bounds__(kThreads, 1) sparse_decode_kernel(const __grid_constant__ AttnParams P) {
#if DEEPFUSE_SM90A_DEVICE
  static_assert(C == 1 || C == 2, "cluster size");
  static_assert(C == 1 || !kRed, "the split reduction clusters the splits of one 64-head block");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sm = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const uint32_t sb = smem_u32(sm);
  const uint32_t full0 = sb + kBarOff, empty0 = sb + kBarOff + 16, rfull0 = sb + kBarOff + 32;
  const int tid = threadIdx.x;
  // A programmatic dependent (the split-KV combine) may be scheduled once every CTA has started; it
  // waits for this grid's completion itself (griddepcontrol.wait).
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  static_assert(!(kRed && kPersist), "one split per item when persistent");
  const int HT = P.H / 64;
  // Work items of this CTA: cluster units u = unit0, unit0 + ustride, .. < n_units (one, the CTA's
  // own, unless kPersist); CTA index gx = u * C + rank -> row t, heads head0 ...
  // (T * H / 64 < 2^31: the launch's grid.x bound)
  const int n_units = kPersist ? P.T * HT / C : 1;
  const int unit0 = kPersist ? static_cast<int>(blockIdx.x) / C : 0;
  const int ustride = kPersist ? static_cast<int>(gridDim.x) / C : 1;
  int64_t t = static_cast<int64_t>(blockIdx.x) / HT;  // (the item without kPersist)
  int head0 = static_cast<int>(blockIdx.x % HT) * 64;
  auto item_of = [&](int u) {
    if constexpr (kPersist) {
      const int gx = u * C + static_cast<int>(blockIdx.x) % C;
      t = gx / HT;
      head0 = (gx % HT) * 64;
    }
  };
  // C = 2 (H = 128): the two CTAs of row t (cluster ranks = head halves) each dequantise half of
  // every block's keys into both CTAs' tiles.
  const int crank = C == 2 ? static_cast<int>(blockIdx.x & 1) : 0;

  if (tid == 0) {
    for (int s = 0; s < 2; ++s) {
      mbar_init(full0 + 8 * s, 128);
      mbar_init(empty0 + 8 * s, 256 + 2 * (C - 1));  // every local consumer thread + one per peer warpgroup
      if (C == 2) mbar_init(rfull0 + 8 * s, 1);       // this CTA's expect_tx; the peer's st.async bytes
    }
    if (C == 2) asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (C == 2)
    cluster_sync_all();  // barriers initialised and both CTAs running before any DSMEM traffic
  else
    __syncthreads();

  const int K0 = P.src[0].K;
  const int K_all = K0 + P.src[1].K;
  const int nblk = (K_all + 63) / 64;
  const int bps = (nblk + P.splits - 1) / P.splits;
  const int b_begin = min(nblk, static_cast<int>(blockIdx.y) * bps);
  const int nb = min(nblk, b_begin + bps) - b_begin;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform for the compiler: descriptors in uniform registers

  if (wg == 0) {
    // ---------------------------------------------------------------- producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    // This CTA converts keys crank * 64 / C .. + 64 / C - 1 of each block, TPK threads per key:
    // e4m3 chunks j = TPK jj + q (jj < 28 / TPK), RoPE chunks j = 28 + TPK jj + q (jj < 8 / TPK).
    constexpr int TPK = 2 * C, NE = 28 / TPK, NR = 8 / TPK;
    const int q = tid & (TPK - 1);
    const int key = crank * (64 / C) + (tid >> C);
    const int mkey = tid >> 1;  // the mask byte this thread pair writes (every key of the block)
    int gb = 0;  // blocks of earlier items: block i of this item is the CTA's block gb + i (stage, phase)
    for (int u = unit0; u < n_units; u += ustride, gb += nb) {
    item_of(u);
    int len[2];
#pragma unroll
    for (int si = 0; si < 2; ++si) {
      const AttnSource& S = P.src[si];
      int64_t L = S.K;
      if (S.len != nullptr) L = min(L, load_i(S.len, S.len64, t));
      len[si] = static_cast<int>(L > 0 ? L : 0);
    }
    // Slot index of key k of block i as loaded: issued three blocks ahead and not read until
    // its block (no dependent instruction in between, so consecutive blocks' loads overlap).
    auto load_slot = [&](int i, int k) -> RawSlot {
      const int p = (b_begin + i) * 64 + k;
      const int si = p < K0 ? 0 : 1;
      const AttnSource& S = P.src[si];
      const bool in = i < nb && p < K_all;
      return ld_slot(static_cast<const uint8_t*>(S.idx) + ((t * S.K + (in ? p - (si ? K0 : 0) : 0)) << (S.idx64 ? 3 : 2)),
                     S.idx64, in);
    };
    // The slot of key k of block i from its raw load; -1 past the block range or the length.
    auto slot_of = [&](int i, int k, const RawSlot& r) -> int64_t {
      const int p = (b_begin + i) * 64 + k;
      const int si = p < K0 ? 0 : 1;
      const int pos = p - (si ? K0 : 0);
      if (i >= nb || p >= K_all || pos >= (si ? len[1] : len[0])) return -1;
      return P.src[si].idx64 ? static_cast<int64_t>((static_cast<uint64_t>(r.hi) << 32) | r.lo)
                             : static_cast<int64_t>(static_cast<int32_t>(r.lo));
    };
    auto slot_ok = [&](int i, int k, int64_t v) -> bool {
      return v >= 0 && v < P.src[(b_begin + i) * 64 + k < K0 ? 0 : 1].num_slots;
    };
    // Row data and scale addresses of slot v of key k of block i; false when the key is skipped.
    auto row_of = [&](int i, int k, int64_t v, const uint8_t*& rowp, const uint8_t*& sclp) -> bool {
      const AttnSource& S = P.src[(b_begin + i) * 64 + k < K0 ? 0 : 1];
      if (v < 0 || v >= S.num_slots) return false;
      const int sl = static_cast<int>(v);
      const int page = sl / S.page_size;
      const int row = sl - page * S.page_size;
      const uint8_t* pg = S.base + static_cast<int64_t>(page) * S.page_bytes;
      rowp = pg + row * 576;
      sclp = pg + static_cast<int64_t>(S.page_size) * 576 + row * 8;
      return true;
    };
    // Block i's rows into L2 (data and scale lines); the loads of block i then hit L2.
    auto prefetch = [&](int i, const RawSlot& r) {
      const uint8_t *rp, *sp;
      if (i < nb && row_of(i, key, slot_of(i, key, r), rp, sp)) {
        // the row's 576 bytes (64-byte aligned) lie in the 128-byte lines of rp + 0, 128, .., 512
        if (C == 1) {
          const uint8_t* a0 = rp + q * 384;
          asm volatile("prefetch.global.L2 [%0];\n" ::"l"(a0) : "memory");
          asm volatile("prefetch.global.L2 [%0];\n" ::"l"(a0 + 128) : "memory");
          asm volatile("prefetch.global.L2 [%0];\n" ::"l"(q == 0 ? a0 + 256 : sp) : "memory");
        } else {
          asm volatile("prefetch.global.L2 [%0];\n" ::"l"(rp + q * 128) : "memory");
          if (q < 2) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(q == 0 ? rp + 512 : sp) : "memory");
        }
      }
    };
    const uint32_t peer_sb = C == 2 ? mapa(sb, crank ^ 1) : 0;
    // Block i (the CTA's running block gi = gb + i, stage gi & 1): rows of key slot value ks loaded
    // before the stage wait, converted and stored; mask byte from mask-key slot ms.
    struct Rows {
      const uint8_t *rowp, *sclp;
      bool valid, mvalid;
    };
    auto resolve = [&](int i, const RawSlot& ks, const RawSlot& ms) -> Rows {
      Rows r{P.src[0].base, nullptr, false, false};  // (a valid address, never read, when skipped)
      r.valid = row_of(i, key, slot_of(i, key, ks), r.rowp, r.sclp);
      r.mvalid = C == 2 ? slot_ok(i, mkey, slot_of(i, mkey, ms)) : r.valid;
      return r;
    };
    auto convert = [&](int i, const Rows& rr) {
      const int gi = gb + i;
      const int s = gi & 1;
      const uint8_t* rowp = rr.rowp;
      const uint8_t* sclp = rr.sclp;
      const bool valid = rr.valid, mvalid = rr.mvalid;
      uint4 raw[NE], rope[C == 2 ? NR : 1];
      uint2 scl = make_uint2(0, 0);
      if (valid) {
        rowp += q * 16;
#pragma unroll
        for (int jj = 0; jj < NE; ++jj) raw[jj] = ld_nc16(rowp + jj * 16 * TPK);
        if (C == 2) {
#pragma unroll
          for (int jj = 0; jj < NR; ++jj) rope[jj] = ld_nc16(rowp + 448 + jj * 16 * TPK);
        }
        scl = __ldg(reinterpret_cast<const uint2*>(sclp));
      } else {
#pragma unroll
        for (int jj = 0; jj < NE; ++jj) raw[jj] = make_uint4(0, 0, 0, 0);
        if (C == 2) {
#pragma unroll
          for (int jj = 0; jj < NR; ++jj) rope[jj] = make_uint4(0, 0, 0, 0);
        }
      }
      if (gi >= 2) mbar_wait(empty0 + 8 * s, ((gi >> 1) + 1) & 1);
      uint8_t* kt = sm + kKOff + s * kTile;
      const uint32_t rbar = C == 2 ? mapa(rfull0 + 8 * s, crank ^ 1) : 0;
      const uint32_t rkt = peer_sb + kKOff + s * kTile;
      if (C == 2 && tid == 0) mbar_expect_tx(rfull0 + 8 * s, 64 / C * 1024);  // the peer's keys of this block
      if (C == 1) {
        // bf16 RoPE chunks: copied as they are by cp.async (zero fill for a skipped key), landing
        // while the e4m3 chunks are converted.
#pragma unroll
        for (int jj = 0; jj < NR; ++jj) {
          const int j = 28 + TPK * jj + q;
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(kt + toff(key, j + 28))),
                       "l"(rowp + 448 + jj * 16 * TPK), "r"(valid ? 16 : 0)
                       : "memory");
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
      } else {
#pragma unroll
        for (int jj = 0; jj < NR; ++jj) {
          const uint32_t off = toff(key, 28 + TPK * jj + q + 28);
          *reinterpret_cast<uint4*>(kt + off) = rope[jj];
          st_async16(rkt + off, rope[jj], rbar);
        }
      }
#pragma unroll
      for (int jj = 0; jj < NE; ++jj) {  // e4m3 chunks j: values 16 j .. 16 j + 15
        const int j = TPK * jj + q;
        const int gi = j >> 2;
        const uint32_t sbyte = ((gi < 4 ? scl.x >> (8 * gi) : scl.y >> (8 * (gi - 4)))) & 0xffu;
        uint4 lo, hi;
        dequant16(raw[jj], exp2i(static_cast<int>(sbyte) - 127), lo, hi);
        const uint32_t o0 = toff(key, 2 * j), o1 = toff(key, 2 * j + 1);
        *reinterpret_cast<uint4*>(kt + o0) = lo;
        *reinterpret_cast<uint4*>(kt + o1) = hi;
        if (C == 2) {
          st_async16(rkt + o0, lo, rbar);
          st_async16(rkt + o1, hi, rbar);
        }
      }
      // (kRing: also the slot group issued with this block)
      if (C == 1 || !kOldProd) asm volatile("cp.async.wait_all;\n" ::: "memory");
      if ((tid & 1) == 0) sm[kMaskOff + s * 64 + mkey] = mvalid ? 1 : 0;
      fence_proxy_async();
      mbar_arrive(full0 + 8 * s);
    };
    if constexpr (!kOldProd) {
      // Slot indices through a ring of three blocks in shared memory (kRingOff): block i's 64 raw
      // indices are copied by cp.async (threads 0..63, zero fill past the range) while block i - 2
      // is converted and waited for with that block's RoPE copies; a producer barrier per block
      // makes them visible and orders the ring's reuse. No slot value waits in a register, so one
      // rolled step body serves every block.
      auto issue_slots = [&](int i, int gi) {
        if (tid < 64) {
          const int p = (b_begin + i) * 64 + tid;
          const int si = p < K0 ? 0 : 1;
          const AttnSource& S = P.src[si];
          const bool in = i < nb && p < K_all;
          const void* src = in ? static_cast<const void*>(static_cast<const uint8_t*>(S.idx) +
                                                          ((t * S.K + p - (si ? K0 : 0)) << (S.idx64 ? 3 : 2)))
                               : static_cast<const void*>(P.src[0].base);  // (never read: zero fill)
          const uint32_t dst = sb + kRingOff + static_cast<uint32_t>(((gi % 3) * 64 + tid) * 8);
          if (S.idx64)
            asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(in ? 8 : 0) : "memory");
          else
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(in ? 4 : 0) : "memory");
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
      };
      auto ring_at = [&](int gi, int k) -> RawSlot {
        const uint2 r = *reinterpret_cast<const uint2*>(sm + kRingOff + ((gi % 3) * 64 + k) * 8);
        return RawSlot{r.x, r.y};
      };
      issue_slots(0, gb);
      issue_slots(1, gb + 1);
      asm volatile("cp.async.wait_all;\n" ::: "memory");
      named_bar(4, 128);
#pragma unroll 1
      for (int i = 0; i < nb; ++i) {
        const int gi = gb + i;
        const RawSlot ks = ring_at(gi, key);
        const RawSlot ms = C == 2 ? ring_at(gi, mkey) : ks;
        issue_slots(i + 2, gi + 2);
        convert(i, resolve(i, ks, ms));
        named_bar(4, 128);  // the ring entries of blocks i + 1, i + 2 visible; block i's readers done
        prefetch(i + 2, ring_at(gi + 2, key));
      }
    } else {
    // Block i: its slot in cur (reloaded with block i + 3's), block i + 2's in n2 (prefetched),
    // C = 2: the mask key's slot of block i in mcur (reloaded with block i + 3's).
    auto step = [&](int i, RawSlot& cur, const RawSlot& n2, RawSlot& mcur) {
      prefetch(i + 2, n2);
      const Rows rr = resolve(i, cur, mcur);
      cur = load_slot(i + 3, key);
      if (C == 2) mcur = load_slot(i + 3, mkey);
      convert(i, rr);
    };
    RawSlot a0 = load_slot(0, key), a1 = load_slot(1, key), a2 = load_slot(2, key);
    RawSlot b0 = {0, 0}, b1 = {0, 0}, b2 = {0, 0};
    if (C == 2) b0 = load_slot(0, mkey), b1 = load_slot(1, mkey), b2 = load_slot(2, mkey);
    prefetch(1, a1);
    // Unrolled by three: the slot registers are never copied (a copy would wait for the load).
    for (int i = 0; i < nb; i += 3) {
      step(i, a0, a2, b0);
      if (i + 1 < nb) step(i + 1, a1, a0, b1);
      if (i + 2 < nb) step(i + 2, a2, a1, b2);
    }
    }
    }  // items
    if (C == 2) cluster_sync_all();  // no CTA leaves while its peer may still address it
    if (kRed) {  // the consumers' two cluster barriers of the reduction
      cluster_sync_all();
      cluster_sync_all();
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  int gb = 0;
  for (int u = unit0; u < n_units; u += ustride, gb += nb) {
  item_of(u);
  // Q tile (64 heads x 512) -> shared memory, swizzled, by the consumers while the producer
  // starts on the first blocks.
#pragma unroll
  for (int k = 0; k < 16; ++k) {  // all 16 chunks of a thread in flight at once (cp.async, no registers)
    const int i = tid - 128 + 256 * k;
    const int r = i >> 6, c = i & 63;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sb + kQOff + toff(r, c)),
                 "l"(static_cast<const __nv_bfloat16*>(P.q) + t * P.q_ld_t + (head0 + r) * P.q_ld_h + c * 8)
                 : "memory");
  }
  asm volatile("cp.async.commit_group;\ncp.async.wait_all;\n" ::: "memory");
  fence_proxy_async();  // Q's stores -> the wgmma (async) proxy
  named_bar(2, 256);
  const int w = wg - 1;        // dims / output columns 256 w ..
  const int lt = tid & 127;    // thread in the warpgroup
  const int wi = lt >> 5, lane = lt & 31;
  const int g = lane >> 2, qd = lane & 3;
  float o[128];
#pragma unroll
  for (int j = 0; j < 128; ++j) o[j] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  float4* xmine = reinterpret_cast<float4*>(sm + kXOff) + w * 8 * 128 + lt;
  const float4* xother = reinterpret_cast<const float4*>(sm + kXOff) + (1 - w) * 8 * 128 + lt;

  // S_w of block i into sc (issued, not committed).
  static_assert(kSplit || !kKeys, "the key-split QK needs the split softmax");
  constexpr int NS = kKeys ? 16 : 32;
  float sc[NS];
#pragma unroll
  for (int j = 0; j < NS; ++j) sc[j] = 0.f;
  // (Descriptors advance by adding the byte offset / 16 to the address field: every tile
  // address + offset stays below 2^18.)
  const uint64_t dq0 = desc_k(sb + kQOff + 4 * w * kSub);
  auto issue_qk = [&](int i) {
    if constexpr (kKeys) {  // S[:, keys 32 w ..] over all 512 dims: A = Q, B = rows 32 w .. of the key tile
      const uint64_t dqa = desc_k(sb + kQOff);
      const uint64_t dk0 = desc_k(sb + kKOff + ((gb + i) & 1) * kTile + w * 4096);
#pragma unroll
      for (int ks = 0; ks < 32; ++ks) {
        const uint32_t off = ((ks >> 2) * kSub + (ks & 3) * 32) >> 4;
        wgmma_ss_m64n32k16(sc, dqa + off, dk0 + off, ks > 0 ? 1 : 0);
      }
    } else {
      const uint64_t dk0 = desc_k(sb + kKOff + ((gb + i) & 1) * kTile + 4 * w * kSub);
#pragma unroll
      for (int ks = 0; ks < 16; ++ks) {
        const uint32_t off = ((ks >> 2) * kSub + (ks & 3) * 32) >> 4;
        wgmma_ss_m64n64k16(sc, dq0 + off, dk0 + off, ks > 0 ? 1 : 0);
      }
    }
  };
  // Block i's tile is complete when this CTA's producer arrived (and, C = 2, the peer's bytes landed).
  auto wait_full = [&](int i) {
    const int gi = gb + i;
    mbar_wait(full0 + 8 * (gi & 1), (gi >> 1) & 1);
    if (C == 2) mbar_wait(rfull0 + 8 * (gi & 1), (gi >> 1) & 1);
  };
  if (nb > 0) {
    wait_full(0);
    wg_fence();
    issue_qk(0);
    wg_commit();
    wg_wait0();
    fence_regs(sc);
  }

  // Block i: S_w(i) is in sc. Exchange, softmax, then PV(i) and QK(i + 1) back to back on the
  // tensor cores (one wait for both).
  for (int i = 0; i < nb; ++i) {
    const int s = (gb + i) & 1;
    const uint32_t kt = sb + kKOff + s * kTile;
    uint32_t pa[16];
    if constexpr (!kSplit) {
      // Exchange the partial logits (the first barrier: the other warpgroup read the last ones).
      named_bar(1, 256);
  #pragma unroll
      for (int r = 0; r < 8; ++r) xmine[r * 128] = make_float4(sc[4 * r], sc[4 * r + 1], sc[4 * r + 2], sc[4 * r + 3]);
      named_bar(1, 256);
      const uint8_t* mk = sm + kMaskOff + s * 64;
  #pragma unroll
      for (int r = 0; r < 8; ++r)  // n8 tile r: keys 8 r + 2 qd + {0, 1}
        finish_logits(sc + 4 * r, xother[r * 128], mk + 8 * r + 2 * qd, P.scale_log2);
      // Online softmax, rows g and g + 8 of warp wi's 16.
      float mx[2] = {-INFINITY, -INFINITY};
  #pragma unroll
      for (int r = 0; r < 8; ++r) tile_max(mx, sc + 4 * r);
  #pragma unroll
      for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      }
      rescale_lazy(mx, m_run, l_run, o);
      const float mu0 = m_run[0] == -INFINITY ? 0.f : m_run[0];
      const float mu1 = m_run[1] == -INFINITY ? 0.f : m_run[1];
  #pragma unroll
      for (int r = 0; r < 8; ++r)  // k-step r / 2: a0 (row g, keys +0..7) a1 (row g+8) a2 (row g, keys +8..15) a3
        exp_pack(sc + 4 * r, mu0, mu1, l_run, pa[4 * (r >> 1) + 2 * (r & 1)], pa[4 * (r >> 1) + 2 * (r & 1) + 1]);

    } else {
      // Split softmax: this warpgroup finishes the logits, exponentials and sums of n8 tiles
      // 4 w .. 4 w + 3 (keys 32 w ..) only. It sends the other warpgroup its partial logits of the
      // other's tiles (8 KB), the row maxima (2 floats per thread) and its P half (8 words per
      // thread); a thread's partner in the other warpgroup (same lt) holds the same rows.
      // Buffer reuse needs no extra barrier: a buffer is rewritten only after the barrier that
      // follows the partner's read of its previous contents.
      float mine[16];
      const uint8_t* mk = sm + kMaskOff + s * 64 + 32 * w;
      if constexpr (kKeys) {  // sc holds this warpgroup's keys over all dims: nothing to exchange
#pragma unroll
        for (int k = 0; k < 16; ++k) mine[k] = sc[k];
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) mask_scale(mine + 4 * rr, mk + 8 * rr + 2 * qd, P.scale_log2);
      } else {
        float oth[16];
#pragma unroll
        for (int k = 0; k < 16; ++k) {
          mine[k] = w ? sc[16 + k] : sc[k];
          oth[k] = w ? sc[k] : sc[16 + k];
        }
        float4* xs = reinterpret_cast<float4*>(sm + kXOff);
#pragma unroll
        for (int rr = 0; rr < 4; ++rr)
          xs[(w * 4 + rr) * 128 + lt] = make_float4(oth[4 * rr], oth[4 * rr + 1], oth[4 * rr + 2], oth[4 * rr + 3]);
        named_bar(1, 256);
#pragma unroll
        for (int rr = 0; rr < 4; ++rr)  // n8 tile 4 w + rr: keys 32 w + 8 rr + 2 qd + {0, 1}
          finish_logits(mine + 4 * rr, xs[((1 - w) * 4 + rr) * 128 + lt], mk + 8 * rr + 2 * qd, P.scale_log2);
      }
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int rr = 0; rr < 4; ++rr) tile_max(mx, mine + 4 * rr);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      }
      float2* xm = reinterpret_cast<float2*>(sm + kXOff + 16384);
      xm[w * 128 + lt] = make_float2(mx[0], mx[1]);
      named_bar(1, 256);
      {
        const float2 om = xm[(1 - w) * 128 + lt];
        mx[0] = fmaxf(mx[0], om.x);
        mx[1] = fmaxf(mx[1], om.y);
      }
      // The same maxima in both warpgroups: the same lazy rescaling decisions.
      rescale_lazy(mx, m_run, l_run, o);
      const float mu0 = m_run[0] == -INFINITY ? 0.f : m_run[0];
      const float mu1 = m_run[1] == -INFINITY ? 0.f : m_run[1];
      uint32_t ph[8];
#pragma unroll
      for (int rr = 0; rr < 4; ++rr)
        exp_pack(mine + 4 * rr, mu0, mu1, l_run, ph[4 * (rr >> 1) + 2 * (rr & 1)], ph[4 * (rr >> 1) + 2 * (rr & 1) + 1]);
      uint4* xp = reinterpret_cast<uint4*>(sm + kXOff + 16384 + 2048);
      xp[(w * 128 + lt) * 2] = make_uint4(ph[0], ph[1], ph[2], ph[3]);
      xp[(w * 128 + lt) * 2 + 1] = make_uint4(ph[4], ph[5], ph[6], ph[7]);
      named_bar(1, 256);
      const uint4 q0 = xp[((1 - w) * 128 + lt) * 2], q1 = xp[((1 - w) * 128 + lt) * 2 + 1];
      const uint32_t po[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
      for (int k = 0; k < 8; ++k) {  // k-steps 0, 1 (keys 0..31) then 2, 3
        pa[k] = w ? po[k] : ph[k];
        pa[8 + k] = w ? ph[k] : po[k];
      }
    }
    // O_w += P V[:, 256 w ..]
    wg_fence();
    const uint64_t dv0 = desc_mn(kt + 4 * w * kSub);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_rs_m64n256k16_tb(o, pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3], dv0 + kk * (2048 >> 4), 1);
    if (i + 1 < nb) {
      wait_full(i + 1);
      issue_qk(i + 1);
    }
    wg_commit();
    wg_wait0();
    fence_regs(o);
    fence_regs(sc);
    mbar_arrive(empty0 + 8 * s);
    if (C == 2 && lt == 0) mbar_arrive_remote(mapa(empty0 + 8 * s, crank ^ 1));  // (the whole warpgroup's MMAs are done)
  }
  if (C == 2 && !kPersist) cluster_sync_all();  // no CTA leaves while its peer may still address it

  if constexpr (kSplit) {  // each warpgroup summed the weights of its own keys
    float2* xm = reinterpret_cast<float2*>(sm + kXOff + 16384);
    named_bar(1, 256);
    xm[w * 128 + lt] = make_float2(l_run[0], l_run[1]);
    named_bar(1, 256);
    const float2 ol = xm[(1 - w) * 128 + lt];
    l_run[0] += ol.x;
    l_run[1] += ol.y;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  if constexpr (kRed) {
    // Split-KV reduced in the cluster of the row's P.splits CTAs (rank = split): each CTA leaves its
    // unnormalised output and (max, sum) per head row in its own shared memory (Q and the key stages,
    // free after the last MMA), then merges rows rank, rank + splits, .. over every CTA's copy (DSMEM
    // loads) and writes them as sparse_attn_combine_kernel does (the same arithmetic and order).
    named_bar(3, 256);  // both warpgroups past their last MMA
    float* red = reinterpret_cast<float*>(sm);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = wi * 16 + g + 8 * i;
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<float2*>(red + r * kRS + w * 256 + 8 * j + 2 * qd) = make_float2(o[4 * j + 2 * i], o[4 * j + 2 * i + 1]);
      if (w == 0 && qd == 0) *reinterpret_cast<float2*>(sm + kRedMlOff + r * 8) = make_float2(m_run[i], l_run[i]);
    }
    cluster_sync_all();
    const int S = P.splits;
    const int rank = static_cast<int>(cluster_ctarank());
    const int ci = (tid - 128) & 127;  // columns 4 ci .. 4 ci + 3 of the row
    for (int r = rank + ((tid - 128) >> 7) * S; r < 64; r += 2 * S) {  // (warp-uniform)
      const int h = head0 + r;
      const int64_t th = t * P.H + h;
      const float sk = P.sink[h] * kLog2e;
      float2 ml[kMaxRed];
      float M = sk;
#pragma unroll
      for (int s2 = 0; s2 < kMaxRed; ++s2) {
        ml[s2] = make_float2(-INFINITY, 0.f);
        if (s2 < S) ml[s2] = ld_dsmem_f2(mapa(sb + kRedMlOff + r * 8, s2));
        M = fmaxf(M, ml[s2].x);
      }
      if (M == -INFINITY) M = 0.f;
      float acc[4] = {0.f, 0.f, 0.f, 0.f}, l = 0.f;
#pragma unroll
      for (int s2 = 0; s2 < kMaxRed; ++s2) {
        if (s2 >= S || ml[s2].y == 0.f) continue;
        const float wt = exp2f(ml[s2].x - M);
        l += wt * ml[s2].y;
        const float4 v = ld_dsmem_f4(mapa(sb + static_cast<uint32_t>((r * kRS + 4 * ci) * 4), s2));
        acc[0] += wt * v.x, acc[1] += wt * v.y, acc[2] += wt * v.z, acc[3] += wt * v.w;
      }
      attn_dev::combine_row_out(P, t, th, acc, l, M, sk, ci);
    }
    cluster_sync_all();  // no CTA leaves while another may still read its shared memory
    return;
  }
  const int hrow[2] = {head0 + wi * 16 + g, head0 + wi * 16 + g + 8};
  // Without splits the output tile is staged in shared memory (key stage 0, free once both
  // warpgroups are past their last MMA) and stored with coalesced 16-byte stores.
  uint8_t* stage = nullptr;
  if (P.splits == 1) {
    named_bar(3, 256);
    stage = sm + (kPersist ? kQOff : kKOff);  // (kPersist: the producer may be filling the key stages)
  }
  attn_dev::write_output<true>(P, t, hrow, w, qd, m_run, l_run,
                         [&](int j, int i, int k) -> float& { return o[4 * j + 2 * i + k]; }, stage, head0);
  if (stage != nullptr) {
    named_bar(3, 256);
    attn_dev::store_staged(P, t, head0, stage, tid - 128, 256);
    if (kPersist) named_bar(3, 256);  // the tile read out before the next item's Q lands there
  }
  }  // items
  if (C == 2 && kPersist) cluster_sync_all();  // no CTA leaves while its peer may still address it
#else
  __trap();
#endif
}

}  // namespace attn_wg
}  // namespace deepfuse
