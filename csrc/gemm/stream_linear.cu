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
// - S > 1: the S CTAs of a K split form a thread-block cluster; each tile's partial sums meet
//   in shared memory and CTA s adds rows [64 s / S, 64 (s + 1) / S) of the S partials over
//   DSMEM in split order (deterministic, no atomics, no second pass).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>

#include "common/arch.h"
#include "common/cuda_utils.h"
#include "common/fp8_utils.cuh"
#include "gemm/fp8_linear.h"
#include "gemm/grouped_gemm_sm90.cuh"
#include "gemm/tma_sm90.cuh"

namespace deepfuse {
namespace {

struct StreamArgs {
  const void* x;      // [M, K] bf16 / fp32
  void* out;          // [M, N] bf16 / fp32
  const void* scale;  // fp8: [ceil(N/128), KB] fp32 / UE8M0; mxfp4: UE8M0 [N, K/32]
  int M, N, K, KB;    // KB: 128-K chunks
  int ntiles;         // 64-row weight tiles
  int S, cps, T;      // K splits (cluster size), chunks per split, tiles per CTA
  int stages;         // weight ring depth
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

__host__ __device__ inline SLayout stream_layout(bool mx, int BT, int cps, int T, int S, int stages) {
  SLayout L{};
  int off = 0;
  L.w = off;
  off += stages * (mx ? 4096 : 8192);
  L.e = off;
  off += mx ? 2 * 8192 : 0;
  L.x = off;
  off += cps * BT * 128;
  L.xs = off;
  off += cps * BT * 4;
  L.ws = off;
  off += T * cps * (mx ? kTileRows * 4 : 4);
  off = (off + 15) & ~15;
  L.red = off;
  off += S > 1 ? kTileRows * red_stride(BT) * 4 : 0;
  off = (off + 7) & ~7;
  L.bar = off;
  off += stages * 8;
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
__device__ __forceinline__ float ld_peer(const float* p, uint32_t rank) {
  uint32_t a;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(a) : "r"(gemm::smem_u32(p)), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(a) : "memory");
  return v;
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
template <int BT, typename XT>
__device__ __forceinline__ void cast_x(const StreamArgs& a, int kc0, int nck, char* sX, float* sXS) {
  constexpr bool kBf16 = sizeof(XT) == 2;
  constexpr int U = kBf16 ? 16 : 8, V = kBf16 ? 1 : 2;  // 16-byte loads per item
  const int items = nck * BT * 16, tid = threadIdx.x;
  const XT* x = static_cast<const XT*>(a.x);
  for (int q0 = 0; q0 < items; q0 += 128 * U) {
    uint4 raw[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int q = q0 + u * 128 + tid, kc = q / (BT * 16), r = (q >> 4) % BT, p = q & 15;
      const int k = (kc0 + kc) * 128 + p * 8;
      const bool ok = q < items && r < a.M && k < a.K;
#pragma unroll
      for (int h = 0; h < V; ++h)
        raw[u][h] = ok ? __ldg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(r) * a.K + k) + h)
                       : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) tma::cast_item8<V>(raw[u], BT, q0 + u * 128 + tid, items, sX, sXS);
  }
}

// Packed e2m1 [64 rows x 64 B] -> swizzled e4m3 [64 x 128 B] (values x 2^-6).
__device__ __forceinline__ void decode_mx(const char* pk, char* e) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int q = threadIdx.x + 128 * h, n = q >> 2, qq = q & 3;
    const uint4 v = *reinterpret_cast<const uint4*>(pk + n * 64 + qq * 16);
    const uint2 o0 = gemm::e2m1x8_to_e4m3(v.x), o1 = gemm::e2m1x8_to_e4m3(v.y);
    const uint2 o2 = gemm::e2m1x8_to_e4m3(v.z), o3 = gemm::e2m1x8_to_e4m3(v.w);
    *reinterpret_cast<uint4*>(e + n * 128 + (((2 * qq) ^ (n & 7)) << 4)) = make_uint4(o0.x, o0.y, o1.x, o1.y);
    *reinterpret_cast<uint4*>(e + n * 128 + (((2 * qq + 1) ^ (n & 7)) << 4)) = make_uint4(o2.x, o2.y, o3.x, o3.y);
  }
}

template <int BT, bool MX>
__global__ void __launch_bounds__(128, 1) stream_linear_kernel(const StreamArgs a, const __grid_constant__ CUtensorMap tmap) {
#if DEEPFUSE_SM90A_DEVICE
  using C = SCfg<MX>;
  constexpr int R = BT / 2;
  extern __shared__ char smem_raw[];
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int STAGES = a.stages;
  const SLayout L = stream_layout(MX, BT, a.cps, a.T, a.S, STAGES);
  const int tid = threadIdx.x, lane = tid & 31, wq = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const int split = blockIdx.x;
  const int kc0 = split * a.cps, nck = max(0, min(a.KB, kc0 + a.cps) - kc0);
  const int tile0 = blockIdx.y * a.T, Tc = min(a.ntiles, tile0 + a.T) - tile0;
  const int total = Tc * nck;
  uint64_t* bars = reinterpret_cast<uint64_t*>(base + L.bar);
  char* sW = base + L.w;
  char* sX = base + L.x;
  float* sXS = reinterpret_cast<float*>(base + L.xs);

  auto issue = [&](int i) {  // one thread: chunk i -> stage i % STAGES
    const int st = i % STAGES, t = i / nck, kc = i % nck;
    const uint32_t bar = gemm::smem_u32(bars + st);
    mbar_expect_tx(bar, C::SB);
    tma_load_2d(gemm::smem_u32(sW + st * C::SB), &tmap, (kc0 + kc) * (MX ? 64 : 128), (tile0 + t) * kTileRows, bar);
  };
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(gemm::smem_u32(bars + s), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    gemm::fence_proxy_async();
    for (int i = 0; i < min(total, STAGES); ++i) issue(i);
  }

  if (a.x_bf16) cast_x<BT, __nv_bfloat16>(a, kc0, nck, sX, sXS);
  else cast_x<BT, float>(a, kc0, nck, sX, sXS);
  if (!MX) {  // the 128 x 128 block scale of every chunk of the CTA
    float* sWS = reinterpret_cast<float*>(base + L.ws);
    for (int q = tid; q < total; q += 128) {
      const int t = q / nck, kc = q % nck;
      const int64_t off = static_cast<int64_t>((tile0 + t) * kTileRows / 128) * a.KB + kc0 + kc;
      sWS[q] = a.scale_u8 ? gemm::ue8m0_value(static_cast<const uint8_t*>(a.scale)[off])
                          : static_cast<const float*>(a.scale)[off];
    }
  } else {  // the four UE8M0 group scales of every row of every chunk, [t, kc, row] words
    uint32_t* sWS = reinterpret_cast<uint32_t*>(base + L.ws);
    const int KG = a.K / 32;
    for (int q = tid; q < total * kTileRows; q += 128) {
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

  float acc[R];
  const int rg = wq * 16 + g;  // this thread's tile rows rg, rg + 8
  float* red = reinterpret_cast<float*>(base + L.red);
  const int RS = red_stride(BT);

  auto epilogue = [&](int t) {
    const int n0 = (tile0 + t) * kTileRows;
    if (a.S == 1) {
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
    if (t > 0) cluster_wait();  // the peers have read the previous tile's partials
#pragma unroll
    for (int c8 = 0; c8 < BT / 8; ++c8)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int p = c8 * 8 + 2 * t4 + b;
        red[rg * RS + p] = acc[4 * c8 + b];
        red[(rg + 8) * RS + p] = acc[4 * c8 + 2 + b];
      }
    cluster_arrive();
    cluster_wait();
    const int rows = kTileRows / a.S, r0 = split * rows;
    for (int e = tid; e < rows * BT; e += 128) {
      const int row = r0 + e / BT, p = e % BT, n = n0 + row;
      if (p >= a.M || n >= a.N) continue;
      float s = 0.0f;
      for (int q = 0; q < a.S; ++q) s += ld_peer(red + row * RS + p, q);
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

  if constexpr (!MX) {
    const float* sWS = reinterpret_cast<const float*>(base + L.ws);
    int i = 0;
    for (int t = 0; t < Tc; ++t) {
#pragma unroll
      for (int j = 0; j < R; ++j) acc[j] = 0.0f;
      for (int kc = 0; kc < nck; ++kc, ++i) {
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
        __syncthreads();  // every warp's wgmmas on stage st are done: refill it
        if (tid == 0 && i + STAGES < total) issue(i + STAGES);
        gemm::promote<BT>(acc, part, ws, ws, sa);
      }
      epilogue(t);
    }
  } else {
    const uint32_t* sWS = reinterpret_cast<const uint32_t*>(base + L.ws);
    char* sE = base + L.e;
    if (total > 0) {
      mbar_wait(gemm::smem_u32(bars), 0);
      decode_mx(sW, sE);
      gemm::fence_proxy_async();
      __syncthreads();
      if (tid == 0 && STAGES < total) issue(STAGES);
    }
    int i = 0;
    for (int t = 0; t < Tc; ++t) {
#pragma unroll
      for (int j = 0; j < R; ++j) acc[j] = 0.0f;
      for (int kc = 0; kc < nck; ++kc, ++i) {
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
          decode_mx(sW + st1 * C::SB, sE + ((i + 1) & 1) * 8192);
          gemm::fence_proxy_async();
        }
        float sa[BT / 8][2];
        token_scales(kc, sa);
        const uint32_t sc0 = sWS[(t * nck + kc) * kTileRows + rg], sc1 = sWS[(t * nck + kc) * kTileRows + rg + 8];
        gemm::wgmma_wait0();
#pragma unroll
        for (int j = 0; j < 4; ++j) gemm::fence_regs(part[j]);
        __syncthreads();  // chunk i + 1 decoded (its stage free), chunk i's wgmmas done (its tile free)
        if (tid == 0 && i + 1 + STAGES < total) issue(i + 1 + STAGES);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float w0 = gemm::ue8m0_value((sc0 >> (8 * j)) & 0xFF) * 64.0f;
          const float w1 = gemm::ue8m0_value((sc1 >> (8 * j)) & 0xFF) * 64.0f;
          gemm::promote<BT>(acc, part[j], w0, w1, sa);
        }
      }
      epilogue(t);
    }
  }
  if (a.S > 1 && Tc > 0) cluster_wait();  // peers may still read this CTA's partials
#else
  __trap();  // wgmma / TMA: sm_90a only (launchers call require_sm90a)
#endif
}

// ---------------------------------------------------------------------------- host
struct StreamPlan {
  int BT = 0, S = 1, cps = 0, T = 1, ny = 0, stages = 0, smem = 0;
};

// Work split for `occ` CTAs per SM: K splits S (a power of two <= 8, while 64-row tiles x S
// leave SMs idle), tiles per CTA T (one wave), then the deepest weight ring that fits occ CTAs
// per SM. The largest occ whose ring holds >= 64 KB and whose S <= stream_max_splits wins;
// none: not served.
bool stream_plan(const LinearProblem& p, int max_m, StreamPlan& pl) {
  if (p.groups > 0 || p.M < 1 || p.M > max_m || p.M > 64 || p.N < 1) return false;
  pl.BT = p.M <= 8 ? 8 : p.M <= 16 ? 16 : p.M <= 32 ? 32 : 64;
  const int ntiles = ceil_div(p.N, kTileRows), KB = ceil_div(p.K, 128);
  const int SB = p.mxfp4 ? 4096 : 8192;
  for (int occ = 3; occ >= 1; --occ) {
    const int D = occ * num_sms();
    int S = 1;
    while (2 * S <= 8 && 2 * S <= KB && ntiles * S < D) S *= 2;
    int cps = ceil_div(KB, S);
    while (S > 1 && (S - 1) * cps >= KB) cps = ceil_div(KB, S /= 2);  // no empty split
    if (cps > kMaxChunksPerCta || S > p.stream_max_splits) continue;
    int T = std::max(1, ceil_div(ntiles * S, D));
    T = std::min(T, std::max(1, kMaxChunksPerCta / cps));
    const int budget = std::min(227 * 1024, 228 * 1024 / occ - 1024);  // 1 KB per CTA reserved
    const int other = stream_layout(p.mxfp4, pl.BT, cps, T, S, 0).total;
    const int stages = std::min(kMaxStages, (budget - other) / (SB + 8));
    if (stages * SB < 64 * 1024 && !(occ == 1 && stages >= 4)) continue;
    pl.S = S, pl.cps = cps, pl.T = T, pl.ny = ceil_div(ntiles, T), pl.stages = stages;
    pl.smem = stream_layout(p.mxfp4, pl.BT, cps, T, S, stages).total;
    return pl.smem <= 227 * 1024;
  }
  return false;
}

template <int BT, bool MX>
void launch_stream(const StreamArgs& a, const CUtensorMap& map, const StreamPlan& pl, cudaStream_t stream) {
  auto kern = stream_linear_kernel<BT, MX>;
  static const cudaError_t attr = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024);
  check_cuda(attr, "cudaFuncSetAttribute(stream_linear_kernel)");
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(pl.S, pl.ny, 1);
  cfg.blockDim = dim3(128, 1, 1);
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

template <bool MX>
void launch_bt(const StreamArgs& a, const CUtensorMap& map, const StreamPlan& pl, cudaStream_t stream) {
  switch (pl.BT) {
    case 8: launch_stream<8, MX>(a, map, pl, stream); break;
    case 16: launch_stream<16, MX>(a, map, pl, stream); break;
    case 32: launch_stream<32, MX>(a, map, pl, stream); break;
    default: launch_stream<64, MX>(a, map, pl, stream); break;
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
  const cuuint64_t dims[2] = {kbytes, static_cast<cuuint64_t>(p.N)};
  const cuuint64_t strides[1] = {kbytes};
  const cuuint32_t box[2] = {p.mxfp4 ? 64u : 128u, static_cast<cuuint32_t>(kTileRows)};
  const cuuint32_t es[2] = {1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(p.w), dims, strides, box, es,
                            CU_TENSOR_MAP_INTERLEAVE_NONE,
                            p.mxfp4 ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return false;  // e.g. a box wider than the tensor: the grouped kernel serves it
  StreamArgs a{};
  a.x = x, a.out = out, a.scale = p.scale;
  a.M = static_cast<int>(p.M), a.N = p.N, a.K = p.K, a.KB = ceil_div(p.K, 128), a.ntiles = ceil_div(p.N, kTileRows);
  a.S = pl.S, a.cps = pl.cps, a.T = pl.T, a.stages = pl.stages;
  a.x_bf16 = x_bf16, a.out_bf16 = out_bf16, a.scale_u8 = p.scale_u8;
  if (p.mxfp4) launch_bt<true>(a, map, pl, stream);
  else launch_bt<false>(a, map, pl, stream);
  return true;
}

}  // namespace deepfuse
