// Prefill-path expert GEMMs of moe_experts (T > 256, tasks of <= 128 positions; semantics:
// deepfuse/ops/moe.py; the plan, combine and the other paths: moe_experts.cu, moe_stream.cu).
//
// Tokens are wgmma's M side (a tile is one task's 128 positions, two warpgroups of 64 rows), the
// weights its N side (BN = 128 or 256 rows per tile: GEMM1 BN / 2 w1 rows + the w3 rows of the same
// columns, GEMM2 BN w2 rows), so every weight tile is read once per task; each MMA is m64n128k32
// (BN = 256: two groups per chunk, the producer warpgroup's registers moved to the consumers).
// - The activations are laid out in position order first (gather_cast_kernel: x through the
//   plan's token rows, or h as is -> e4m3 rows + fp32 scales per 128, fp8_group_cast's math, bit
//   identical; the scales transposed [K / 128, P] so that a tile's 128 row scales of one chunk are
//   one TMA box). A task's rows are then a contiguous box of 128 rows: rows past the
//   task's end (the next expert's, or zero-filled past the buffer) are computed and not stored.
// - Persistent CTAs (one per SM, 384 threads) walk the tiles (task, n-tile) with a stride of the
//   grid, n-tile fastest (the CTAs in flight share a task's activations in L2; an expert's weights
//   are read once per task).
// - Producer warp: per 128-K chunk one stage = A box (16 KB) + B boxes (16 KB) + the 128 row
//   scales (from the row rounded down to a multiple of 4: a box starts 16-byte aligned) by TMA,
//   the chunk's weight block scale(s) (prefetched per tile into the warp's registers) next to
//   them; full / empty mbarriers; it runs ahead across tiles.
// - Consumers: four m64n128k32 wgmmas per chunk into a partial accumulator, waited, the stage
//   released, then promoted with (row scale x weight block scale) into the fp32 accumulator
//   (DeepGEMM's promotion); the two warpgroups interleave (one promotes while the other's MMAs run).
// - Epilogues: GEMM1 the clamped SwiGLU (gate and up of a column sit in the same thread), h as
//   bf16; GEMM2 times the routing weight, fp32 rows per position (then the combine kernel).
// Each tile walks K from a chunk that depends on (n-tile, expert) only (CTAs in flight together then
// read different columns of their weight rows, spread over the DRAM channels, as in the decode
// kernels; DEEPFUSE_MOE_PREFILL_NO_ROT=1 walks from chunk 0, for comparisons): a row's result
// depends on its own inputs only (bitwise reproducible, independent of the plan's placement).
// Dense mode (DENSE kernels, `linear_prefill`: quant_linear / grouped_linear with fp8 weights at large M):
// the same kernel with one "expert" and no routing, tiles (group, m-tile, n-tile), bf16 / fp32 out; optionally
// (MC = 2) 2-CTA clusters of two m-tiles, each CTA loading half of the 256 weight rows multicast to both.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "common/arch.h"
#include "common/cuda_utils.h"
#include "common/fp8_utils.cuh"
#include "gemm/grouped_gemm_sm90.cuh"
#include "gemm/tma_sm90.cuh"
#include "moe/moe_prefill.h"

namespace deepfuse {
namespace {

constexpr int kBM = 128;                  // positions per tile
constexpr int kConsumers = 256;           // two warpgroups
constexpr int kThreads = kConsumers + 128; // + the producer warpgroup (one warp issues)
constexpr int kStageA = kBM * 128;
constexpr int kMaxKB = 64;                // K <= 8192 (the op's limit; the producer's scale registers)
// A tile's row scales of one chunk: a TMA box of kASBox fp32 from the task's first row rounded
// down to a multiple of 4 (a box's global start must be 16-byte aligned); kASStride per stage
constexpr int kASBox = kBM + 4, kASStride = 160;

struct Maps {
  CUtensorMap a, as, w0, w1, s0, s1;  // A [P, K] e4m3; A scales [KB, Pp] fp32; routed w1 | w3 or w2; shared
};

struct Args {
  int K, N, E, KB;        // N: GEMM1 inter (h columns), GEMM2 d
  const void* scale0;     // routed block scales of w0 / w1: [E, ceil(Nw/128), KB] (fp32 / UE8M0)
  const void* scale1;
  bool scale_u8;
  const void* sscale0;    // shared expert's: [ceil(Nw/128), KB]
  const void* sscale1;
  bool sscale_u8;
  int NBw;                // 128-row scale blocks of one expert's weight (ceil(Nw / 128))
  const int* tasks;
  const int* ntasks;
  int ntiles;             // n-tiles per task
  void* out;              // GEMM1: h bf16 [P, N]; GEMM2: Y fp32 [P, N]
  const float* row_weight;
  float limit;
  int rotate;             // 1: each tile walks K from a chunk that depends on (n-tile, expert) only
};

// Dense mode (fp8 linears, the DENSE kernels; the MoE kernels keep Args): G groups (block-diagonal
// weights; 1: dense) of R weight rows each, M rows, tiles (group, m unit, n-tile), m unit fastest when
// m_fast; out [M, out_pitch] bf16 / fp32.
struct DenseArgs : Args {
  int M, G, R, mtiles, dense_total, out_pitch, out_f32, m_fast;
  int munits;             // m units per (group, n-tile): m-tiles, or pairs of them (MC = 2)
};
template <bool DENSE>
using ArgsOf = std::conditional_t<DENSE, DenseArgs, Args>;

// The tile's (group, m-tile, n-tile) in dense mode.
struct DenseTile {
  int g, r0, r1, t;
};
// MC = 2: tile counts m-tile pairs (a 2-CTA cluster; rank: which of the pair), r1 <= r0 past M.
template <int MC>
__device__ __forceinline__ DenseTile dense_tile(const DenseArgs& a, int tile, int rank) {
  const int per = a.munits * a.ntiles, g = tile / per, rem = tile - g * per;
  const int mu = a.m_fast ? rem % a.munits : rem / a.ntiles;
  const int t = a.m_fast ? rem / a.munits : rem % a.ntiles;
  const int r0 = (mu * MC + rank) * kBM;
  return DenseTile{g, r0, min(a.M, r0 + kBM), t};
}

// Dense bf16 epilogue with 16-byte stores (EPI): a quad's lanes hold columns 8 j + 2 t4, + 1 of a row; per
// four j the quad transposes its 4 x 4 words (two shfl_xor rounds) so that lane t4 holds columns
// 32 q + 8 t4 .. + 7: one 16-byte store per lane instead of four 4-byte ones (full 32-byte sectors).
// Needs R and the row pitch multiples of 8 (host).
template <int BN>
__device__ __forceinline__ void dense_store16(const DenseArgs& a, const float (&acc)[BN / 2], int r0, int r1, int m0r,
                                              int t, int g, int t4) {
  const bool b1 = t4 & 2, b0 = t4 & 1;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int p = r0 + m0r + 8 * hr;
    const bool ok = p < r1;
    __nv_bfloat16* y = static_cast<__nv_bfloat16*>(a.out) + static_cast<int64_t>(ok ? p : r0) * a.out_pitch +
                       static_cast<int64_t>(g) * a.R;
#pragma unroll
    for (int q = 0; q < BN / 32; ++q) {
      uint32_t w[4];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(acc[16 * q + 4 * jj + 2 * hr], acc[16 * q + 4 * jj + 2 * hr + 1]);
        w[jj] = *reinterpret_cast<const uint32_t*>(&v);
      }
      uint32_t x0 = __shfl_xor_sync(0xffffffffu, b1 ? w[0] : w[2], 2);
      uint32_t x1 = __shfl_xor_sync(0xffffffffu, b1 ? w[1] : w[3], 2);
      const uint32_t y0 = b1 ? x0 : w[0], y1 = b1 ? x1 : w[1], y2 = b1 ? w[2] : x0, y3 = b1 ? w[3] : x1;
      x0 = __shfl_xor_sync(0xffffffffu, b0 ? y0 : y1, 1);
      x1 = __shfl_xor_sync(0xffffffffu, b0 ? y2 : y3, 1);
      const int c = t * BN + 32 * q + 8 * t4;
      if (ok && c < a.R) *reinterpret_cast<uint4*>(y + c) = b0 ? make_uint4(x0, y1, x1, y3) : make_uint4(y0, x0, y2, x1);
    }
  }
}

// 2-CTA clusters (dense MC = 2): the weight tile multicast to both CTAs, consumers release both CTAs' stages.
__device__ __forceinline__ void tma_load_2d_mc(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar,
                                               uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive_peer(uint32_t bar, int peer) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(bar), "r"(peer));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(r) : "memory");
}

// BN weight rows per tile (128 or 256: NH halves of 128 = one m64n128k32 wgmma group each per
// warpgroup). GEMM1: the w1 rows of BN / 2 columns, then the w3 rows of the same columns; GEMM2: BN
// w2 rows. Weight block scales: GEMM1 w1 | w3 (each tile inside one 128-row block); GEMM2 BN = 256
// one block per half. Shared memory (from a 1024-aligned base): ring, row scales, weight scales, barriers.
template <int BN>
struct Cfg {
  static constexpr int NH = BN / 128;
  static constexpr int kStageB = BN * 128, kStage = kStageA + kStageB;
  static constexpr int kStages = BN == 128 ? 6 : 4;
  static constexpr int kOffAS = kStages * kStage;
  static constexpr int kOffWS = kOffAS + kStages * kASStride * 4;
  static constexpr int kOffBar = kOffWS + kStages * 2 * 4;
  static constexpr int kSmem = kOffBar + 2 * kStages * 8 + 1024;
  static_assert(kSmem <= 227 * 1024, "shared memory");
};

// ---------------------------------------------------------------------------------------------
// src rows (through rows[], or the position itself) -> q [P, K] e4m3 + sT [K / 128, Pp] fp32 for
// the plan's valid positions. One CTA of 256 threads per position; 16 lanes per 128-group.
template <typename AT>
__device__ __forceinline__ void cast_row(const AT* __restrict__ src, const int* __restrict__ rows, int valid, int K,
                                         int64_t Pp, uint8_t* __restrict__ q, float* __restrict__ sT) {
  const int p = blockIdx.x;
  if (p >= valid) return;
  const int64_t row = rows != nullptr ? rows[p] : p;
  const AT* s = src + row * K;
  uint8_t* o = q + static_cast<int64_t>(p) * K;
  for (int base = 0; base < K; base += 256 * 8) {
    const int k0 = base + threadIdx.x * 8;
    const bool ok = k0 < K;
    float v[8];
    if (ok) {
      load8(s + k0, v);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = 0.0f;
    }
    const float sc = tma::scale8_group128(v);
    if (ok) {
      *reinterpret_cast<uint2*>(o + k0) = to_e4m3x8(v);
      if ((threadIdx.x & 15) == 0) sT[static_cast<int64_t>(k0 / 128) * Pp + p] = sc;
    }
  }
}

template <typename AT>
__global__ void __launch_bounds__(256) gather_cast_kernel(const AT* __restrict__ src, const int* __restrict__ rows,
                                                          const int* __restrict__ tasks, const int* __restrict__ ntasks,
                                                          int K, int64_t Pp, uint8_t* __restrict__ q,
                                                          float* __restrict__ sT) {
  const int nt = *ntasks;
  cast_row(src, rows, nt > 0 ? tasks[(nt - 1) * 3 + 2] : 0, K, Pp, q, sT);
}

// Dense linears: rows 0 .. M - 1 as they are.
template <typename AT>
__global__ void __launch_bounds__(256) dense_cast_kernel(const AT* __restrict__ src, int M, int K, int64_t Pp,
                                                         uint8_t* __restrict__ q, float* __restrict__ sT) {
  cast_row(src, static_cast<const int*>(nullptr), M, K, Pp, q, sT);
}

__device__ __forceinline__ float sel4(const float (&r)[kMaxKB / 32], int j) {
  float v = r[0];
#pragma unroll
  for (int i = 1; i < kMaxKB / 32; ++i) v = j == i ? r[i] : v;
  return v;
}

template <bool SWIGLU, int BN, bool DENSE = false, int MC = 1, bool EPI = false>
__global__ void __launch_bounds__(kThreads, 1) moe_prefill_kernel(const ArgsOf<DENSE> a, const __grid_constant__ Maps maps) {
#if DEEPFUSE_SM90A_DEVICE
  using C = Cfg<BN>;
  constexpr int kStages = C::kStages, kStage = C::kStage, kStageB = C::kStageB, NH = C::NH;
  extern __shared__ char smem_raw[];
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  float* sAS = reinterpret_cast<float*>(base + C::kOffAS);
  float* sWS = reinterpret_cast<float*>(base + C::kOffWS);
  uint64_t* full = reinterpret_cast<uint64_t*>(base + C::kOffBar);
  uint64_t* empty = full + kStages;
  const int tid = threadIdx.x;
  // MC = 2 (dense, BN = 256): clusters of 2 CTAs walk m-tile pairs of one n-tile; CTA `rank` loads
  // its A and the weight half `rank`, multicast to both (each CTA's ring holds the whole tile)
  static_assert(MC == 1 || (DENSE && BN == 256 && MC == 2), "clusters: dense 128 x 256 only");
  const int rank = MC == 2 ? static_cast<int>(blockIdx.x & 1) : 0;
  const int cta = static_cast<int>(blockIdx.x) / MC, ctas = static_cast<int>(gridDim.x) / MC;
  int total;
  if constexpr (DENSE) total = a.dense_total;
  else total = *a.ntasks * a.ntiles;
  if (cta >= total) return;  // the whole CTA (MC = 2: the whole cluster)
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      tma::mbar_init(tma::smem_u32(full + s), 1);
      tma::mbar_init(tma::smem_u32(empty + s), 8 * MC);  // one arrival per consumer warp (of both CTAs)
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if constexpr (MC == 2) {  // the peer's barriers are initialised before anything reaches them
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
  } else {
    __syncthreads();
  }
  const int KB = a.KB;

  // BN = 256 needs 128 + 64 accumulator registers per consumer thread: the producer warpgroup gives
  // its registers to the consumers (384 threads launch at 168 each: 128 x 40 + 256 x 232 = 64512)
  if (tid >= kConsumers) {  // producer warpgroup: warp 8 issues every stage
    if constexpr (BN == 256) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (tid >= kConsumers + 32) return;
    const int lane = tid & 31;
    int i = 0;
    for (int tile = cta; tile < total; tile += ctas) {
      int t, e, r0, g = 0;
      if constexpr (DENSE) {
        const DenseTile d = dense_tile<MC>(a, tile, rank);
        t = d.t, e = 0, r0 = d.r0, g = d.g;
      } else {
        const int task = tile / a.ntiles;
        t = tile % a.ntiles, e = a.tasks[task * 3], r0 = a.tasks[task * 3 + 1];
      }
      const bool sh = !DENSE && e == a.E;
      // the tile's weight block scales over K, lane l holding chunks l, l + 32, ...: r0s the first
      // half's (GEMM1 BN = 128: the w1 rows), r1s the second's (the w3 rows; GEMM2 BN = 256: the next block)
      int nb0 = SWIGLU ? (t * (BN / 2)) / 128 : t * NH;
      if constexpr (DENSE) nb0 = (g * a.R + t * BN) / 128;
      const int nb1 = SWIGLU ? nb0 : nb0 + 1;
      const void* sp0 = sh ? a.sscale0 : a.scale0;
      const void* sp1 = sh ? a.sscale1 : a.scale1;
      const bool u8 = sh ? a.sscale_u8 : a.scale_u8;
      const int64_t sbase = static_cast<int64_t>(sh ? 0 : e) * a.NBw;
      const bool has1 = SWIGLU || (NH == 2 && nb1 < a.NBw);
      float r0s[kMaxKB / 32], r1s[kMaxKB / 32];
#pragma unroll
      for (int j = 0; j < kMaxKB / 32; ++j) {
        const int kb = lane + 32 * j;
        r0s[j] = r1s[j] = 0.0f;
        if (kb < KB) {
          const int64_t o0 = (sbase + nb0) * KB + kb, o1 = (sbase + nb1) * KB + kb;
          r0s[j] = u8 ? gemm::ue8m0_value(static_cast<const uint8_t*>(sp0)[o0]) : static_cast<const float*>(sp0)[o0];
          if (has1)
            r1s[j] = u8 ? gemm::ue8m0_value(static_cast<const uint8_t*>(sp1)[o1]) : static_cast<const float*>(sp1)[o1];
        }
      }
      const CUtensorMap* m0 = sh ? &maps.s0 : &maps.w0;
      const CUtensorMap* m1 = sh ? &maps.s1 : &maps.w1;
      // weight rows per expert: GEMM1 inter, GEMM2 d; dense: R per group
      int rb = sh ? 0 : e * a.N, rot = a.rotate ? (t * 5 + e * 11) % KB : 0;
      if constexpr (DENSE) {  // the start depends on the 256 columns only (a row's result independent of M and BN)
        rb = g * a.R;
        rot = a.rotate ? ((t * BN) / 256 * 5 + g * 11) % KB : 0;
      }
      const int ka = DENSE ? g * KB : 0;  // dense: the group's first chunk in A's rows and scale rows
      for (int u = 0; u < KB; ++u, ++i) {
        const int kb = u + rot < KB ? u + rot : u + rot - KB;
        const float w0 = __shfl_sync(0xffffffffu, sel4(r0s, kb >> 5), kb & 31);
        const float w1 = SWIGLU || NH == 2 ? __shfl_sync(0xffffffffu, sel4(r1s, kb >> 5), kb & 31) : w0;
        if (lane == 0) {
          const int st = i % kStages;
          if (i >= kStages) tma::mbar_wait(tma::smem_u32(empty + st), ((i / kStages) - 1) & 1);
          sWS[st * 2] = w0;
          sWS[st * 2 + 1] = w1;
          const uint32_t bar = tma::smem_u32(full + st);
          const uint32_t dA = tma::smem_u32(base + st * kStage), dB = dA + kStageA;
          tma::mbar_expect_tx(bar, kStage + kASBox * 4);
          tma::tma_load_2d(dA, &maps.a, (ka + kb) * 128, r0, bar);
          tma::tma_load_2d(tma::smem_u32(sAS + st * kASStride), &maps.as, r0 & ~3, ka + kb, bar);
          if (SWIGLU) {  // w1 rows, then the w3 rows of the same BN / 2 columns
            tma::tma_load_2d(dB, m0, kb * 128, rb + t * (BN / 2), bar);
            tma::tma_load_2d(dB + kStageB / 2, m1, kb * 128, rb + t * (BN / 2), bar);
          } else if constexpr (MC == 2) {  // this CTA's half of the weight rows, into both CTAs
            tma_load_2d_mc(dB + rank * 16384, m0, kb * 128, rb + t * BN + rank * 128, bar, 3);
          } else {  // (BN = 256 on the last tile of an expert whose rows end at 128: the next rows, not stored)
#pragma unroll
            for (int h = 0; h < NH; ++h) tma::tma_load_2d(dB + h * 16384, m0, kb * 128, rb + t * BN + h * 128, bar);
          }
        }
        __syncwarp();
      }
    }
    if constexpr (MC == 2) {  // no exit while the peer's consumers may still arrive on this CTA's barriers
      if (lane == 0)
        for (int s = 0; s < kStages && s < i; ++s) {
          const int il = s + (i - 1 - s) / kStages * kStages;  // the last chunk in stage s
          tma::mbar_wait(tma::smem_u32(empty + s), (il / kStages) & 1);
        }
      __syncwarp();
    }
    return;
  }

  // consumers: warpgroup wg owns rows [64 wg, 64 wg + 64) of every tile
  if constexpr (BN == 256) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int wg = tid >> 7, wq = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int m0r = wg * 64 + wq * 16 + g;  // this thread's tile rows m0r, m0r + 8
  int i = 0;
  float acc[NH * 64];
  for (int tile = cta; tile < total; tile += ctas) {
    int t, r0, r1, g = 0;
    if constexpr (DENSE) {
      const DenseTile d = dense_tile<MC>(a, tile, rank);
      t = d.t, r0 = d.r0, r1 = d.r1, g = d.g;
    } else {
      const int task = tile / a.ntiles;
      t = tile % a.ntiles, r0 = a.tasks[task * 3 + 1], r1 = a.tasks[task * 3 + 2];
    }
#pragma unroll
    for (int c = 0; c < NH * 64; ++c) acc[c] = 0.0f;
    for (int u = 0; u < KB; ++u, ++i) {
      const int st = i % kStages;
      tma::mbar_wait(tma::smem_u32(full + st), (i / kStages) & 1);
      const uint32_t aa = tma::smem_u32(base + st * kStage) + wg * 64 * 128;
      const uint32_t ba = tma::smem_u32(base + st * kStage + kStageA);
      const float* as = sAS + st * kASStride + (r0 & 3) + m0r;
      const float sa0 = as[0], sa1 = as[8];
      const float w0 = sWS[st * 2], w1 = sWS[st * 2 + 1];
      const float s00 = sa0 * w0, s10 = sa1 * w0, s01 = sa0 * w1, s11 = sa1 * w1;
#pragma unroll
      for (int h = 0; h < NH; ++h) {  // 128 weight rows each: wgmmas, wait, promote
        float part[64];
        gemm::wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k)
          gemm::wgmma_m64n128k32(part, gemm::smem_desc(aa + k * 32), gemm::smem_desc(ba + h * 16384 + k * 32), k);
        gemm::wgmma_commit();
        gemm::wgmma_wait0();
        gemm::fence_regs(part);
        if (h == NH - 1) {
          __syncwarp();
          if (lane == 0) {
            tma::mbar_arrive(tma::smem_u32(empty + st));
            if constexpr (MC == 2) mbar_arrive_peer(tma::smem_u32(empty + st), rank ^ 1);
          }
        }
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const bool second = NH == 2 ? h == 1 : (SWIGLU && j >= 8);  // w1's scale
          float* d = acc + h * 64 + 4 * j;
          d[0] += part[4 * j + 0] * (second ? s01 : s00);
          d[1] += part[4 * j + 1] * (second ? s01 : s00);
          d[2] += part[4 * j + 2] * (second ? s11 : s10);
          d[3] += part[4 * j + 3] * (second ? s11 : s10);
        }
      }
    }
    // epilogue: rows m0r (acc[4 j + b]) and m0r + 8 (acc[4 j + 2 + b]), tile columns 8 j + 2 t4 + b
    if constexpr (DENSE && EPI) dense_store16<BN>(a, acc, r0, r1, m0r, t, g, t4);
#pragma unroll
    for (int hr = 0; hr < (DENSE && EPI ? 0 : 2); ++hr) {
      const int p = r0 + m0r + 8 * hr;
      if (p >= r1) continue;
      if constexpr (DENSE) {  // columns t BN + 8 j + 2 t4 (+ 1) of group g, those < R stored
        const int c0 = t * BN + 2 * t4;
        const int64_t o = static_cast<int64_t>(p) * a.out_pitch + static_cast<int64_t>(g) * a.R + c0;  // dense only
        if (a.out_f32) {
          float* y = static_cast<float*>(a.out) + o;
#pragma unroll
          for (int j = 0; j < BN / 8; ++j)
            if (c0 + 8 * j < a.R) *reinterpret_cast<float2*>(y + 8 * j) = make_float2(acc[4 * j + 2 * hr], acc[4 * j + 2 * hr + 1]);
        } else {
          __nv_bfloat16* y = static_cast<__nv_bfloat16*>(a.out) + o;
#pragma unroll
          for (int j = 0; j < BN / 8; ++j)
            if (c0 + 8 * j < a.R)
              *reinterpret_cast<__nv_bfloat162*>(y + 8 * j) = __floats2bfloat162_rn(acc[4 * j + 2 * hr], acc[4 * j + 2 * hr + 1]);
        }
      } else if (SWIGLU) {  // gate column c in acc[4 j ..], its up column in acc[BN / 4 + 4 j ..]
        __nv_bfloat16* h =
            static_cast<__nv_bfloat16*>(a.out) + static_cast<int64_t>(p) * a.N + t * (BN / 2) + 2 * t4;
#pragma unroll
        for (int j = 0; j < BN / 16; ++j) {
          const float v0 = gemm::swiglu_f(acc[4 * j + 2 * hr], acc[BN / 4 + 4 * j + 2 * hr], a.limit);
          const float v1 = gemm::swiglu_f(acc[4 * j + 2 * hr + 1], acc[BN / 4 + 4 * j + 2 * hr + 1], a.limit);
          *reinterpret_cast<__nv_bfloat162*>(h + 8 * j) = __floats2bfloat162_rn(v0, v1);
        }
      } else {
        const float w = a.row_weight[p];
        float* y = static_cast<float*>(a.out) + static_cast<int64_t>(p) * a.N + t * BN + 2 * t4;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
          if (NH == 1 || j < 16 || t * BN + 128 < a.N)
            *reinterpret_cast<float2*>(y + 8 * j) = make_float2(acc[4 * j + 2 * hr] * w, acc[4 * j + 2 * hr + 1] * w);
      }
    }
  }
#else
  __trap();  // wgmma / TMA: sm_90a only (launchers call require_sm90a)
#endif
}

// Dense 2-CTA clusters: grid = 2 x min(the clusters that fit at once, the tile pairs).
void launch_dense_mc(const DenseArgs& a, const Maps& maps, cudaStream_t stream) {
  auto kern = moe_prefill_kernel<false, 256, true, 2>;
  constexpr int smem = Cfg<256>::kSmem;
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeClusterDimension;
  at[0].val.clusterDim.x = 2;
  at[0].val.clusterDim.y = 1;
  at[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  static const int clusters = [&] {
    check_cuda(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
               "cudaFuncSetAttribute(moe_prefill_kernel)");
    cudaLaunchConfig_t q = cfg;
    q.gridDim = dim3(2 * 66, 1, 1);
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, kern, &q) != cudaSuccess || n < 1) {
      cudaGetLastError();
      n = num_sms() / 2;
    }
    return n;
  }();
  cfg.gridDim = dim3(2 * std::min(clusters, a.dense_total), 1, 1);
  check_cuda(cudaLaunchKernelEx(&cfg, kern, a, maps), "moe_prefill_kernel (clusters)");
}

template <bool SWIGLU, int BN, bool DENSE = false, bool EPI = false>
void launch(const ArgsOf<DENSE>& a, const Maps& maps, int grid, cudaStream_t stream) {
  auto kern = moe_prefill_kernel<SWIGLU, BN, DENSE, 1, EPI>;
  constexpr int smem = Cfg<BN>::kSmem;
  static const cudaError_t attr = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  check_cuda(attr, "cudaFuncSetAttribute(moe_prefill_kernel)");
  kern<<<grid, kThreads, smem, stream>>>(a, maps);
  check_launch("moe_prefill_kernel");
}

// ---------------------------------------------------------------------------------------------
// MXFP4 experts (uint8 packed e2m1 [E, N, K / 2], UE8M0 scales [E, N, K / 32]); the shared expert
// stays fp8. Tiles of 128 positions x 128 weight rows (GEMM1: 64 w1 rows + the w3 rows of the same
// columns). Three roles: a producer warp (TMA: A box, row scales, packed weights; cp.async: the
// rows' four group scales of the chunk), decode warps (packed e2m1 -> 128-byte-swizzled e4m3
// B tile + one fp32 scale per weight row and chunk), two consumer warpgroups (as above, promoting
// with row scale x column scale). Stage s holds chunk i (s = i % S) in both its load area and its
// decoded area: the producer refills stage s only after the consumers (B, A) and the decoders
// (packed bytes) are done with chunk i - S, so the decoders need no empty barrier.
// Scale fold: a weight row's chunk has four group exponents s_g, s_max their largest; group g is
// decoded as v * 2^(6 - (s_max - s_g)) (e2m1 v) and the chunk's products are promoted with
// 2^(s_max - 133): w = v 2^(s_g - 127) exactly whenever s_max - s_g <= 14 (every e2m1 value times
// 2^t for t in [-8, 6] is an e4m3 value). A larger spread rounds that group's values to e4m3's
// subnormal grid (round to nearest even): |error| <= 2^-10 2^(s_max - 133) = 2^-16 2^(s_max - 127)
// per weight. Shared-expert tiles (fp8): TMA writes the B tile straight into the decoded area; the
// decoders only write the block scale per column.
constexpr int kMxOffBd = kStageA;                // decoded B (16 KB, swizzled)
constexpr int kMxOffBl = kStageA + 16384;        // packed B (8 KB)
constexpr int kMxStage = kMxOffBl + 8192;        // 40 KB, a multiple of 1024
template <int S>  // S stages (5; 4 for comparisons)
struct MxCfg {
  static constexpr int kOffAS = S * kMxStage;                   // row scales [stage][kASStride]
  static constexpr int kOffBS = kOffAS + S * kASStride * 4;     // group scale words [stage][128]
  static constexpr int kOffCS = kOffBS + S * 128 * 4;           // column scales [stage][128]
  static constexpr int kOffWS = kOffCS + S * 128 * 4;           // shared tiles' block scales [stage][2]
  static constexpr int kOffBar = kOffWS + S * 2 * 4;
  static constexpr int kSmem = kOffBar + 3 * S * 8 + 1024;
  static_assert(kSmem <= 227 * 1024, "shared memory");
};

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// The eight e4m3 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} x 2^(6 - dd) as a prmt table (bytes 0..7).
__device__ __forceinline__ void e2m1_table(int dd, uint32_t& tl, uint32_t& th) {
  if (dd <= 11) {  // all normal: the exponent field moves by -dd
    tl = 0x6C686000u - static_cast<uint32_t>(dd) * 0x08080800u;
    th = 0x7C787470u - static_cast<uint32_t>(dd) * 0x08080808u;
  } else {  // subnormal / underflowing results: round to nearest even
    const float f = __int_as_float((127 + 6 - min(dd, 40)) << 23);
    const uint32_t a = __nv_cvt_float2_to_fp8x2(make_float2(0.0f, 0.5f * f), __NV_SATFINITE, __NV_E4M3);
    const uint32_t b = __nv_cvt_float2_to_fp8x2(make_float2(f, 1.5f * f), __NV_SATFINITE, __NV_E4M3);
    const uint32_t c = __nv_cvt_float2_to_fp8x2(make_float2(2.0f * f, 3.0f * f), __NV_SATFINITE, __NV_E4M3);
    const uint32_t e = __nv_cvt_float2_to_fp8x2(make_float2(4.0f * f, 6.0f * f), __NV_SATFINITE, __NV_E4M3);
    tl = a | (b << 16);
    th = c | (e << 16);
  }
}

// Eight packed e2m1 (element 2i in the low nibble of byte i) -> eight e4m3 bytes in element order:
// magnitudes from the table, sign from the nibble's bit 3 (prmt's sign mode on 0x7F: 0x00 when set).
__device__ __forceinline__ uint2 e2m1x8_lut(uint32_t x, uint32_t tl, uint32_t th) {
  const uint32_t m = x & 0x77777777u, xh = x >> 16;
  const uint32_t p0 = prmt(tl, th, m), p1 = prmt(tl, th, m >> 16);
  const uint32_t a0 = prmt(0x7F7F7F7Fu, 0x7F7F7F7Fu, x) + 0x01010101u;  // 0x80: positive, 0x01: negative
  const uint32_t a1 = prmt(0x7F7F7F7Fu, 0x7F7F7F7Fu, xh) + 0x01010101u;
  return make_uint2((~a0 & 0x80808080u) | p0, (~a1 & 0x80808080u) | p1);
}

__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// NDEC decode warps (warps 9 ..): 3 (384 threads, 168 registers each) or 7 (512 threads: the two
// non-consumer warpgroups drop to 88 registers, the consumers rise to 168).
// RACE (a checking variant for compute-sanitizer's racecheck, DEEPFUSE_MOE_PREFILL_MX_RACE=1; same results):
// every thread that touched cs[] / sWS arrives on the stage's barriers itself (dfull: every decode thread;
// empty: every consumer and decode thread) instead of lane 0 after __syncwarp, and the decode warps wait on
// `empty` of chunk i - S themselves (implied by their wait on `full`, which racecheck sees only through the
// TMA's complete-tx): the same happens-before edges, each stated per thread.
template <bool SWIGLU, int NDEC, int S, bool RACE = false>
__global__ void __launch_bounds__(kConsumers + 32 + 32 * NDEC, 1)
    moe_prefill_mx_kernel(const Args a, const __grid_constant__ Maps maps) {
#if DEEPFUSE_SM90A_DEVICE
  using C = MxCfg<S>;
  constexpr int kMxDec = 32 * NDEC;
  static_assert(NDEC == 3 || NDEC == 7, "decode warps");
  extern __shared__ char smem_raw[];
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  float* sAS = reinterpret_cast<float*>(base + C::kOffAS);
  uint32_t* sBS = reinterpret_cast<uint32_t*>(base + C::kOffBS);
  float* sCS = reinterpret_cast<float*>(base + C::kOffCS);
  float* sWS = reinterpret_cast<float*>(base + C::kOffWS);
  uint64_t* full = reinterpret_cast<uint64_t*>(base + C::kOffBar);
  uint64_t* empty = full + S;
  uint64_t* dfull = empty + S;
  const int tid = threadIdx.x, lane = tid & 31;
  const int total = *a.ntasks * a.ntiles;
  if (static_cast<int>(blockIdx.x) >= total) return;  // the whole CTA
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      tma::mbar_init(tma::smem_u32(full + s), 1 + 32);  // expect_tx + the producer lanes' cp.async arrivals
      tma::mbar_init(tma::smem_u32(empty + s), RACE ? kConsumers + 32 * NDEC : 8 + NDEC);  // consumer + decode warps
      tma::mbar_init(tma::smem_u32(dfull + s), RACE ? 32 * NDEC : NDEC);  // one arrival per decode warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int KB = a.KB, KS = KB * 4;  // KS: group scales per weight row

  if (tid >= kConsumers) {  // the producer warp and the decode warps
    if constexpr (NDEC == 7) asm volatile("setmaxnreg.dec.sync.aligned.u32 88;\n" ::: "memory");
    if (tid >= kConsumers + 32) {  // decode warps
      const int q0 = tid - (kConsumers + 32);
      int i = 0;
      for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
        const bool sh = a.tasks[(tile / a.ntiles) * 3] == a.E;
        for (int u = 0; u < KB; ++u, ++i) {
          const int st = i % S;
          tma::mbar_wait(tma::smem_u32(full + st), (i / S) & 1);
          if constexpr (RACE)
            if (i >= S) tma::mbar_wait(tma::smem_u32(empty + st), ((i / S) - 1) & 1);
          float* cs = sCS + st * 128;
          if (sh) {  // fp8 block scale per column (GEMM1: w1 columns 0..63, w3 64..127)
            const float w0 = sWS[st * 2], w1 = sWS[st * 2 + 1];
            for (int n = q0; n < 128; n += kMxDec) cs[n] = SWIGLU && n >= 64 ? w1 : w0;
          } else {
            const char* bl = base + st * kMxStage + kMxOffBl;
            char* bd = base + st * kMxStage + kMxOffBd;
            // units q = (weight row, 32-group) of 16 packed bytes: q0 + j kMxDec (the group q0 & 3 is the
            // thread's own); all loads first, then the decodes
            constexpr int kU = (512 + kMxDec - 1) / kMxDec;
            const int g = q0 & 3;
            uint32_t wv[kU];
            uint4 pv[kU];
#pragma unroll
            for (int j = 0; j < kU; ++j) {
              const int q = q0 + j * kMxDec;
              if (q < 512) {
                wv[j] = sBS[st * 128 + (q >> 2)];
                pv[j] = *reinterpret_cast<const uint4*>(bl + q * 16);
              }
            }
#pragma unroll
            for (int j = 0; j < kU; ++j) {
              const int q = q0 + j * kMxDec, row = q >> 2;
              if (q < 512) {
                const uint32_t w = wv[j];
                const int smax =
                    static_cast<int>(max(max(w & 0xFFu, (w >> 8) & 0xFFu), max((w >> 16) & 0xFFu, w >> 24)));
                uint32_t tl, th;
                e2m1_table(smax - static_cast<int>((w >> (8 * g)) & 0xFFu), tl, th);
                const uint2 o0 = e2m1x8_lut(pv[j].x, tl, th), o1 = e2m1x8_lut(pv[j].y, tl, th);
                const uint2 o2 = e2m1x8_lut(pv[j].z, tl, th), o3 = e2m1x8_lut(pv[j].w, tl, th);
                char* r = bd + row * 128;
                *reinterpret_cast<uint4*>(r + (((2 * g) ^ (row & 7)) << 4)) = make_uint4(o0.x, o0.y, o1.x, o1.y);
                *reinterpret_cast<uint4*>(r + (((2 * g + 1) ^ (row & 7)) << 4)) = make_uint4(o2.x, o2.y, o3.x, o3.y);
                if (g == 0)  // 2^(s_max - 133)
                  cs[row] = smax >= 7 ? __int_as_float((smax - 6) << 23) : ldexpf(1.0f, smax - 133);
              }
            }
          }
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // B (generic stores) -> wgmma
          __syncwarp();
          if (RACE || lane == 0) {
            tma::mbar_arrive(tma::smem_u32(dfull + st));
            tma::mbar_arrive(tma::smem_u32(empty + st));
          }
        }
      }
      return;
    }

    {  // producer warp
      int i = 0;
      for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
        const int task = tile / a.ntiles, t = tile % a.ntiles;
        const int e = a.tasks[task * 3], r0 = a.tasks[task * 3 + 1];
        const bool sh = e == a.E;
        // shared tiles: the fp8 block scales over K, lane l holding chunks l, l + 32, ...
        float r0s[kMaxKB / 32], r1s[kMaxKB / 32];
        if (sh) {
          const int nb = SWIGLU ? (t * 64) / 128 : t;
          const bool u8 = a.sscale_u8;
  #pragma unroll
          for (int j = 0; j < kMaxKB / 32; ++j) {
            const int kb = lane + 32 * j;
            r0s[j] = r1s[j] = 0.0f;
            if (kb < KB) {
              const int64_t o = static_cast<int64_t>(nb) * KB + kb;
              r0s[j] = u8 ? gemm::ue8m0_value(static_cast<const uint8_t*>(a.sscale0)[o])
                          : static_cast<const float*>(a.sscale0)[o];
              r1s[j] = u8 ? gemm::ue8m0_value(static_cast<const uint8_t*>(a.sscale1)[o])
                          : static_cast<const float*>(a.sscale1)[o];
            }
          }
        }
        // routed tiles: the group scale rows of this tile's weight rows (lane: rows lane + 32 j)
        const uint8_t* srow[4];
  #pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int r = lane + 32 * j;
          const uint8_t* sp = static_cast<const uint8_t*>(SWIGLU && r >= 64 ? a.scale1 : a.scale0);
          const int64_t wr = SWIGLU ? static_cast<int64_t>(e) * a.N + t * 64 + (r & 63)
                                    : static_cast<int64_t>(e) * a.N + t * 128 + r;
          srow[j] = sp + wr * KS;
        }
        const int rb = sh ? 0 : e * a.N;
        const int rot = a.rotate ? (t * 5 + e * 11) % KB : 0;
        for (int u = 0; u < KB; ++u, ++i) {
          const int kb = u + rot < KB ? u + rot : u + rot - KB;
          float w0 = 0.0f, w1 = 0.0f;
          if (sh) {
            w0 = __shfl_sync(0xffffffffu, sel4(r0s, kb >> 5), kb & 31);
            w1 = __shfl_sync(0xffffffffu, sel4(r1s, kb >> 5), kb & 31);
          }
          const int st = i % S;
          if (lane == 0 && i >= S) tma::mbar_wait(tma::smem_u32(empty + st), ((i / S) - 1) & 1);
          __syncwarp();
          const uint32_t bar = tma::smem_u32(full + st);
          if (!sh) {
  #pragma unroll
            for (int j = 0; j < 4; ++j) cp_async4(tma::smem_u32(sBS + st * 128 + lane + 32 * j), srow[j] + kb * 4);
          }
          cp_async_arrive(bar);
          if (lane == 0) {
            const uint32_t dA = tma::smem_u32(base + st * kMxStage);
            const uint32_t dBd = dA + kMxOffBd, dBl = dA + kMxOffBl;
            if (sh) sWS[st * 2] = w0, sWS[st * 2 + 1] = w1;  // before the arrival below
            tma::mbar_expect_tx(bar, kStageA + (sh ? 16384 : 8192) + kASBox * 4);
            tma::tma_load_2d(dA, &maps.a, kb * 128, r0, bar);
            tma::tma_load_2d(tma::smem_u32(sAS + st * kASStride), &maps.as, r0 & ~3, kb, bar);
            if (sh) {
              if (SWIGLU) {
                tma::tma_load_2d(dBd, &maps.s0, kb * 128, t * 64, bar);
                tma::tma_load_2d(dBd + 8192, &maps.s1, kb * 128, t * 64, bar);
              } else {
                tma::tma_load_2d(dBd, &maps.s0, kb * 128, t * 128, bar);
              }
            } else if (SWIGLU) {  // packed rows: 64 bytes per 128-K chunk
              tma::tma_load_2d(dBl, &maps.w0, kb * 64, rb + t * 64, bar);
              tma::tma_load_2d(dBl + 4096, &maps.w1, kb * 64, rb + t * 64, bar);
            } else {
              tma::tma_load_2d(dBl, &maps.w0, kb * 64, rb + t * 128, bar);
            }
          }
          __syncwarp();
        }
      }
      return;
    }
  }

  // consumers: warpgroup wg owns rows [64 wg, 64 wg + 64) of every tile
  if constexpr (NDEC == 7) asm volatile("setmaxnreg.inc.sync.aligned.u32 168;\n" ::: "memory");
  const int wg = tid >> 7, wq = (tid >> 5) & 3, g = lane >> 2, t4 = lane & 3;
  const int m0r = wg * 64 + wq * 16 + g;
  int i = 0;
  float acc[64];
  for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
    const int task = tile / a.ntiles, t = tile % a.ntiles;
    const int r0 = a.tasks[task * 3 + 1], r1 = a.tasks[task * 3 + 2];
#pragma unroll
    for (int c = 0; c < 64; ++c) acc[c] = 0.0f;
    for (int u = 0; u < KB; ++u, ++i) {
      const int st = i % S;
      tma::mbar_wait(tma::smem_u32(full + st), (i / S) & 1);
      tma::mbar_wait(tma::smem_u32(dfull + st), (i / S) & 1);
      const uint32_t aa = tma::smem_u32(base + st * kMxStage) + wg * 64 * 128;
      const uint32_t ba = tma::smem_u32(base + st * kMxStage + kMxOffBd);
      const float* as = sAS + st * kASStride + (r0 & 3) + m0r;
      const float sa0 = as[0], sa1 = as[8];
      float part[64];
      gemm::wgmma_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k)
        gemm::wgmma_m64n128k32(part, gemm::smem_desc(aa + k * 32), gemm::smem_desc(ba + k * 32), k);
      gemm::wgmma_commit();
      gemm::wgmma_wait0();
      gemm::fence_regs(part);
      const float* cs = sCS + st * 128 + 2 * t4;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float2 w = *reinterpret_cast<const float2*>(cs + 8 * j);
        float* d = acc + 4 * j;
        d[0] += part[4 * j + 0] * (sa0 * w.x);
        d[1] += part[4 * j + 1] * (sa0 * w.y);
        d[2] += part[4 * j + 2] * (sa1 * w.x);
        d[3] += part[4 * j + 3] * (sa1 * w.y);
      }
      __syncwarp();
      if (RACE || lane == 0) tma::mbar_arrive(tma::smem_u32(empty + st));
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int p = r0 + m0r + 8 * hr;
      if (p >= r1) continue;
      if (SWIGLU) {  // gate column c in acc[4 j ..], its up column in acc[32 + 4 j ..]
        __nv_bfloat16* h = static_cast<__nv_bfloat16*>(a.out) + static_cast<int64_t>(p) * a.N + t * 64 + 2 * t4;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float v0 = gemm::swiglu_f(acc[4 * j + 2 * hr], acc[32 + 4 * j + 2 * hr], a.limit);
          const float v1 = gemm::swiglu_f(acc[4 * j + 2 * hr + 1], acc[32 + 4 * j + 2 * hr + 1], a.limit);
          *reinterpret_cast<__nv_bfloat162*>(h + 8 * j) = __floats2bfloat162_rn(v0, v1);
        }
      } else {
        const float w = a.row_weight[p];
        float* y = static_cast<float*>(a.out) + static_cast<int64_t>(p) * a.N + t * 128 + 2 * t4;
#pragma unroll
        for (int j = 0; j < 16; ++j)
          *reinterpret_cast<float2*>(y + 8 * j) = make_float2(acc[4 * j + 2 * hr] * w, acc[4 * j + 2 * hr + 1] * w);
      }
    }
  }
#else
  __trap();  // wgmma / TMA: sm_90a only (launchers call require_sm90a)
#endif
}

template <bool SWIGLU, int NDEC, int S, bool RACE = false>
void launch_mx(const Args& a, const Maps& maps, int grid, cudaStream_t stream) {
  auto kern = moe_prefill_mx_kernel<SWIGLU, NDEC, S, RACE>;
  constexpr int smem = MxCfg<S>::kSmem;
  static const cudaError_t attr = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  check_cuda(attr, "cudaFuncSetAttribute(moe_prefill_mx_kernel)");
  kern<<<grid, kConsumers + 32 + 32 * NDEC, smem, stream>>>(a, maps);
  check_launch("moe_prefill_mx_kernel");
}

bool encode_f32_2d(CUtensorMap& map, const void* base, int64_t rows, int64_t cols, int64_t pitch, int box_cols) {
  const auto encode = tma::encode_tiled();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(pitch * 4)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), 1};
  const cuuint32_t es[2] = {1, 1};
  return encode(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<void*>(base), dims, strides, box, es,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Maps of one GEMM: A (positions x K e4m3, its transposed scales), routed and shared weights. Routed
// weights e4m3 (128-byte swizzled boxes) or, mx, packed e2m1 (64 bytes per 128-K chunk, no swizzle);
// the shared expert is fp8 in both.
bool encode_maps(const MoeProblem& p, const uint8_t* A, const float* AsT, int64_t P, int K, const ExpertWeight& w0,
                 const ExpertWeight& w1, const ExpertWeight& s0, const ExpertWeight& s1, int Nw, int box_rows,
                 bool mx, Maps& m) {
  const int64_t Pp = moe_prefill_pitch(P);
  const int64_t rows = static_cast<int64_t>(p.E) * Nw;
  const int wk = mx ? K / 2 : K, wbox = mx ? 64 : 128;
  if (!tma::encode_u8_2d(m.a, A, P, K, 128, kBM, true)) return false;
  if (!encode_f32_2d(m.as, AsT, K / 128, P, Pp, kASBox)) return false;
  if (!tma::encode_u8_2d(m.w0, w0.w, rows, wk, wbox, box_rows, !mx)) return false;
  if (!tma::encode_u8_2d(m.w1, w1.w, rows, wk, wbox, box_rows, !mx)) return false;
  if (p.has_shared) {
    if (!tma::encode_u8_2d(m.s0, s0.w, Nw, K, 128, box_rows, true)) return false;
    if (!tma::encode_u8_2d(m.s1, s1.w, Nw, K, 128, box_rows, true)) return false;
  } else {
    m.s0 = m.w0, m.s1 = m.w1;  // unused (no task has expert E)
  }
  return true;
}

}  // namespace

bool moe_prefill_supported(const MoeProblem& p) {
  return (p.fmt == WeightFmt::kFp8 || p.fmt == WeightFmt::kMxfp4) && p.d % 128 == 0 && p.inter % 128 == 0 &&
         p.d >= 128 && p.inter >= 128 && p.d / 128 <= kMaxKB && p.inter / 128 <= kMaxKB;
}

namespace {

void gather_cast(const MoePrefillIO& io, const void* src, bool bf16, const int* rows, int K, uint8_t* q, float* sT,
                 cudaStream_t stream, const char* what) {
  const int64_t Pp = moe_prefill_pitch(io.P);
  const unsigned grid = static_cast<unsigned>(io.P);
  if (bf16)
    gather_cast_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(src), rows,
                                                                io.tasks, io.ntasks, K, Pp, q, sT);
  else
    gather_cast_kernel<float><<<grid, 256, 0, stream>>>(static_cast<const float*>(src), rows, io.tasks, io.ntasks,
                                                        K, Pp, q, sT);
  check_launch(what);
}

bool moe_prefill_gemms_mx(const MoeProblem& p, const MoePrefillIO& io, cudaStream_t stream) {
  Maps m1{}, m2{};
  if (!encode_maps(p, io.xp, io.xsT, io.P, p.d, p.w1, p.w3, p.sw1, p.sw3, p.inter, 64, true, m1) ||
      !encode_maps(p, io.hq, io.hsT, io.P, p.inter, p.w2, p.w2, p.sw2, p.sw2, p.d, 128, true, m2))
    return false;
  const int sms = num_sms();
  const int rotate = std::getenv("DEEPFUSE_MOE_PREFILL_NO_ROT") == nullptr;
  // 7 decode warps (512 threads), 5 stages; for comparisons (read per call): DEEPFUSE_MOE_PREFILL_MX_DEC=3: 3 decode
  // warps (384 threads); DEEPFUSE_MOE_PREFILL_MX_STAGES=4: 4 stages (7 decode warps)
  const char* dec_env = std::getenv("DEEPFUSE_MOE_PREFILL_MX_DEC");
  const char* st_env = std::getenv("DEEPFUSE_MOE_PREFILL_MX_STAGES");
  const bool dec7 = !(dec_env != nullptr && std::atoi(dec_env) == 3);
  const bool st4 = st_env != nullptr && std::atoi(st_env) == 4;
  const bool race = std::getenv("DEEPFUSE_MOE_PREFILL_MX_RACE") != nullptr;  // the racecheck variant (7 warps, 5 stages)
  gather_cast(io, io.x, io.x_bf16, io.rows, p.d, io.xp, io.xsT, stream, "gather_cast_kernel (moe x)");

  Args a1{};
  a1.K = p.d, a1.N = p.inter, a1.E = p.E, a1.KB = p.d / 128;
  a1.scale0 = p.w1.scale, a1.scale1 = p.w3.scale, a1.scale_u8 = true;
  a1.sscale0 = p.sw1.scale, a1.sscale1 = p.sw3.scale, a1.sscale_u8 = p.sw1.scale_u8;
  a1.NBw = p.inter / 128;
  a1.tasks = io.tasks, a1.ntasks = io.ntasks, a1.ntiles = p.inter / 64;
  a1.out = io.h, a1.limit = p.limit, a1.rotate = rotate;
  const int g1 = static_cast<int>(std::min<int64_t>(sms, io.U * a1.ntiles));
  if (race) launch_mx<true, 7, 5, true>(a1, m1, g1, stream);
  else if (!dec7) launch_mx<true, 3, 5>(a1, m1, g1, stream);
  else if (st4) launch_mx<true, 7, 4>(a1, m1, g1, stream);
  else launch_mx<true, 7, 5>(a1, m1, g1, stream);

  gather_cast(io, io.h, true, nullptr, p.inter, io.hq, io.hsT, stream, "gather_cast_kernel (moe h)");

  Args a2{};
  a2.K = p.inter, a2.N = p.d, a2.E = p.E, a2.KB = p.inter / 128;
  a2.scale0 = a2.scale1 = p.w2.scale, a2.scale_u8 = true;
  a2.sscale0 = a2.sscale1 = p.sw2.scale, a2.sscale_u8 = p.sw2.scale_u8;
  a2.NBw = p.d / 128;
  a2.tasks = io.tasks, a2.ntasks = io.ntasks, a2.ntiles = p.d / 128;
  a2.out = io.Y, a2.row_weight = io.wrow, a2.rotate = rotate;
  const int g2 = static_cast<int>(std::min<int64_t>(sms, io.U * a2.ntiles));
  if (race) launch_mx<false, 7, 5, true>(a2, m2, g2, stream);
  else if (!dec7) launch_mx<false, 3, 5>(a2, m2, g2, stream);
  else if (st4) launch_mx<false, 7, 4>(a2, m2, g2, stream);
  else launch_mx<false, 7, 5>(a2, m2, g2, stream);
  return true;
}

}  // namespace

bool moe_prefill_gemms(const MoeProblem& p, const MoePrefillIO& io, cudaStream_t stream) {
  if (!moe_prefill_supported(p)) return false;
  if (p.fmt == WeightFmt::kMxfp4) return moe_prefill_gemms_mx(p, io, stream);
  // 128 x 256 tiles (H200: 1.05-1.2x the 128 x 128 ones at T 512-16384); DEEPFUSE_MOE_PREFILL_BN=128:
  // 128 x 128, for comparisons (read per call)
  const char* bn_env = std::getenv("DEEPFUSE_MOE_PREFILL_BN");
  const int BN = bn_env != nullptr && std::atoi(bn_env) == 128 ? 128 : 256;
  Maps m1{}, m2{};
  if (!encode_maps(p, io.xp, io.xsT, io.P, p.d, p.w1, p.w3, p.sw1, p.sw3, p.inter, BN / 2, false, m1) ||
      !encode_maps(p, io.hq, io.hsT, io.P, p.inter, p.w2, p.w2, p.sw2, p.sw2, p.d, 128, false, m2))
    return false;
  const int64_t Pp = moe_prefill_pitch(io.P);
  const int sms = num_sms();
  const int rotate = std::getenv("DEEPFUSE_MOE_PREFILL_NO_ROT") == nullptr;  // read per call (benchmarks)
  const unsigned cgrid = static_cast<unsigned>(io.P);

  if (io.x_bf16)
    gather_cast_kernel<__nv_bfloat16><<<cgrid, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(io.x), io.rows,
                                                                 io.tasks, io.ntasks, p.d, Pp, io.xp, io.xsT);
  else
    gather_cast_kernel<float><<<cgrid, 256, 0, stream>>>(static_cast<const float*>(io.x), io.rows, io.tasks,
                                                         io.ntasks, p.d, Pp, io.xp, io.xsT);
  check_launch("gather_cast_kernel (moe x)");

  Args a1{};
  a1.K = p.d, a1.N = p.inter, a1.E = p.E, a1.KB = p.d / 128;
  a1.scale0 = p.w1.scale, a1.scale1 = p.w3.scale, a1.scale_u8 = p.w1.scale_u8;
  a1.sscale0 = p.sw1.scale, a1.sscale1 = p.sw3.scale, a1.sscale_u8 = p.sw1.scale_u8;
  a1.NBw = p.inter / 128;
  a1.tasks = io.tasks, a1.ntasks = io.ntasks, a1.ntiles = p.inter / (BN / 2);
  a1.out = io.h, a1.limit = p.limit, a1.rotate = rotate;
  const int g1 = static_cast<int>(std::min<int64_t>(sms, io.U * a1.ntiles));
  if (BN == 256) launch<true, 256>(a1, m1, g1, stream);
  else launch<true, 128>(a1, m1, g1, stream);

  gather_cast_kernel<__nv_bfloat16><<<cgrid, 256, 0, stream>>>(io.h, nullptr, io.tasks, io.ntasks, p.inter, Pp,
                                                               io.hq, io.hsT);
  check_launch("gather_cast_kernel (moe h)");

  Args a2{};
  a2.K = p.inter, a2.N = p.d, a2.E = p.E, a2.KB = p.inter / 128;
  a2.scale0 = a2.scale1 = p.w2.scale, a2.scale_u8 = p.w2.scale_u8;
  a2.sscale0 = a2.sscale1 = p.sw2.scale, a2.sscale_u8 = p.sw2.scale_u8;
  a2.NBw = p.d / 128;
  a2.tasks = io.tasks, a2.ntasks = io.ntasks, a2.ntiles = ceil_div(p.d, BN);
  a2.out = io.Y, a2.row_weight = io.wrow, a2.rotate = rotate;
  const int g2 = static_cast<int>(std::min<int64_t>(sms, io.U * a2.ntiles));
  if (BN == 256) launch<false, 256>(a2, m2, g2, stream);
  else launch<false, 128>(a2, m2, g2, stream);
  return true;
}


// ---------------------------------------------------------------------------------------------
// Dense FP8 linears (quant_linear / grouped_linear at large M): the fp8 kernel above with one
// "expert" and no routing: tiles (group, 128 rows, BN weight rows) over x cast per 128 into the
// workspace (the gather cast without rows: fp8_per_token_cast's math), the output in x's dtype.
constexpr bool kLinearPrefillCluster = false;  // 2-CTA clusters by default (fp8_linear_prefill's cluster=-1)
constexpr bool kLinearPrefillEpi16 = true;     // the 16-byte-store bf16 epilogue by default (H200: 1.04-1.26x)

int64_t linear_prefill_workspace_bytes(int64_t M, int64_t K) {
  const int64_t q = (M * K + 255) / 256 * 256;
  return q + (K + 127) / 128 * moe_prefill_pitch(M) * 4;
}

bool linear_prefill_supported(int64_t M, int64_t G, int64_t Kg, int64_t R) {
  if (M < 1 || G < 1 || R < 2 || R % 2 || Kg < 16 || Kg % 16 || (Kg + 127) / 128 > kMaxKB) return false;
  if (G > 1 && (Kg % 128 || R % 128)) return false;  // a group's chunks and weight blocks its own
  return M <= (1LL << 30) / 128 && G * R <= (1LL << 31) - 1 && M * G * Kg < (1LL << 40);
}

bool linear_prefill(const void* x, bool x_bf16, int64_t M, int64_t G, int64_t Kg, const uint8_t* w, const void* scale,
                    bool scale_u8, int64_t R, void* out, bool out_f32, void* workspace, int force_bn, int cluster,
                    cudaStream_t stream) {
  if (!linear_prefill_supported(M, G, Kg, R)) return false;
  require_sm90a("fp8_linear_prefill");
  const int64_t K = G * Kg, KB = (Kg + 127) / 128, Pp = moe_prefill_pitch(M);
  uint8_t* q = static_cast<uint8_t*>(workspace);
  float* sT = reinterpret_cast<float*>(q + (M * K + 255) / 256 * 256);
  const int sms = num_sms();
  const int mtiles = static_cast<int>((M + kBM - 1) / kBM);
  // 128 x 256 tiles unless 128 x 128 fill the SMs in fewer rounds (a 256 tile costs ~1.74 128 tiles)
  const int64_t t256 = G * mtiles * ((R + 255) / 256), t128 = G * mtiles * ((R + 127) / 128);
  int BN = (t256 + sms - 1) / sms * 100 <= (t128 + sms - 1) / sms * 58 ? 256 : 128;
  if (force_bn == 128 || force_bn == 256) BN = force_bn;
  Maps m{};
  if (!tma::encode_u8_2d(m.a, q, M, K, 128, kBM, true)) return false;
  if (!encode_f32_2d(m.as, sT, G * KB, M, Pp, kASBox)) return false;
  if (!tma::encode_u8_2d(m.w0, w, G * R, Kg, 128, 128, true)) return false;
  m.w1 = m.s0 = m.s1 = m.w0;
  if (x_bf16)
    dense_cast_kernel<__nv_bfloat16><<<static_cast<unsigned>(M), 256, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(x), static_cast<int>(M), static_cast<int>(K), Pp, q, sT);
  else
    dense_cast_kernel<float><<<static_cast<unsigned>(M), 256, 0, stream>>>(
        static_cast<const float*>(x), static_cast<int>(M), static_cast<int>(K), Pp, q, sT);
  check_launch("dense_cast_kernel (linear x)");
  DenseArgs a{};
  a.K = static_cast<int>(Kg), a.N = static_cast<int>(R), a.E = 1, a.KB = static_cast<int>(KB);
  a.scale0 = a.scale1 = scale, a.scale_u8 = scale_u8;
  a.sscale0 = a.sscale1 = scale, a.sscale_u8 = scale_u8;
  a.NBw = static_cast<int>((G * R + 127) / 128);
  a.ntiles = static_cast<int>((R + BN - 1) / BN);
  a.out = out, a.rotate = std::getenv("DEEPFUSE_MOE_PREFILL_NO_ROT") == nullptr;
  a.M = static_cast<int>(M), a.G = static_cast<int>(G), a.R = static_cast<int>(R), a.mtiles = mtiles;
  a.dense_total = static_cast<int>(G * mtiles * a.ntiles);
  a.out_pitch = static_cast<int>(G * R), a.out_f32 = out_f32;
  a.m_fast = M <= G * R;  // the smaller operand is the one re-read from L2 by every round of CTAs
  a.munits = mtiles;
  // 128 x 256 tiles of two m-tiles in a 2-CTA cluster (the weight tile read once from L2 for both) where
  // there are at least two m-tiles; cluster: 1 on, 0 off, < 0 the default (kLinearPrefillCluster)
  const bool mc = BN == 256 && mtiles >= 2 && (cluster < 0 ? kLinearPrefillCluster : cluster > 0);
  if (mc) {
    a.munits = (mtiles + 1) / 2;
    a.dense_total = static_cast<int>(G * a.munits * a.ntiles);
    launch_dense_mc(a, m, stream);
    return true;
  }
  const int grid = std::min(sms, a.dense_total);
  // bf16 out with 16-byte stores (dense_store16) where R and the row pitch are multiples of 8; read per call:
  // DEEPFUSE_LINEAR_PREFILL_EPI16=0 / 1 (default kLinearPrefillEpi16)
  const char* epi_env = std::getenv("DEEPFUSE_LINEAR_PREFILL_EPI16");
  const bool epi = !out_f32 && R % 8 == 0 && (epi_env != nullptr ? std::atoi(epi_env) != 0 : kLinearPrefillEpi16);
  if (epi) {
    if (BN == 256) launch<false, 256, true, true>(a, m, grid, stream);
    else launch<false, 128, true, true>(a, m, grid, stream);
    return true;
  }
  if (BN == 256) launch<false, 256, true>(a, m, grid, stream);
  else launch<false, 128, true>(a, m, grid, stream);
  return true;
}

}  // namespace deepfuse
