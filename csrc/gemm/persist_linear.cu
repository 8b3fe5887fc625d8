// Persistent weight-streaming linear for few rows (dense x [M, K]; fp8 weights with 128 x 128 block
// scales at M <= 64, mxfp4 weights at M <= 32 (its kernel: below); semantics: deepfuse/ops/linear.py).
// Three launches, chained by
// programmatic dependent launch (PDL):
// - persist_cast_kernel: x -> e4m3 [XR rows, KB * 128] + fp32 scales [KB][64] per token per 128
//   (fp8_group_cast's math) in the workspace; it lets the main kernel start at once, so the main
//   kernel's first weight loads overlap the cast;
// - persist_linear_kernel: one CTA per SM, one producer thread (its own warp) and two math
//   warpgroups. Work units are (128-row weight tile, K split s of S), S * tiles units in all; CTA c
//   takes units c, c + G, c + 2 G, .., its j-th unit goes to warpgroup j % 2. One ring of kStages
//   stages, each 16 KB of weights (128 rows x 128 K, 128-byte swizzle) + the x tile (XR rows x 128 K),
//   filled by TMA (full mbarrier: transaction bytes; empty mbarrier: one arrive per consuming warp);
//   the two warpgroups' chunk sequences alternate in the ring while both have chunks left. MMA:
//   wgmma m64n128k32 (tokens on M, padded to 64; weight rows on N), four per stage, then the fp32
//   promotion with the tile's block scale times each token's scale. S == 1: the output is stored
//   from registers; S > 1: fp32 partials [S][M][N] in the workspace;
// - persist_reduce_kernel (S > 1): out = the S partials summed in split order (deterministic).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "common/arch.h"
#include "common/cuda_utils.h"
#include "common/fp8_utils.cuh"
#include "gemm/fp8_linear.h"
#include "gemm/grouped_gemm_sm90.cuh"
#include "gemm/tma_sm90.cuh"

namespace deepfuse {
namespace {

constexpr int kTile = 128;              // weight rows per unit (one block-scale row)
constexpr int kWB = kTile * 128;        // weight bytes per stage
constexpr int kXB = 64 * 128;           // x bytes per stage (room for 64 tokens)
constexpr int kStages = 9;              // 9 x 24 KB
constexpr int kThreads = 2 * 128 + 32;  // two math warpgroups + the producer warp
constexpr int kSmem = kStages * (kWB + kXB) + 2 * kStages * 8 + 1024;
constexpr int kMaxSplits = 64;

struct PArgs {
  const float* xs;     // [KB][64] token scales (rows >= xr unwritten)
  void* out;           // [M, N] bf16 / fp32
  float* part;         // S > 1: [S][M][N]
  const void* scale;   // fp8: [ceil(N/128), KB] fp32 / UE8M0; mxfp4: UE8M0 [N, K/32]
  int M, N, K, KB;
  int S, cps, units;   // K splits, 128-K chunks per split, units (tiles x S)
  int xr;              // token rows loaded per stage (fp8: 16, 32, 64; mxfp4: BT)
  int pst;             // mxfp4: packed ring stages
  bool out_bf16, scale_u8;
};

// Programmatic dependent launch (sm_90+): wait for the preceding grid / let the next one start.
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Items of 8 values (16 lanes per (chunk, row) group of 128); whole warps iterate together (the
// scale's amax is reduced over 16 lanes).
template <typename XT>
__global__ void __launch_bounds__(256) persist_cast_kernel(const XT* __restrict__ x, int M, int K, int KB, int Kp,
                                                           int xr, uint8_t* __restrict__ x8, float* __restrict__ xs) {
  griddep_launch();
  constexpr bool kBf16 = sizeof(XT) == 2;
  const int items = KB * xr * 16, lane = threadIdx.x & 31;
  for (int q0 = blockIdx.x * 256 + (threadIdx.x & ~31); q0 < items; q0 += gridDim.x * 256) {
    const int q = q0 + lane, kc = q / (xr * 16), r = (q >> 4) % xr, p = q & 15, k = kc * 128 + p * 8;
    const bool ok = q < items && r < M && k < K;
    float v[8];
    if constexpr (kBf16) {
      const uint4 raw = ok ? __ldg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(r) * K + k))
                           : make_uint4(0, 0, 0, 0);
      widen8(raw, v);
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float4 f = ok ? __ldg(reinterpret_cast<const float4*>(x + static_cast<int64_t>(r) * K + k) + h)
                            : make_float4(0.f, 0.f, 0.f, 0.f);
        v[4 * h] = f.x, v[4 * h + 1] = f.y, v[4 * h + 2] = f.z, v[4 * h + 3] = f.w;
      }
    }
    const float s = tma::scale8_group128(v);
    if (q < items) {
      *reinterpret_cast<uint2*>(x8 + static_cast<int64_t>(r) * Kp + k) = to_e4m3x8(v);
      if (p == 0) xs[kc * 64 + r] = s;
    }
  }
}

template <typename Out>
__global__ void __launch_bounds__(256) persist_reduce_kernel(const float* __restrict__ part, Out* __restrict__ out,
                                                             int64_t MN, int S) {
  griddep_wait();
  for (int64_t i = blockIdx.x * 256 + threadIdx.x; i < MN; i += static_cast<int64_t>(gridDim.x) * 256) {
    float s = 0.0f;
    for (int z = 0; z < S; ++z) s += part[z * MN + i];
    if constexpr (sizeof(Out) == 4) out[i] = s;
    else out[i] = __float2bfloat16_rn(s);
  }
}

__device__ __forceinline__ int unit_chunks(const PArgs& a, int u) {
  const int s = u % a.S;
  return min(a.KB, (s + 1) * a.cps) - s * a.cps;
}

__global__ void __launch_bounds__(kThreads, 1)
    persist_linear_kernel(const PArgs a, const __grid_constant__ CUtensorMap wmap,
                          const __grid_constant__ CUtensorMap xmap) {
#if DEEPFUSE_SM90A_DEVICE
  extern __shared__ char smem_raw[];
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  char* sW = base;
  char* sX = base + kStages * kWB;
  uint64_t* full = reinterpret_cast<uint64_t*>(sX + kStages * kXB);
  uint64_t* empty = full + kStages;
  const int tid = threadIdx.x, G = gridDim.x, c = blockIdx.x;
  const int nu = c < a.units ? (a.units - c + G - 1) / G : 0;  // this CTA's units: c + j G
  int n0 = 0, n1 = 0;                                           // chunks of warpgroup 0 / 1
  for (int j = 0; j < nu; ++j) (j & 1 ? n1 : n0) += unit_chunks(a, c + j * G);
  const int m = min(n0, n1), total = n0 + n1;  // ring index of warpgroup w's chunk i: i < m ? 2 i + w : m + i

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      tma::mbar_init(gemm::smem_u32(full + s), 1);
      tma::mbar_init(gemm::smem_u32(empty + s), 4);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  griddep_launch();  // the reduction kernel may be scheduled (it waits for this grid's completion)

  if (tid >= 256) {  // producer warp: one thread issues every load
    if (tid == 256 && total > 0) {
      const int xbytes = a.xr * 128;
      int cj[2] = {0, 1}, ck[2] = {0, 0};
      auto next = [&](int i, int& tile, int& kc) {  // the chunk of ring index i
        const int w = i < 2 * m ? (i & 1) : (n0 > n1 ? 0 : 1);
        const int u = c + cj[w] * G;
        tile = u / a.S, kc = (u % a.S) * a.cps + ck[w];
        if (++ck[w] == unit_chunks(a, u)) ck[w] = 0, cj[w] += 2;
      };
      // The weights of the first stages stream while the cast kernel runs; x after it completed.
      const int pre = min(total, kStages);
      int pkc[kStages];
#pragma unroll
      for (int i = 0; i < kStages; ++i) {
        if (i < pre) {
          int tile, kc;
          next(i, tile, kc);
          pkc[i] = kc;
          const uint32_t bar = gemm::smem_u32(full + i);
          tma::mbar_expect_tx(bar, kWB + xbytes);
          tma::tma_load_2d(gemm::smem_u32(sW + i * kWB), &wmap, kc * 128, tile * kTile, bar);
        }
      }
      griddep_wait();
#pragma unroll
      for (int i = 0; i < kStages; ++i)
        if (i < pre) tma::tma_load_2d(gemm::smem_u32(sX + i * kXB), &xmap, pkc[i] * 128, 0, gemm::smem_u32(full + i));
      for (int i = kStages; i < total; ++i) {
        const int st = i % kStages;
        int tile, kc;
        next(i, tile, kc);
        tma::mbar_wait(gemm::smem_u32(empty + st), (i / kStages - 1) & 1);
        const uint32_t bar = gemm::smem_u32(full + st);
        tma::mbar_expect_tx(bar, kWB + xbytes);
        tma::tma_load_2d(gemm::smem_u32(sW + st * kWB), &wmap, kc * 128, tile * kTile, bar);
        tma::tma_load_2d(gemm::smem_u32(sX + st * kXB), &xmap, kc * 128, 0, bar);
      }
    }
    return;
  }

  griddep_wait();  // token scales: written by the cast kernel
  const int w = tid >> 7, ltid = tid & 127, lane = tid & 31, wq = ltid >> 5, g = lane >> 2, t4 = lane & 3;
  const int r0 = wq * 16 + g;  // this thread's token rows r0, r0 + 8
  const float* wsf = static_cast<const float*>(a.scale);
  const uint8_t* wsu = static_cast<const uint8_t*>(a.scale);
  int ci = 0;  // this warpgroup's chunk counter
  for (int j = w; j < nu; j += 2) {
    const int u = c + j * G, tile = u / a.S, s = u % a.S, kb0 = s * a.cps, nk = unit_chunks(a, u);
    float acc[64];
#pragma unroll
    for (int e = 0; e < 64; ++e) acc[e] = 0.0f;
    for (int k = 0; k < nk; ++k, ++ci) {
      const int gi = ci < m ? 2 * ci + w : m + ci, st = gi % kStages, kc = kb0 + k;
      const int64_t so = static_cast<int64_t>(tile) * a.KB + kc;
      const float ws = a.scale_u8 ? gemm::ue8m0_value(__ldg(wsu + so)) : __ldg(wsf + so);
      const float s0 = r0 < a.xr ? __ldg(a.xs + kc * 64 + r0) : 0.0f;
      const float s1 = r0 + 8 < a.xr ? __ldg(a.xs + kc * 64 + r0 + 8) : 0.0f;
      tma::mbar_wait(gemm::smem_u32(full + st), (gi / kStages) & 1);
      const uint32_t xa = gemm::smem_u32(sX + st * kXB), wa = gemm::smem_u32(sW + st * kWB);
      float part[64];
      gemm::wgmma_fence();
#pragma unroll
      for (int q = 0; q < 4; ++q)
        gemm::wgmma_m64n128k32(part, gemm::smem_desc(xa + q * 32), gemm::smem_desc(wa + q * 32), q);
      gemm::wgmma_commit();
      gemm::wgmma_wait0();
      gemm::fence_regs(part);
      __syncwarp();
      if (lane == 0) tma::mbar_arrive(gemm::smem_u32(empty + st));
      const float f0 = ws * s0, f1 = ws * s1;
#pragma unroll
      for (int e = 0; e < 64; ++e) acc[e] += part[e] * ((e & 2) ? f1 : f0);
    }
    // d[4 c8 + 2 h + b]: token r0 + 8 h, weight row tile * 128 + 8 c8 + 2 t4 + b.
    const bool even = (a.N & 1) == 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int p = r0 + 8 * h;
      if (p >= a.M) continue;
#pragma unroll
      for (int c8 = 0; c8 < 16; ++c8) {
        const int n = tile * kTile + c8 * 8 + 2 * t4;
        const float v0 = acc[4 * c8 + 2 * h], v1 = acc[4 * c8 + 2 * h + 1];
        if (n >= a.N) continue;
        if (a.S > 1) {
          float* o = a.part + (static_cast<int64_t>(s) * a.M + p) * a.N + n;
          if (even) *reinterpret_cast<float2*>(o) = make_float2(v0, v1);
          else {
            o[0] = v0;
            if (n + 1 < a.N) o[1] = v1;
          }
        } else if (a.out_bf16) {
          __nv_bfloat16* o = static_cast<__nv_bfloat16*>(a.out) + static_cast<int64_t>(p) * a.N + n;
          if (even) *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(v0, v1);
          else {
            o[0] = __float2bfloat16_rn(v0);
            if (n + 1 < a.N) o[1] = __float2bfloat16_rn(v1);
          }
        } else {
          float* o = static_cast<float*>(a.out) + static_cast<int64_t>(p) * a.N + n;
          if (even) *reinterpret_cast<float2*>(o) = make_float2(v0, v1);
          else {
            o[0] = v0;
            if (n + 1 < a.N) o[1] = v1;
          }
        }
      }
    }
  }
#else
  __trap();  // wgmma / TMA: sm_90a only (launchers call require_sm90a)
#endif
}

// ---------------------------------------------------------------------------- MXFP4 weights
// Same work units and PDL chain; the CTA (384 threads) is two math warpgroups + a decode warpgroup
// whose warp 3 lane 0 is the TMA producer. Packed ring (pst stages): the tile's e2m1 [128 rows x 64 B]
// + the x tile [BT x 128 B]; the decode warps (96 threads) turn each packed stage into a swizzled e4m3
// [128 x 128 B] tile (values x 2^-6, exact) + the fp32 group scales [4][128] (x 2^6) in a decoded ring
// (kMxDec stages). Weights are wgmma's M side here (the per-32 scales are per weight row): math
// warpgroup w takes rows [64 w, 64 w + 64) of every stage, four m64 x BT x k32 wgmmas (one per k32
// group) into four accumulator sets, one wait, then each group promoted with its row scales x the
// token scales (M <= 32: BT = 8 / 16 / 32 tokens on N).
constexpr int kMxDec = 4;
constexpr int kMxDecB = kTile * 128 + 4 * kTile * 4;  // e4m3 tile + fp32 scales [4][128]
constexpr int kMxThreads = 3 * 128;
constexpr int kMxMaxPacked = 16;

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

__host__ __device__ inline int mx_packed_bytes(int BT) { return 8192 + BT * 128; }  // 1024-aligned
__host__ __device__ inline int mx_smem(int BT, int pst) {
  return pst * mx_packed_bytes(BT) + kMxDec * kMxDecB + 2 * (pst + kMxDec) * 8 + 1024;
}

template <int BT>
__global__ void __launch_bounds__(kMxThreads, 1)
    persist_linear_mx_kernel(const PArgs a, const __grid_constant__ CUtensorMap wmap,
                             const __grid_constant__ CUtensorMap xmap) {
#if DEEPFUSE_SM90A_DEVICE
  constexpr int R = BT / 2;
  extern __shared__ char smem_raw[];
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int P = a.pst, PB = mx_packed_bytes(BT);
  char* sP = base;                  // packed stages: e2m1 [128 x 64 B], then the x tile
  char* sD = base + P * PB;         // decoded stages: e4m3 [128 x 128 B], then scales [4][128]
  uint64_t* full_p = reinterpret_cast<uint64_t*>(sD + kMxDec * kMxDecB);
  uint64_t* empty_p = full_p + P;
  uint64_t* full_d = empty_p + P;
  uint64_t* empty_d = full_d + kMxDec;
  const int tid = threadIdx.x, G = gridDim.x, c = blockIdx.x;
  const int nu = c < a.units ? (a.units - c + G - 1) / G : 0;
  int total = 0;
  for (int j = 0; j < nu; ++j) total += unit_chunks(a, c + j * G);

  if (tid == 0) {
    for (int s = 0; s < P; ++s) {
      tma::mbar_init(gemm::smem_u32(full_p + s), 1);
      tma::mbar_init(gemm::smem_u32(empty_p + s), 3 + 8);  // the decode warps (weights), the math warps (x)
    }
    for (int s = 0; s < kMxDec; ++s) {
      tma::mbar_init(gemm::smem_u32(full_d + s), 3);
      tma::mbar_init(gemm::smem_u32(empty_d + s), 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  griddep_launch();

  // The i-th chunk of the CTA: unit j, K chunk kc (both advanced in order by each role).
  auto advance = [&](int& j, int& k) {
    if (++k == unit_chunks(a, c + j * G)) k = 0, ++j;
  };
  if (tid >= 256) {
    const int dt = tid - 256, dwarp = dt >> 5, lane = tid & 31;
    if (dwarp == 3) {  // producer
      if (lane == 0 && total > 0) {
        const int tx = 4096 * 2 + a.xr * 128;
        const int pre = min(total, P);
        int j = 0, k = 0;
        for (int i = 0; i < pre; ++i, advance(j, k)) {
          const int u = c + j * G, tile = u / a.S, kc = (u % a.S) * a.cps + k;
          const uint32_t bar = gemm::smem_u32(full_p + i);
          tma::mbar_expect_tx(bar, tx);
          tma::tma_load_2d(gemm::smem_u32(sP + i * PB), &wmap, kc * 64, tile * kTile, bar);
        }
        griddep_wait();
        j = 0, k = 0;
        for (int i = 0; i < pre; ++i, advance(j, k)) {
          const int u = c + j * G, kc = (u % a.S) * a.cps + k;
          tma::tma_load_2d(gemm::smem_u32(sP + i * PB + 8192), &xmap, kc * 128, 0, gemm::smem_u32(full_p + i));
        }
        for (int i = pre; i < total; ++i, advance(j, k)) {
          const int st = i % P, u = c + j * G, tile = u / a.S, kc = (u % a.S) * a.cps + k;
          tma::mbar_wait(gemm::smem_u32(empty_p + st), (i / P - 1) & 1);
          const uint32_t bar = gemm::smem_u32(full_p + st);
          tma::mbar_expect_tx(bar, tx);
          tma::tma_load_2d(gemm::smem_u32(sP + st * PB), &wmap, kc * 64, tile * kTile, bar);
          tma::tma_load_2d(gemm::smem_u32(sP + st * PB + 8192), &xmap, kc * 128, 0, bar);
        }
      }
      return;
    }
    // decode warps: 96 threads; item q = (row n, k32 group g) of 16 packed bytes
    const int KG = a.K / 32;
    const uint8_t* scale = static_cast<const uint8_t*>(a.scale);
    int j = 0, k = 0;
    for (int i = 0; i < total; ++i, advance(j, k)) {
      const int u = c + j * G, tile = u / a.S, kc = (u % a.S) * a.cps + k;
      const int ps = i % P, ds = i % kMxDec;
      uint32_t sc[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // this thread's rows dt, dt + 96 (< 128): their four group scales
        const int n = tile * kTile + dt + 96 * h;
        sc[h] = dt + 96 * h < kTile && n < a.N
                    ? __ldg(reinterpret_cast<const uint32_t*>(scale + static_cast<int64_t>(n) * KG + kc * 4))
                    : 0u;
      }
      tma::mbar_wait(gemm::smem_u32(full_p + ps), (i / P) & 1);
      if (i >= kMxDec) tma::mbar_wait(gemm::smem_u32(empty_d + ds), (i / kMxDec - 1) & 1);
      const char* pk = sP + ps * PB;
      char* e = sD + ds * kMxDecB;
      float* es = reinterpret_cast<float*>(e + kTile * 128);
      for (int q = dt; q < kTile * 4; q += 96) {
        const int n = q >> 2, g4 = q & 3;
        const uint4 v = *reinterpret_cast<const uint4*>(pk + n * 64 + g4 * 16);
        const uint2 o0 = gemm::e2m1x8_to_e4m3(v.x), o1 = gemm::e2m1x8_to_e4m3(v.y);
        const uint2 o2 = gemm::e2m1x8_to_e4m3(v.z), o3 = gemm::e2m1x8_to_e4m3(v.w);
        *reinterpret_cast<uint4*>(e + n * 128 + (((2 * g4) ^ (n & 7)) << 4)) = make_uint4(o0.x, o0.y, o1.x, o1.y);
        *reinterpret_cast<uint4*>(e + n * 128 + (((2 * g4 + 1) ^ (n & 7)) << 4)) = make_uint4(o2.x, o2.y, o3.x, o3.y);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = dt + 96 * h;
        if (r < kTile)
#pragma unroll
          for (int g4 = 0; g4 < 4; ++g4) es[g4 * kTile + r] = gemm::ue8m0_value((sc[h] >> (8 * g4)) & 0xFF) * 64.0f;
      }
      gemm::fence_proxy_async();  // generic-proxy writes -> the wgmmas' reads
      __syncwarp();
      if (lane == 0) {
        tma::mbar_arrive(gemm::smem_u32(full_d + ds));
        tma::mbar_arrive(gemm::smem_u32(empty_p + ps));
      }
    }
    return;
  }

  griddep_wait();  // token scales
  const int w = tid >> 7, ltid = tid & 127, lane = tid & 31, wq = ltid >> 5, g = lane >> 2, t4 = lane & 3;
  const int rg = w * 64 + wq * 16 + g;  // this thread's tile rows rg, rg + 8
  int i = 0;
  for (int jj = 0; jj < nu; ++jj) {
    const int u = c + jj * G, tile = u / a.S, s = u % a.S, kb0 = s * a.cps, nk = unit_chunks(a, u);
    float acc[R];
#pragma unroll
    for (int e = 0; e < R; ++e) acc[e] = 0.0f;
    for (int k = 0; k < nk; ++k, ++i) {
      const int ps = i % P, ds = i % kMxDec, kc = kb0 + k;
      float sa[BT / 8][2];
#pragma unroll
      for (int c8 = 0; c8 < BT / 8; ++c8)
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const int tok = c8 * 8 + 2 * t4 + b;
          sa[c8][b] = tok < a.xr ? __ldg(a.xs + kc * 64 + tok) : 0.0f;
        }
      tma::mbar_wait(gemm::smem_u32(full_p + ps), (i / P) & 1);  // the x tile
      tma::mbar_wait(gemm::smem_u32(full_d + ds), (i / kMxDec) & 1);
      const char* e = sD + ds * kMxDecB;
      const uint32_t wa = gemm::smem_u32(e + w * 64 * 128), xa = gemm::smem_u32(sP + ps * PB + 8192);
      float part[4][R];
      gemm::wgmma_fence();
#pragma unroll
      for (int q = 0; q < 4; ++q) wgmma_bt<BT>(part[q], gemm::smem_desc(wa + q * 32), gemm::smem_desc(xa + q * 32), 0);
      gemm::wgmma_commit();
      const float* es = reinterpret_cast<const float*>(e + kTile * 128);
      float w0[4], w1[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) w0[q] = es[q * kTile + rg], w1[q] = es[q * kTile + rg + 8];
      gemm::wgmma_wait0();
#pragma unroll
      for (int q = 0; q < 4; ++q) gemm::fence_regs(part[q]);
      __syncwarp();
      if (lane == 0) {
        tma::mbar_arrive(gemm::smem_u32(empty_d + ds));
        tma::mbar_arrive(gemm::smem_u32(empty_p + ps));
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) gemm::promote<BT>(acc, part[q], w0[q], w1[q], sa);
    }
    // acc[4 c8 + 2 h + b]: tile row rg + 8 h, token c8 * 8 + 2 t4 + b.
#pragma unroll
    for (int c8 = 0; c8 < BT / 8; ++c8)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int p = c8 * 8 + 2 * t4 + b;
        if (p >= a.M) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int n = tile * kTile + rg + 8 * h;
          if (n >= a.N) continue;
          const float v = acc[4 * c8 + 2 * h + b];
          if (a.S > 1) a.part[(static_cast<int64_t>(s) * a.M + p) * a.N + n] = v;
          else if (a.out_bf16) static_cast<__nv_bfloat16*>(a.out)[static_cast<int64_t>(p) * a.N + n] = __float2bfloat16_rn(v);
          else static_cast<float*>(a.out)[static_cast<int64_t>(p) * a.N + n] = v;
        }
      }
  }
#else
  __trap();
#endif
}

struct PPlan {
  int S = 1, cps = 1, units = 0, grid = 0, xr = 64, KB = 0, Kp = 0, pst = 0;
};

int64_t align256(int64_t v) { return (v + 255) / 256 * 256; }

// K splits: the fewest 128-K chunks per CTA (ceil(units / SMs) x chunks per unit), then the fewest
// per warpgroup, then the fewest splits (persist_splits > 0: the most splits up to it).
bool persist_plan(const LinearProblem& p, PPlan& pl) {
  if (p.groups > 0 || p.x_mx || p.M < 1 || p.M > (p.mxfp4 ? 32 : 64) || p.N < 1 || p.K < 128) return false;
  const int ntiles = ceil_div(p.N, kTile), KB = ceil_div(p.K, 128), sms = num_sms();
  int64_t best1 = -1, best2 = -1;
  for (int S = 1; S <= std::min(KB, kMaxSplits); ++S) {
    const int cps = ceil_div(KB, S);
    if (ceil_div(KB, cps) != S) continue;  // an empty split
    const int units = ntiles * S;
    if (p.persist_splits > 0) {  // forced: the most splits up to persist_splits
      if (S <= p.persist_splits) pl.S = S, pl.cps = cps, pl.units = units, pl.grid = std::min(units, sms);
      continue;
    }
    const int per = ceil_div(units, sms);
    const int64_t c1 = static_cast<int64_t>(per) * cps, c2 = static_cast<int64_t>(ceil_div(per, 2)) * cps;
    if (best1 < 0 || c1 < best1 || (c1 == best1 && c2 < best2)) {
      best1 = c1, best2 = c2;
      pl.S = S, pl.cps = cps, pl.units = units, pl.grid = std::min(units, sms);
    }
  }
  if (p.mxfp4) {
    pl.xr = p.M <= 8 ? 8 : p.M <= 16 ? 16 : 32;
    const int room = 227 * 1024 - mx_smem(pl.xr, 0);
    pl.pst = std::min(kMxMaxPacked, room / (mx_packed_bytes(pl.xr) + 16));
  } else {
    pl.xr = p.M <= 16 ? 16 : p.M <= 32 ? 32 : 64;
  }
  pl.KB = KB, pl.Kp = KB * 128;
  return true;
}

// Workspace: x e4m3 [64, Kp], token scales [KB][64] fp32, partials [S][M][N] fp32 (S > 1).
struct PWork {
  int64_t xs, part, total;
};
PWork persist_work(const LinearProblem& p, const PPlan& pl) {
  PWork w{};
  w.xs = align256(64LL * pl.Kp);
  w.part = w.xs + align256(4LL * pl.KB * 64);
  w.total = w.part + (pl.S > 1 ? 4LL * pl.S * p.M * p.N : 0);
  return w;
}

template <typename K, typename... Args>
void launch_pdl(K kern, dim3 grid, dim3 block, int smem, cudaStream_t stream, const char* what, Args... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&cfg, kern, args...), what);
}

template <int BT>
void launch_mx(const PArgs& a, const CUtensorMap& wmap, const CUtensorMap& xmap, const PPlan& pl, cudaStream_t stream) {
  static const cudaError_t attr = cudaFuncSetAttribute(persist_linear_mx_kernel<BT>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024);
  check_cuda(attr, "cudaFuncSetAttribute(persist_linear_mx_kernel)");
  launch_pdl(persist_linear_mx_kernel<BT>, dim3(pl.grid), dim3(kMxThreads), mx_smem(BT, pl.pst), stream,
             "persist_linear_mx_kernel", a, wmap, xmap);
}

}  // namespace

int64_t persist_linear_workspace_bytes(const LinearProblem& p) {
  PPlan pl;
  if (!persist_plan(p, pl)) return 0;
  return persist_work(p, pl).total;
}

bool persist_linear(const LinearProblem& p, const void* x, bool x_bf16, void* out, bool out_bf16, void* workspace,
                    cudaStream_t stream) {
  PPlan pl;
  if (!persist_plan(p, pl)) return false;
  const auto encode = tma::encode_tiled();
  if (encode == nullptr) return false;
  const PWork wk = persist_work(p, pl);
  uint8_t* x8 = static_cast<uint8_t*>(workspace);
  float* xs = reinterpret_cast<float*>(x8 + wk.xs);
  float* part = reinterpret_cast<float*>(x8 + wk.part);
  CUtensorMap wmap, xmap;
  if (p.mxfp4 ? !tma::encode_u8_2d(wmap, p.w, p.N, p.K / 2, 64, kTile, false)
              : !tma::encode_u8_2d(wmap, p.w, p.N, p.K, 128, kTile, true))
    return false;
  if (!tma::encode_u8_2d(xmap, x8, pl.xr, pl.Kp, 128, pl.xr, true)) return false;

  const int cast_items = pl.KB * pl.xr * 16;
  const int cast_blocks = std::max(1, std::min(ceil_div(cast_items, 256), 2 * num_sms()));
  if (x_bf16)
    persist_cast_kernel<__nv_bfloat16><<<cast_blocks, 256, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(x), static_cast<int>(p.M), p.K, pl.KB, pl.Kp, pl.xr, x8, xs);
  else
    persist_cast_kernel<float><<<cast_blocks, 256, 0, stream>>>(static_cast<const float*>(x), static_cast<int>(p.M),
                                                               p.K, pl.KB, pl.Kp, pl.xr, x8, xs);
  check_launch("persist_cast_kernel");

  PArgs a{};
  a.xs = xs, a.out = out, a.part = part, a.scale = p.scale;
  a.M = static_cast<int>(p.M), a.N = p.N, a.K = p.K, a.KB = pl.KB;
  a.S = pl.S, a.cps = pl.cps, a.units = pl.units, a.xr = pl.xr, a.pst = pl.pst;
  a.out_bf16 = out_bf16, a.scale_u8 = p.scale_u8;
  if (p.mxfp4) {
    switch (pl.xr) {
      case 8: launch_mx<8>(a, wmap, xmap, pl, stream); break;
      case 16: launch_mx<16>(a, wmap, xmap, pl, stream); break;
      default: launch_mx<32>(a, wmap, xmap, pl, stream); break;
    }
  } else {
    static const cudaError_t attr =
        cudaFuncSetAttribute(persist_linear_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    check_cuda(attr, "cudaFuncSetAttribute(persist_linear_kernel)");
    launch_pdl(persist_linear_kernel, dim3(pl.grid), dim3(kThreads), kSmem, stream, "persist_linear_kernel", a, wmap,
               xmap);
  }
  if (pl.S > 1) {
    const int64_t MN = p.M * p.N;
    const int blocks = static_cast<int>(std::min<int64_t>(ceil_div<int64_t>(MN, 256), 2 * num_sms()));
    if (out_bf16)
      launch_pdl(persist_reduce_kernel<__nv_bfloat16>, dim3(blocks), dim3(256), 0, stream, "persist_reduce_kernel",
                 static_cast<const float*>(part), static_cast<__nv_bfloat16*>(out), MN, pl.S);
    else
      launch_pdl(persist_reduce_kernel<float>, dim3(blocks), dim3(256), 0, stream, "persist_reduce_kernel",
                 static_cast<const float*>(part), static_cast<float*>(out), MN, pl.S);
  }
  return true;
}

}  // namespace deepfuse
