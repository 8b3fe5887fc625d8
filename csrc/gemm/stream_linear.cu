// Weight-streaming FP8 / MXFP4 linear for few rows (M <= 64; semantics: deepfuse/ops/linear.py).
// One launch, no workspace:
// - a CTA (one warpgroup) owns T consecutive 64-row weight tiles and one K range (split s of S);
//   its chunks (tile, 128-K chunk) stream through a ring of STAGES shared-memory stages filled by
//   TMA (cp.async.bulk.tensor, one instruction per chunk, mbarrier completion), refilled as soon
//   as a stage is consumed, so HBM sees STAGES chunks in flight per CTA without any pause between
//   tiles;
// - the activations of its K range are cast once into shared memory while the first stages load
//   (FP8 e4m3 per token per 128 with fp32 scales, bit-identical to fp8_per_token_cast);
// - swapped wgmma (m64 x BT x k32, e4m3): weights are the M side, the tokens (padded to BT =
//   8 / 16 / 32 / 64) the N side; fp8: one promotion per chunk with the 128 x 128 block scale,
//   mxfp4: e2m1 decoded to e4m3 (x 2^-6, exact) into a double-buffered swizzled tile while the
//   previous chunk's wgmmas run, four k32 groups accumulated apart and promoted with their
//   UE8M0 scales;
// - S > 1: the S CTAs of a K split form a thread-block cluster; at each tile's end every CTA
//   stores its fp32 partial of rows [64 q / S, 64 (q + 1) / S) into CTA q's shared memory over
//   DSMEM (slot = its split), and CTA q adds its S slots in split order (deterministic, no
//   atomics, no second pass, no remote loads);
// - stream_wgs = 2: two consumer warpgroups per CTA, each with its own ring, taking alternate
//   tiles of the CTA's range (the activations are cast once for both).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>

#include "common/arch.h"
#include "common/cuda_utils.h"
#include "common/fp8_utils.cuh"
#include "gemm/fp8_linear.h"
#include "gemm/grouped_gemm_sm90.cuh"
#include "gemm/tma_sm90.cuh"

namespace deepfuse {
namespace {

struct StreamArgs {
  const void* x;      // [M, K] bf16 / fp32 / e4m3 (x_mx), row stride ldx elements; group g at g K
  const void* xs;     // x_mx: UE8M0 [M, K/32] per 32 values, row stride ldxs; group g at g K/32
  void* out;          // [M, N] bf16 / fp32 (grouped: [M, G, N / G])
  const void* scale;  // fp8: [ceil(N/128), KB] fp32 / UE8M0; mxfp4: UE8M0 [N, K/32]
  int M, N, K, KB;    // KB: 128-K chunks; N: all weight rows
  int ntiles;         // 64-row weight tiles
  int S, cps, T;      // K splits (cluster size), chunks per split, tiles per CTA
  int stages;         // weight ring depth (per consumer warpgroup)
  int ldx, ldxs;      // x / xs row strides (elements)
  int tpg, cpg;       // tiles per group (dense: ntiles), CTA rows per group (blockIdx.y = g cpg + j)
  bool x_bf16, out_bf16, scale_u8;
};

constexpr int kTileRows = 64;
constexpr int kMaxChunksPerCta = 64;  // bounds the preloaded weight scales

constexpr int kMaxStages = 32;
template <bool MX>
struct SCfg {
  static constexpr int SB = MX ? 4096 : 8192;    // one stage: 64 rows x one 128-K chunk
};

struct SLayout {
  int w, e, x, xs, ws, red, bar, total;  // byte offsets from the 1024-aligned base; total with slack
};

__host__ __device__ inline int red_stride(int BT) { return BT + 4; }

// nw consumer warpgroups, each with its own ring of `stages` stages (and mxfp4 decode tiles).
// xmx: the activations come as MXFP8 (one fp32 token scale per 32 values instead of per 128).
__host__ __device__ inline SLayout stream_layout(bool mx, int BT, int cps, int T, int S, int stages, int nw = 1,
                                                 bool xmx = false) {
  SLayout L{};
  int off = 0;
  L.w = off;
  off += nw * stages * (mx ? 4096 : 8192);
  L.e = off;
  off += mx ? nw * 2 * 8192 : 0;
  L.x = off;
  off += cps * BT * 128;
  L.xs = off;
  off += cps * BT * 4 * (xmx ? 4 : 1);
  L.ws = off;
  off += T * cps * (mx ? kTileRows * 4 : 4);
  off = (off + 15) & ~15;
  L.red = off;
  off += S > 1 ? nw * kTileRows * red_stride(BT) * 4 : 0;
  off = (off + 7) & ~7;
  L.bar = off;
  off += nw * stages * 8;
  L.total = off + 1024;
  return L;
}

// ---------------------------------------------------------------------------- device helpers
using tma::mbar_expect_tx;
using tma::mbar_init;
using tma::mbar_wait;
using tma::tma_load_2d;

__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
__device__ __forceinline__ uint32_t peer_addr(const void* p, uint32_t rank) {
  uint32_t a;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(a) : "r"(gemm::smem_u32(p)), "r"(rank));
  return a;
}
__device__ __forceinline__ void st_peer2(uint32_t a, float x, float y) {
  asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};\n" ::"r"(a), "f"(x), "f"(y) : "memory");
}

__device__ __forceinline__ void wgmma_m64n8k32(float (&d)[4], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, %4, %5, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(da), "l"(db), "r"(scale_d));
}

template <int BT>
__device__ __forceinline__ void wgmma_bt(float (&d)[BT / 2], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (BT == 8) wgmma_m64n8k32(d, da, db, scale_d);
  else gemm::wgmma_tile<BT>(d, da, db, scale_d);
}

// The CTA's activations: rows [0, BT) (zeros from M on), chunks kc0 .. kc0 + nck - 1 -> e4m3 in
// swizzled [BT x 128] tiles per chunk + one fp32 scale per row per chunk (fp8_group_cast's math).
// A thread owns 8 values of one (chunk, row) at a time; U of them are loaded before any is used.
template <int BT, typename XT, int NT = 128>
__device__ __forceinline__ void cast_x(const StreamArgs& a, int kc0, int nck, int xoff, char* sX, float* sXS) {
  constexpr bool kBf16 = sizeof(XT) == 2;
  constexpr int U = kBf16 ? 16 : 8, V = kBf16 ? 1 : 2;  // 16-byte loads per item
  const int items = nck * BT * 16, tid = threadIdx.x;
  const XT* x = static_cast<const XT*>(a.x);
  for (int q0 = 0; q0 < items; q0 += NT * U) {
    uint4 raw[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int q = q0 + u * NT + tid, kc = q / (BT * 16), r = (q >> 4) % BT, p = q & 15;
      const int k = (kc0 + kc) * 128 + p * 8;
      const bool ok = q < items && r < a.M && k < a.K;
#pragma unroll
      for (int h = 0; h < V; ++h)
        raw[u][h] = ok ? __ldg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(r) * a.ldx + xoff + k) + h)
                       : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) tma::cast_item8<V>(raw[u], BT, q0 + u * NT + tid, items, sX, sXS);
  }
}

// MXFP8 activations: rows [0, BT) (zeros from M on), chunks kc0 .. kc0 + nck - 1 copied into the
// swizzled [BT x 128] e4m3 tiles, and their UE8M0 scales as fp32 [chunk][k32 group][row].
template <int BT, int NT>
__device__ __forceinline__ void load_xmx(const StreamArgs& a, int kc0, int nck, int xoff, int xsoff, char* sX,
                                         float* sXS) {
  constexpr int U = 8;
  const int items = nck * BT * 8, tid = threadIdx.x;  // 16-byte pieces
  const uint8_t* x = static_cast<const uint8_t*>(a.x);
  for (int q0 = 0; q0 < items; q0 += NT * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int q = q0 + u * NT + tid, kc = q / (BT * 8), r = (q >> 3) % BT, P = q & 7;
      const int k = (kc0 + kc) * 128 + P * 16;
      v[u] = q < items && r < a.M && k < a.K
                 ? __ldg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(r) * a.ldx + xoff + k))
                 : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int q = q0 + u * NT + tid, kc = q / (BT * 8), r = (q >> 3) % BT, P = q & 7;
      if (q < items) *reinterpret_cast<uint4*>(sX + kc * BT * 128 + r * 128 + ((P ^ (r & 7)) << 4)) = v[u];
    }
  }
  const uint8_t* xs = static_cast<const uint8_t*>(a.xs);
  for (int q = tid; q < nck * 4 * BT; q += NT) {
    const int kc = q / (4 * BT), j = (q / BT) % 4, r = q % BT, kg = (kc0 + kc) * 4 + j;
    sXS[q] = r < a.M && kg * 32 < a.K ? gemm::ue8m0_value(xs[static_cast<int64_t>(r) * a.ldxs + xsoff + kg]) : 0.0f;
  }
}

// Packed e2m1 [64 rows x 64 B] -> swizzled e4m3 [64 x 128 B] (values x 2^-6).
__device__ __forceinline__ void decode_mx(const char* pk, char* e, int ltid) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int q = ltid + 128 * h, n = q >> 2, qq = q & 3;
    const uint4 v = *reinterpret_cast<const uint4*>(pk + n * 64 + qq * 16);
    const uint2 o0 = gemm::e2m1x8_to_e4m3(v.x), o1 = gemm::e2m1x8_to_e4m3(v.y);
    const uint2 o2 = gemm::e2m1x8_to_e4m3(v.z), o3 = gemm::e2m1x8_to_e4m3(v.w);
    *reinterpret_cast<uint4*>(e + n * 128 + (((2 * qq) ^ (n & 7)) << 4)) = make_uint4(o0.x, o0.y, o1.x, o1.y);
    *reinterpret_cast<uint4*>(e + n * 128 + (((2 * qq + 1) ^ (n & 7)) << 4)) = make_uint4(o2.x, o2.y, o3.x, o3.y);
  }
}

// NW consumer warpgroups (128 NW threads): warpgroup w takes the CTA's tiles w, w + NW, .. (rounds
// of NW tiles), each with its own weight ring, mbarriers and issuing thread; the activations and
// scales in shared memory are cast / loaded once by all of them. NW = 1: one warpgroup owns all.
// XMX (NW = 1): MXFP8 activations read as they are (no cast); each k32 group's partial is promoted
// with its own token scales.
template <int BT, bool MX, int NW, bool XMX = false>
__global__ void __launch_bounds__(128 * NW, 1) stream_linear_kernel(const StreamArgs a, const __grid_constant__ CUtensorMap tmap) {
#if DEEPFUSE_SM90A_DEVICE
  using C = SCfg<MX>;
  constexpr int R = BT / 2, NT = 128 * NW;
  extern __shared__ char smem_raw[];
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int STAGES = a.stages;
  const SLayout L = stream_layout(MX, BT, a.cps, a.T, a.S, STAGES, NW, XMX);
  const int tid = threadIdx.x, ltid = NW == 1 ? tid : tid & 127, w = NW == 1 ? 0 : tid >> 7, lane = tid & 31,
            wq = ltid >> 5, g = lane >> 2, t4 = lane & 3;
  const int split = blockIdx.x;
  const int kc0 = split * a.cps, nck = max(0, min(a.KB, kc0 + a.cps) - kc0);
  const int grp = blockIdx.y / a.cpg, jt = blockIdx.y % a.cpg;  // weight group, tile range in it
  const int tile0 = grp * a.tpg + jt * a.T, Tc = min(a.tpg, (jt + 1) * a.T) - jt * a.T;
  const int rounds = (Tc + NW - 1) / NW;
  const int Tw = Tc > w ? (Tc - w + NW - 1) / NW : 0;  // this warpgroup's tiles
  const int total = Tw * nck;                          // and chunks
  uint64_t* bars = reinterpret_cast<uint64_t*>(base + L.bar) + w * STAGES;
  char* sW = base + L.w + w * STAGES * C::SB;
  char* sX = base + L.x;
  float* sXS = reinterpret_cast<float*>(base + L.xs);

  auto issue = [&](int i) {  // one thread of the warpgroup: its chunk i -> its stage i % STAGES
    const int st = i % STAGES, t = (i / nck) * NW + w, kc = i % nck;
    const uint32_t bar = gemm::smem_u32(bars + st);
    mbar_expect_tx(bar, C::SB);
    tma_load_2d(gemm::smem_u32(sW + st * C::SB), &tmap, (kc0 + kc) * (MX ? 64 : 128), (tile0 + t) * kTileRows, bar);
  };
  if (ltid == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(gemm::smem_u32(bars + s), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    gemm::fence_proxy_async();
    for (int i = 0; i < min(total, STAGES); ++i) issue(i);
  }
  // K splits: partials go into peers' shared memory, which is valid only once every CTA of the
  // cluster has started; the matching wait precedes the first round's pushes.
  if (a.S > 1 && Tc > 0) cluster_arrive();

  if constexpr (XMX) load_xmx<BT, NT>(a, kc0, nck, grp * a.K, grp * (a.K / 32), sX, sXS);
  else if (a.x_bf16) cast_x<BT, __nv_bfloat16, NT>(a, kc0, nck, grp * a.K, sX, sXS);
  else cast_x<BT, float, NT>(a, kc0, nck, grp * a.K, sX, sXS);
  const int ctotal = Tc * nck;  // the CTA's chunks
  if (!MX) {  // the 128 x 128 block scale of every chunk of the CTA
    float* sWS = reinterpret_cast<float*>(base + L.ws);
    for (int q = tid; q < ctotal; q += NT) {
      const int t = q / nck, kc = q % nck;
      const int64_t off = static_cast<int64_t>((tile0 + t) * kTileRows / 128) * a.KB + kc0 + kc;
      sWS[q] = a.scale_u8 ? gemm::ue8m0_value(static_cast<const uint8_t*>(a.scale)[off])
                          : static_cast<const float*>(a.scale)[off];
    }
  } else {  // the four UE8M0 group scales of every row of every chunk, [t, kc, row] words
    uint32_t* sWS = reinterpret_cast<uint32_t*>(base + L.ws);
    const int KG = a.K / 32;
    for (int q = tid; q < ctotal * kTileRows; q += NT) {
      const int kc = q % nck, row = (q / nck) % kTileRows, t = q / (nck * kTileRows);
      const int n = (tile0 + t) * kTileRows + row;
      sWS[(t * nck + kc) * kTileRows + row] =
          n < a.N ? __ldg(reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(a.scale) +
                                                            static_cast<int64_t>(n) * KG + (kc0 + kc) * 4))
                  : 0u;
    }
  }
  gemm::fence_proxy_async();
  __syncthreads();

  // Stage release / decode-tile hand-over inside one warpgroup.
  auto wg_sync = [&]() {
    if constexpr (NW == 1) __syncthreads();
    else tma::named_bar(1 + w, 128);
  };

  float acc[R];
  const int rg = wq * 16 + g;  // this thread's tile rows rg, rg + 8
  float* red_all = reinterpret_cast<float*>(base + L.red);
  float* red = red_all + w * kTileRows * red_stride(BT);
  const int RS = red_stride(BT);

  // Round r: warpgroup w's tile r NW + w (if any) leaves; S > 1: all NW tiles reduced together.
  auto epilogue = [&](int r) {
    const int t = r * NW + w;
    const int n0 = (tile0 + t) * kTileRows;
    if (a.S == 1) {
      if (t >= Tc) return;
#pragma unroll
      for (int c8 = 0; c8 < BT / 8; ++c8)
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const int p = c8 * 8 + 2 * t4 + b, n = n0 + rg;
          if (p >= a.M) continue;
          const int64_t o = static_cast<int64_t>(p) * a.N;
          if (a.out_bf16) {
            __nv_bfloat16* out = static_cast<__nv_bfloat16*>(a.out) + o;
            if (n < a.N) out[n] = __float2bfloat16_rn(acc[4 * c8 + b]);
            if (n + 8 < a.N) out[n + 8] = __float2bfloat16_rn(acc[4 * c8 + 2 + b]);
          } else {
            float* out = static_cast<float*>(a.out) + o;
            if (n < a.N) out[n] = acc[4 * c8 + b];
            if (n + 8 < a.N) out[n + 8] = acc[4 * c8 + 2 + b];
          }
        }
      return;
    }
    // CTA `split` owns rows [split * rows, (split + 1) * rows) of the round's tiles: every CTA
    // pushes its partial of each row into the owner's buffer, slot `split` ([S][rows][RS]), then
    // each owner sums its slots in split order from its own shared memory.
    const int rows = kTileRows / a.S, r0 = split * rows;
    cluster_wait();  // round 0: every CTA of the cluster has started; later: the owners summed the previous round
    if (t < Tc) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = rg + 8 * h;
        const uint32_t dst = peer_addr(red + (split * rows + row % rows) * RS, row / rows);
#pragma unroll
        for (int c8 = 0; c8 < BT / 8; ++c8)
          if (c8 * 8 < a.M) st_peer2(dst + (c8 * 8 + 2 * t4) * 4, acc[4 * c8 + 2 * h], acc[4 * c8 + 2 * h + 1]);
      }
    }
    cluster_arrive();
    cluster_wait();
    for (int e = tid; e < NW * rows * BT; e += NT) {
      const int wt = e / (rows * BT), ee = e % (rows * BT);
      const int lr = ee / BT, p = ee % BT, n = (tile0 + r * NW + wt) * kTileRows + r0 + lr;
      if (r * NW + wt >= Tc || p >= a.M || n >= a.N) continue;
      const float* rd = red_all + wt * kTileRows * RS + lr * RS + p;
      float s = 0.0f;
      for (int q = 0; q < a.S; ++q) s += rd[q * rows * RS];
      const int64_t o = static_cast<int64_t>(p) * a.N + n;
      if (a.out_bf16) static_cast<__nv_bfloat16*>(a.out)[o] = __float2bfloat16_rn(s);
      else static_cast<float*>(a.out)[o] = s;
    }
    cluster_arrive();
  };

  auto token_scales = [&](int kc, float (&sa)[BT / 8][2]) {
#pragma unroll
    for (int c8 = 0; c8 < BT / 8; ++c8) {
      sa[c8][0] = sXS[kc * BT + c8 * 8 + 2 * t4];
      sa[c8][1] = sXS[kc * BT + c8 * 8 + 2 * t4 + 1];
    }
  };
  auto token_scales32 = [&](int kc, int j, float (&sa)[BT / 8][2]) {  // XMX: k32 group j of chunk kc
#pragma unroll
    for (int c8 = 0; c8 < BT / 8; ++c8) {
      sa[c8][0] = sXS[(kc * 4 + j) * BT + c8 * 8 + 2 * t4];
      sa[c8][1] = sXS[(kc * 4 + j) * BT + c8 * 8 + 2 * t4 + 1];
    }
  };

  if constexpr (XMX && !MX) {  // fp8 weights, MXFP8 activations: four k32 partials per chunk
    const float* sWS = reinterpret_cast<const float*>(base + L.ws);
    int i = 0;
    for (int r = 0; r < rounds; ++r) {
      const int t = r * NW + w;
#pragma unroll
      for (int j = 0; j < R; ++j) acc[j] = 0.0f;
      for (int kc = 0; kc < (t < Tc ? nck : 0); ++kc, ++i) {
        const int st = i % STAGES;
        mbar_wait(gemm::smem_u32(bars + st), (i / STAGES) & 1);
        __syncwarp();
        const uint32_t wa = gemm::smem_u32(sW + st * C::SB), xa = gemm::smem_u32(sX + kc * BT * 128);
        float part[4][R];
        gemm::wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) wgmma_bt<BT>(part[j], gemm::smem_desc(wa + j * 32), gemm::smem_desc(xa + j * 32), 0);
        gemm::wgmma_commit();
        const float ws = sWS[t * nck + kc];
        gemm::wgmma_wait0();
#pragma unroll
        for (int j = 0; j < 4; ++j) gemm::fence_regs(part[j]);
        wg_sync();  // every warp's wgmmas on stage st are done: refill it
        if (ltid == 0 && i + STAGES < total) issue(i + STAGES);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float sa[BT / 8][2];
          token_scales32(kc, j, sa);
          gemm::promote<BT>(acc, part[j], ws, ws, sa);
        }
      }
      epilogue(r);
    }
  } else if constexpr (!MX) {
    const float* sWS = reinterpret_cast<const float*>(base + L.ws);
    int i = 0;
    for (int r = 0; r < rounds; ++r) {
      const int t = r * NW + w;
#pragma unroll
      for (int j = 0; j < R; ++j) acc[j] = 0.0f;
      for (int kc = 0; kc < (t < Tc ? nck : 0); ++kc, ++i) {
        const int st = i % STAGES;
        mbar_wait(gemm::smem_u32(bars + st), (i / STAGES) & 1);
        __syncwarp();
        const uint32_t wa = gemm::smem_u32(sW + st * C::SB), xa = gemm::smem_u32(sX + kc * BT * 128);
        float part[R];
        gemm::wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) wgmma_bt<BT>(part, gemm::smem_desc(wa + j * 32), gemm::smem_desc(xa + j * 32), j);
        gemm::wgmma_commit();
        float sa[BT / 8][2];
        token_scales(kc, sa);
        const float ws = sWS[t * nck + kc];
        gemm::wgmma_wait0();
        gemm::fence_regs(part);
        wg_sync();  // every warp's wgmmas on stage st are done: refill it
        if (ltid == 0 && i + STAGES < total) issue(i + STAGES);
        gemm::promote<BT>(acc, part, ws, ws, sa);
      }
      epilogue(r);
    }
  } else {
    const uint32_t* sWS = reinterpret_cast<const uint32_t*>(base + L.ws);
    char* sE = base + L.e + w * 2 * 8192;
    if (total > 0) {
      mbar_wait(gemm::smem_u32(bars), 0);
      decode_mx(sW, sE, ltid);
      gemm::fence_proxy_async();
      wg_sync();
      if (ltid == 0 && STAGES < total) issue(STAGES);
    }
    int i = 0;
    for (int r = 0; r < rounds; ++r) {
      const int t = r * NW + w;
#pragma unroll
      for (int j = 0; j < R; ++j) acc[j] = 0.0f;
      for (int kc = 0; kc < (t < Tc ? nck : 0); ++kc, ++i) {
        const uint32_t ea = gemm::smem_u32(sE + (i & 1) * 8192), xa = gemm::smem_u32(sX + kc * BT * 128);
        float part[4][R];
        __syncwarp();
        gemm::wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) wgmma_bt<BT>(part[j], gemm::smem_desc(ea + j * 32), gemm::smem_desc(xa + j * 32), 0);
        gemm::wgmma_commit();
        if (i + 1 < total) {  // decode the next chunk while these wgmmas run
          const int st1 = (i + 1) % STAGES;
          mbar_wait(gemm::smem_u32(bars + st1), ((i + 1) / STAGES) & 1);
          decode_mx(sW + st1 * C::SB, sE + ((i + 1) & 1) * 8192, ltid);
          gemm::fence_proxy_async();
        }
        float sa[BT / 8][2];
        if constexpr (!XMX) token_scales(kc, sa);
        const uint32_t sc0 = sWS[(t * nck + kc) * kTileRows + rg], sc1 = sWS[(t * nck + kc) * kTileRows + rg + 8];
        gemm::wgmma_wait0();
#pragma unroll
        for (int j = 0; j < 4; ++j) gemm::fence_regs(part[j]);
        wg_sync();  // chunk i + 1 decoded (its stage free), chunk i's wgmmas done (its tile free)
        if (ltid == 0 && i + 1 + STAGES < total) issue(i + 1 + STAGES);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float w0 = gemm::ue8m0_value((sc0 >> (8 * j)) & 0xFF) * 64.0f;
          const float w1 = gemm::ue8m0_value((sc1 >> (8 * j)) & 0xFF) * 64.0f;
          if constexpr (XMX) token_scales32(kc, j, sa);
          gemm::promote<BT>(acc, part[j], w0, w1, sa);
        }
      }
      epilogue(r);
    }
  }
  if (a.S > 1 && Tc > 0) cluster_wait();  // no CTA leaves while a peer may still push into it
#else
  __trap();  // wgmma / TMA: sm_90a only (launchers call require_sm90a)
#endif
}

// ---------------------------------------------------------------------------- host
struct StreamPlan {
  int BT = 0, S = 1, cps = 0, T = 1, ny = 0, stages = 0, smem = 0, nw = 1, tpg = 0, cpg = 0;
};

template <int BT, bool MX, int NW, bool XMX>
const void* kernel_ptr() {
  auto kern = stream_linear_kernel<BT, MX, NW, XMX>;
  static const cudaError_t attr = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024);
  check_cuda(attr, "cudaFuncSetAttribute(stream_linear_kernel)");
  return reinterpret_cast<const void*>(kern);
}

// The kernel a plan launches (launch_bt / launch_bt_xmx below pick the same).
const void* stream_kernel(int BT, bool mx, int nw, bool xmx) {
  if (xmx) {
    switch (BT) {
      case 8: return mx ? kernel_ptr<8, true, 1, true>() : kernel_ptr<8, false, 1, true>();
      case 16: return mx ? kernel_ptr<16, true, 1, true>() : kernel_ptr<16, false, 1, true>();
      case 32: return mx ? kernel_ptr<32, true, 1, true>() : kernel_ptr<32, false, 1, true>();
      default: return mx ? kernel_ptr<64, true, 1, true>() : kernel_ptr<64, false, 1, true>();
    }
  }
  if (nw == 2) {
    if (BT == 32) return mx ? kernel_ptr<32, true, 2, false>() : kernel_ptr<32, false, 2, false>();
    return mx ? kernel_ptr<64, true, 2, false>() : kernel_ptr<64, false, 2, false>();
  }
  switch (BT) {
    case 8: return mx ? kernel_ptr<8, true, 1, false>() : kernel_ptr<8, false, 1, false>();
    case 16: return mx ? kernel_ptr<16, true, 1, false>() : kernel_ptr<16, false, 1, false>();
    case 32: return mx ? kernel_ptr<32, true, 1, false>() : kernel_ptr<32, false, 1, false>();
    default: return mx ? kernel_ptr<64, true, 1, false>() : kernel_ptr<64, false, 1, false>();
  }
}

// CTAs of a kernel's 128 nw threads that its registers let one SM hold (65536 registers, allocated
// per warp in units of 256).
int reg_occupancy(const void* kern, int nw) {
  static std::mutex mu;
  static std::map<const void*, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(kern);
  if (it == cache.end()) {
    cudaFuncAttributes fa{};
    const int regs = cudaFuncGetAttributes(&fa, kern) == cudaSuccess ? fa.numRegs : 0;
    if (regs == 0) cudaGetLastError();
    it = cache.emplace(kern, regs).first;
  }
  if (it->second <= 0) return 3;
  const int per_warp = (it->second * 32 + 255) / 256 * 256;
  return std::max(1, 65536 / (per_warp * 4 * nw));
}

// How many thread-block clusters of S CTAs (smem bytes each) can be resident at once on the current
// device (cudaOccupancyMaxActiveClusters; cached). 0: unknown. Clusters must fit in one GPC, so this
// is below (occupancy x SMs) / S (H200, S = 4 or 8: 30).
int max_clusters(const void* kern, int threads, int S, int smem) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int, int>, int> cache;
  int dev = 0;
  cudaGetDevice(&dev);
  const auto key = std::make_tuple(kern, S, smem, dev);
  std::lock_guard<std::mutex> lock(mu);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(S, 1, 1);
  cfg.blockDim = dim3(threads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeClusterDimension;
  at[0].val.clusterDim.x = S;
  at[0].val.clusterDim.y = 1;
  at[0].val.clusterDim.z = 1;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kern, &cfg) != cudaSuccess) {
    cudaGetLastError();
    n = 0;
  }
  cache.emplace(key, n);
  return n;
}

// Work split for `occ` CTAs per SM: K splits S (a power of two <= 8, while 64-row tiles x S
// leave SMs idle), tiles per CTA T (one wave), then the deepest weight ring that fits occ CTAs
// per SM. With K splits, T grows until the clusters fit in one wave (the GPCs hold fewer clusters
// than occ x SMs / S). Policy 0: the largest occ whose ring holds >= 64 KB and whose S <=
// stream_max_splits wins; policy 1: of those, the one with the most ring stages resident on the
// GPU (CTAs that run x ring depth). An occ the kernel's registers do not allow is skipped. None:
// not served. stream_wgs = 2, one CTA per SM, T >= 2 and
// BT >= 32: two consumer warpgroups per CTA, the ring split between them (>= 4 stages each).
bool stream_plan(const LinearProblem& p, int max_m, StreamPlan& pl) {
  if (p.M < 1 || p.M > max_m || p.M > 64 || p.N < 1) return false;
  // Block-diagonal weights (groups, N rows each): a CTA's tiles stay inside one group.
  if (p.groups > 0 && (!p.stream_grouped || p.N % kTileRows)) return false;
  const int BT = p.M <= 8 ? 8 : p.M <= 16 ? 16 : p.M <= 32 ? 32 : 64;
  const int G = std::max(1, p.groups), tpg = ceil_div(p.N, kTileRows);
  const int ntiles = G * tpg, KB = ceil_div(p.K, 128);
  const int SB = p.mxfp4 ? 4096 : 8192;
  bool found = false;
  int64_t best = -1;
  for (int occ = 3; occ >= 1; --occ) {
    const int D = occ * num_sms();
    int S = 1;
    while (2 * S <= 8 && 2 * S <= KB && ntiles * S < D) S *= 2;
    int cps = ceil_div(KB, S);
    while (S > 1 && (S - 1) * cps >= KB) cps = ceil_div(KB, S /= 2);  // no empty split
    if (cps > kMaxChunksPerCta || S > p.stream_max_splits) continue;
    const int Tmax = std::min(std::max(1, kMaxChunksPerCta / cps), tpg);
    const int T0 = std::min(std::max(1, ceil_div(ntiles * S, D)), Tmax);
    const int budget = std::min(227 * 1024, 228 * 1024 / occ - 1024);  // 1 KB per CTA reserved
    auto stages_for = [&](int T, int nw) {
      const int other = stream_layout(p.mxfp4, BT, cps, T, S, 0, nw, p.x_mx).total;
      const int st = std::min(kMaxStages / nw, (budget - other) / (nw * (SB + 8)));
      return nw * st * SB < 64 * 1024 && !(occ == 1 && st >= 4) ? 0 : st;
    };
    // Two warpgroups only where one CTA per SM remains (the registers of two CTAs of 256 threads
    // would not fit) and for BT >= 32 (smaller BT plans keep 2-3 CTAs per SM).
    for (int nw = p.stream_wgs == 2 && T0 >= 2 && occ == 1 && BT >= 32 && !p.x_mx ? 2 : 1; nw >= 1; --nw) {
      if (reg_occupancy(stream_kernel(BT, p.mxfp4, nw, p.x_mx), nw) < occ) continue;  // registers: not occ per SM
      int T = T0, stages = stages_for(T, nw);
      if (stages == 0) continue;
      if (S > 1) {  // the fewest tiles per CTA whose clusters run in one wave (else keep two waves)
        const void* kern = stream_kernel(BT, p.mxfp4, nw, p.x_mx);
        for (int it = 0; it < 4; ++it) {
          const int smem = stream_layout(p.mxfp4, BT, cps, T, S, stages, nw, p.x_mx).total;
          const int mc = max_clusters(kern, 128 * nw, S, smem);
          int Tw = T;
          while (Tw < Tmax && G * ceil_div(tpg, Tw) > mc) ++Tw;
          const int st = Tw == T || mc <= 0 ? 0 : stages_for(Tw, nw);
          if (st == 0) break;
          T = Tw, stages = st;
        }
      }
      const int smem = stream_layout(p.mxfp4, BT, cps, T, S, stages, nw, p.x_mx).total;
      if (smem > 227 * 1024) return found;
      const int ny = G * ceil_div(tpg, T);
      const int64_t score = static_cast<int64_t>(std::min(S * ny, D)) * nw * stages;
      if (!found || (p.stream_policy == 1 && score > best)) {
        pl.BT = BT, pl.S = S, pl.cps = cps, pl.T = T, pl.stages = stages, pl.nw = nw;
        pl.tpg = tpg, pl.cpg = ceil_div(tpg, T), pl.ny = ny, pl.smem = smem;
        found = true, best = score;
      }
      if (p.stream_policy == 0) return true;
      break;
    }
  }
  return found;
}

template <int BT, bool MX, int NW, bool XMX = false>
void launch_stream(const StreamArgs& a, const CUtensorMap& map, const StreamPlan& pl, cudaStream_t stream) {
  auto kern = stream_linear_kernel<BT, MX, NW, XMX>;
  kernel_ptr<BT, MX, NW, XMX>();  // its shared-memory limit set
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(pl.S, pl.ny, 1);
  cfg.blockDim = dim3(128 * NW, 1, 1);
  cfg.dynamicSmemBytes = pl.smem;
  cfg.stream = stream;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeClusterDimension;
  at[0].val.clusterDim.x = pl.S;
  at[0].val.clusterDim.y = 1;
  at[0].val.clusterDim.z = 1;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&cfg, kern, a, map), "stream_linear_kernel");
}

template <bool MX, int NW>
void launch_bt(const StreamArgs& a, const CUtensorMap& map, const StreamPlan& pl, cudaStream_t stream) {
  if constexpr (NW == 1) {
    switch (pl.BT) {
      case 8: launch_stream<8, MX, NW>(a, map, pl, stream); return;
      case 16: launch_stream<16, MX, NW>(a, map, pl, stream); return;
      default: break;
    }
  }
  if (pl.BT == 32) launch_stream<32, MX, NW>(a, map, pl, stream);
  else launch_stream<64, MX, NW>(a, map, pl, stream);
}

template <bool MX>
void launch_bt_xmx(const StreamArgs& a, const CUtensorMap& map, const StreamPlan& pl, cudaStream_t stream) {
  switch (pl.BT) {
    case 8: launch_stream<8, MX, 1, true>(a, map, pl, stream); break;
    case 16: launch_stream<16, MX, 1, true>(a, map, pl, stream); break;
    case 32: launch_stream<32, MX, 1, true>(a, map, pl, stream); break;
    default: launch_stream<64, MX, 1, true>(a, map, pl, stream); break;
  }
}

}  // namespace

bool stream_linear(const LinearProblem& p, int max_m, const void* x, bool x_bf16, void* out, bool out_bf16,
                   cudaStream_t stream) {
  StreamPlan pl;
  if (!stream_plan(p, max_m, pl)) return false;
  const auto encode = tma::encode_tiled();
  if (encode == nullptr) return false;
  CUtensorMap map;
  const cuuint64_t kbytes = p.mxfp4 ? p.K / 2 : p.K;
  const int G = std::max(1, p.groups);
  const cuuint64_t dims[2] = {kbytes, static_cast<cuuint64_t>(G) * p.N};
  const cuuint64_t strides[1] = {kbytes};
  const cuuint32_t box[2] = {p.mxfp4 ? 64u : 128u, static_cast<cuuint32_t>(kTileRows)};
  const cuuint32_t es[2] = {1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(p.w), dims, strides, box, es,
                            CU_TENSOR_MAP_INTERLEAVE_NONE,
                            p.mxfp4 ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return false;  // e.g. a box wider than the tensor: the grouped kernel serves it
  StreamArgs a{};
  a.x = x, a.xs = p.x_scale, a.out = out, a.scale = p.scale;
  a.M = static_cast<int>(p.M), a.N = G * p.N, a.K = p.K, a.KB = ceil_div(p.K, 128), a.ntiles = G * pl.tpg;
  a.S = pl.S, a.cps = pl.cps, a.T = pl.T, a.stages = pl.stages;
  a.ldx = G * p.K, a.ldxs = G * (p.K / 32), a.tpg = pl.tpg, a.cpg = pl.cpg;
  a.x_bf16 = x_bf16, a.out_bf16 = out_bf16, a.scale_u8 = p.scale_u8;
  if (p.x_mx) {
    if (p.mxfp4) launch_bt_xmx<true>(a, map, pl, stream);
    else launch_bt_xmx<false>(a, map, pl, stream);
  } else if (pl.nw == 2) {
    if (p.mxfp4) launch_bt<true, 2>(a, map, pl, stream);
    else launch_bt<false, 2>(a, map, pl, stream);
  } else {
    if (p.mxfp4) launch_bt<true, 1>(a, map, pl, stream);
    else launch_bt<false, 1>(a, map, pl, stream);
  }
  return true;
}

}  // namespace deepfuse
