// Decode-path expert GEMMs of moe_experts (T <= 256, tasks of <= 16 rows): persistent,
// warp-specialised weight streaming (semantics: deepfuse/ops/moe.py; the plan, combine and the
// other path: moe_experts.cu).
//
// One CTA per SM, 288 threads: a producer warp and two consumer warpgroups. The work is the
// sequence of (task, 128-row weight tile) in task order, cut into one contiguous, equal range
// per CTA, so every touched expert's weights are streamed once, by many CTAs at the same time.
// - Producer (one thread): each stage (16 KB) is one 128-K chunk of the tile's 128 rows (fp8)
//   or two chunks of packed e2m1 (mxfp4), loaded by TMA (`cp.async.bulk.tensor`; 128-byte
//   swizzle for fp8 = wgmma's layout) into a ring of up to 16 stages; full / empty mbarriers
//   per stage; it runs ahead across tile and task boundaries.
// - Consumers: warpgroup w takes rows [64 w, 64 w + 64) of every stage (swapped wgmma m64 x 16
//   x k32, e4m3, both operands in shared memory) and releases the stage per warp after its
//   wgmmas are waited. fp8: one promotion per chunk with the 128 x 128 block scale; mxfp4:
//   each warpgroup decodes its 64 rows e2m1 -> e4m3 (exact, x 2^-6) into its own tile, four k32
//   groups accumulated apart, promoted with their UE8M0 scales.
// - Activations: at each task's start the consumers cast the task's rows of A (GEMM1: x
//   gathered through the plan's token rows; GEMM2: h at the task's positions) into swizzled
//   e4m3 tiles + fp32 scales per 128 (fp8_per_token_cast's math, bit-identical) in shared
//   memory: no cast launches.
// - GEMM1 tiles hold 32 w1 rows and the 32 w3 rows of the same columns per warpgroup; the up
//   half's accumulators meet the gate half's in shared memory for the clamped SwiGLU, h
//   written as bf16. GEMM2: times the routing weight, fp32 rows per pair (then the combine).
// Each tile's chunks are walked from a start that depends on the tile and the expert only, so a
// row's summation order never depends on the plan: results are bitwise reproducible.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "common/arch.h"
#include "common/cuda_utils.h"
#include "common/fp8_utils.cuh"
#include "gemm/grouped_gemm_sm90.cuh"
#include "gemm/tma_sm90.cuh"
#include "moe/moe_stream.h"

namespace deepfuse {
namespace {

constexpr int kBT = 16;             // tokens per task (the plan's rows per task at decode)
constexpr int kConsumers = 256;     // two warpgroups
constexpr int kThreads = kConsumers + 32;
constexpr int kStage = 16384;       // 128 rows x 128 bytes
constexpr int kMaxStages = 16;
constexpr int kBarAll = 1;          // named barriers: both consumer warpgroups; 2 + w: warpgroup w

struct Maps {
  CUtensorMap w0, w1, s0, s1;  // routed w1 | w3 (GEMM1) or w2, w2; shared the same
};

struct Args {
  const void* a;          // GEMM1: x [T, K] (bf16 / fp32); GEMM2: h bf16 [P, K]
  const int* a_rows;      // position -> row of a (GEMM1); null: the position (GEMM2)
  int K, N, E, KB;
  const void* scale0;     // routed scales of w0 / w1: fp8 [E, ceil(N/128), KB] (fp32 / UE8M0); mxfp4 u8 [E, N, K/32]
  const void* scale1;
  bool scale_u8;
  const void* sscale0;    // shared expert (fp8): [ceil(N/128), KB]
  const void* sscale1;
  bool sscale_u8;
  const int* tasks;       // [U, 3]: expert, first position, end position
  const int* ntasks;
  int ntiles;             // tiles per task
  int stages;
  void* out;              // GEMM1: h bf16 [P, N]; GEMM2: fp32 [P, N]
  const float* row_weight;
  float limit;
};

struct Layout {
  int ring, xe, x, xs, ws, sc, xch, bar, total;
};

__host__ __device__ inline Layout layout(bool mx, int K, int stages) {
  const int KB = (K + 127) / 128;
  Layout L{};
  int off = 0;
  L.ring = off;
  off += stages * kStage;
  L.xe = off;
  off += mx ? 2 * 16384 : 0;  // per warpgroup: two decoded e4m3 chunks of 64 rows
  L.x = off;
  off += KB * kBT * 128;
  L.xs = off;
  off += KB * kBT * 4;
  L.ws = off;
  off += 2 * 2 * KB * 4;  // per warpgroup: fp8 block scales of gate, up (or w2) per chunk
  L.sc = off;
  off += mx ? 2 * 64 * (K / 32) : 0;  // per warpgroup: 64 rows of UE8M0 group scales
  L.xch = off;
  off += 2 * 64 * 8 * 4;  // per warpgroup: the up half's accumulators
  off = (off + 7) & ~7;
  L.bar = off;
  off += 2 * stages * 8;
  L.total = off + 1024;
  return L;
}

// Rows [r0, r1) of A (through a_rows) -> e4m3 swizzled [kBT x 128] tiles per chunk + fp32 scales;
// rows from r1 on are zeros. All kConsumers threads; 16 consecutive lanes own one (chunk, row).
template <typename AT>
__device__ __forceinline__ void cast_a(const Args& a, int r0, int r1, char* sX, float* sXS) {
  constexpr bool kBf16 = sizeof(AT) == 2;
  constexpr int U = kBf16 ? 8 : 4, V = kBf16 ? 1 : 2;
  const int items = a.KB * kBT * 16, tid = threadIdx.x;
  const AT* x = static_cast<const AT*>(a.a);
  for (int q0 = 0; q0 < items; q0 += kConsumers * U) {
    uint4 raw[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int q = q0 + u * kConsumers + tid, kc = q / (kBT * 16), r = (q >> 4) % kBT, p = q & 15;
      const int k = kc * 128 + p * 8, pos = r0 + r;
      const bool ok = q < items && pos < r1 && k < a.K;
      const int64_t row = ok ? (a.a_rows != nullptr ? a.a_rows[pos] : pos) : 0;
#pragma unroll
      for (int h = 0; h < V; ++h)
        raw[u][h] = ok ? __ldg(reinterpret_cast<const uint4*>(x + row * a.K + k) + h) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) tma::cast_item8<V>(raw[u], kBT, q0 + u * kConsumers + tid, items, sX, sXS);
  }
}

// This warpgroup's 64 rows of a packed stage (row n at n * 128, chunk c's 64 bytes at c * 64)
// -> two swizzled e4m3 [64 x 128] tiles (values x 2^-6). 128 threads.
__device__ __forceinline__ void decode_mx2(const char* pk, char* e, int wt) {
#pragma unroll
  for (int h = 0; h < 4; ++h) {
    const int q = wt + 128 * h, c = q >> 8, n = (q >> 2) & 63, qq = q & 3;
    const uint4 v = *reinterpret_cast<const uint4*>(pk + n * 128 + c * 64 + qq * 16);
    const uint2 o0 = gemm::e2m1x8_to_e4m3(v.x), o1 = gemm::e2m1x8_to_e4m3(v.y);
    const uint2 o2 = gemm::e2m1x8_to_e4m3(v.z), o3 = gemm::e2m1x8_to_e4m3(v.w);
    char* t = e + c * 8192 + n * 128;
    *reinterpret_cast<uint4*>(t + (((2 * qq) ^ (n & 7)) << 4)) = make_uint4(o0.x, o0.y, o1.x, o1.y);
    *reinterpret_cast<uint4*>(t + (((2 * qq + 1) ^ (n & 7)) << 4)) = make_uint4(o2.x, o2.y, o3.x, o3.y);
  }
}

template <bool MX, bool SWIGLU, typename AT>
__global__ void __launch_bounds__(kThreads, 1) moe_stream_kernel(const Args a, const __grid_constant__ Maps maps) {
#if DEEPFUSE_SM90A_DEVICE
  constexpr int R = kBT / 2;
  extern __shared__ char smem_raw[];
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int S = a.stages;
  const Layout L = layout(MX, a.K, S);
  uint64_t* full = reinterpret_cast<uint64_t*>(base + L.bar);
  uint64_t* empty = full + S;
  const int tid = threadIdx.x;
  const int64_t total = static_cast<int64_t>(*a.ntasks) * a.ntiles;
  const int64_t j0 = total * blockIdx.x / gridDim.x, j1 = total * (blockIdx.x + 1) / gridDim.x;
  if (j0 >= j1) return;  // the whole CTA
  // Programmatic dependent launch (both GEMMs are launched with it): GEMM1 waits for the plan
  // (and x) before anything, then lets GEMM2 launch; GEMM2's producer streams weights at once
  // (the plan it reads finished before GEMM1 passed its wait) and its consumers wait for h.
  if (SWIGLU) {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  }
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      tma::mbar_init(tma::smem_u32(full + s), 1);
      tma::mbar_init(tma::smem_u32(empty + s), 8);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int KB = a.KB;
  // stages per tile (fp8: one chunk each; mxfp4: two) and the tile's first stage
  auto nst = [&](bool f8) { return f8 ? KB : (KB + 1) / 2; };
  auto rot_of = [&](int e, int t, int n) { return (t * 5 + e * 11) % n; };

  if (tid >= kConsumers) {  // producer warp: one thread issues every stage
    if (tid == kConsumers) {
      int i = 0;
      for (int64_t j = j0; j < j1; ++j) {
        const int task = static_cast<int>(j / a.ntiles), t = static_cast<int>(j % a.ntiles);
        const int e = a.tasks[task * 3];
        const bool sh = e == a.E, f8 = !MX || sh;
        const int n = nst(f8), rot = rot_of(e, t, n);
        const CUtensorMap* m0 = sh ? &maps.s0 : &maps.w0;
        const CUtensorMap* m1 = sh ? &maps.s1 : &maps.w1;
        const int rb = sh ? 0 : e * a.N;
        for (int u = 0; u < n; ++u, ++i) {
          const int st = i % S;
          if (i >= S) tma::mbar_wait(tma::smem_u32(empty + st), ((i / S) - 1) & 1);
          const int c0 = ((u + rot) % n) * 128;  // bytes: one fp8 chunk or two packed mxfp4 chunks
          const uint32_t bar = tma::smem_u32(full + st), dst = tma::smem_u32(base + L.ring + st * kStage);
          tma::mbar_expect_tx(bar, kStage);
          if (SWIGLU) {  // per warpgroup: 32 w1 rows, then the 32 w3 rows of the same columns
            const int col = rb + t * 64;
            tma::tma_load_2d(dst, m0, c0, col, bar);
            tma::tma_load_2d(dst + 4096, m1, c0, col, bar);
            tma::tma_load_2d(dst + 8192, m0, c0, col + 32, bar);
            tma::tma_load_2d(dst + 12288, m1, c0, col + 32, bar);
          } else {
            tma::tma_load_2d(dst, m0, c0, rb + t * 128, bar);
          }
        }
      }
    }
    return;
  }

  // consumers
  const int wg = tid >> 7, wt = tid & 127, wq = wt >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int rg = wq * 16 + g;  // this thread's rows rg, rg + 8 of its warpgroup's 64
  char* sX = base + L.x;
  float* sXS = reinterpret_cast<float*>(base + L.xs);
  float* sWS = reinterpret_cast<float*>(base + L.ws) + wg * 2 * KB;
  const int KW = a.K / 128;  // mxfp4: 32-bit words of group scales per row
  uint32_t* sSC = reinterpret_cast<uint32_t*>(base + L.sc) + wg * 64 * KW;
  float* xch = reinterpret_cast<float*>(base + L.xch) + wg * 64 * 8;
  char* sE = base + L.xe + wg * 16384;
  const int bar_wg = 2 + wg;
  const int NB = (a.N + 127) / 128;

  if (!SWIGLU) asm volatile("griddepcontrol.wait;\n" ::: "memory");
  int cur = -1, r0 = 0, r1 = 0, i = 0;
  float acc[R];
  for (int64_t j = j0; j < j1; ++j) {
    const int task = static_cast<int>(j / a.ntiles), t = static_cast<int>(j % a.ntiles);
    const int e = a.tasks[task * 3];
    const bool sh = e == a.E, f8 = !MX || sh;
    if (task != cur) {  // the task's activations (both warpgroups are past their last wgmma on x)
      tma::named_bar(kBarAll, kConsumers);
      cur = task, r0 = a.tasks[task * 3 + 1], r1 = a.tasks[task * 3 + 2];
      cast_a<AT>(a, r0, r1, sX, sXS);
      gemm::fence_proxy_async();
      tma::named_bar(kBarAll, kConsumers);
    }
    // this warpgroup's scales for the tile (after every warp's last read of the previous ones)
    tma::named_bar(bar_wg, 128);
    const bool up_rows = SWIGLU && wq >= 2;
    if (f8) {
      const int nb = SWIGLU ? (t * 64) / 128 : t;
      for (int q = wt; q < (SWIGLU ? 2 : 1) * KB; q += 128) {
        const int m = q / KB, kb = q % KB;
        const void* sp = sh ? (m ? a.sscale1 : a.sscale0) : (m ? a.scale1 : a.scale0);
        const bool u8 = sh ? a.sscale_u8 : a.scale_u8;
        const int64_t off = (static_cast<int64_t>(sh ? 0 : e) * NB + nb) * KB + kb;
        sWS[m * KB + kb] =
            u8 ? gemm::ue8m0_value(static_cast<const uint8_t*>(sp)[off]) : static_cast<const float*>(sp)[off];
      }
    } else {  // 64 rows x KW words, eight loads in flight per thread
      for (int q0 = wt; q0 < 64 * KW; q0 += 128 * 8) {
        uint32_t v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int q = q0 + u * 128, r = q / KW, w = q % KW;
          const int n = SWIGLU ? t * 64 + wg * 32 + (r & 31) : t * 128 + wg * 64 + r;
          const uint8_t* sp = static_cast<const uint8_t*>(SWIGLU && r >= 32 ? a.scale1 : a.scale0);
          v[u] = q < 64 * KW && n < a.N
                     ? __ldg(reinterpret_cast<const uint32_t*>(sp + (static_cast<int64_t>(e) * a.N + n) * (a.K / 32)) + w)
                     : 0u;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u)
          if (q0 + u * 128 < 64 * KW) sSC[q0 + u * 128] = v[u];
      }
    }
    tma::named_bar(bar_wg, 128);
#pragma unroll
    for (int c = 0; c < R; ++c) acc[c] = 0.0f;
    const int n = nst(f8), rot = rot_of(e, t, n);
    for (int u = 0; u < n; ++u, ++i) {
      const int st = i % S, ku = (u + rot) % n;
      const char* stage = base + L.ring + st * kStage;
      tma::mbar_wait(tma::smem_u32(full + st), (i / S) & 1);
      if (f8) {
        const uint32_t wa = tma::smem_u32(stage + wg * 8192), xa = tma::smem_u32(sX + ku * kBT * 128);
        float part[R];
        gemm::wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k)
          gemm::wgmma_tile<kBT>(part, gemm::smem_desc(wa + k * 32), gemm::smem_desc(xa + k * 32), k);
        gemm::wgmma_commit();
        float sa[kBT / 8][2];
#pragma unroll
        for (int c8 = 0; c8 < kBT / 8; ++c8) {
          sa[c8][0] = sXS[ku * kBT + c8 * 8 + 2 * t4];
          sa[c8][1] = sXS[ku * kBT + c8 * 8 + 2 * t4 + 1];
        }
        const float ws = sWS[(up_rows ? KB : 0) + ku];
        gemm::wgmma_wait0();
        gemm::fence_regs(part);
        __syncwarp();
        if (lane == 0) tma::mbar_arrive(tma::smem_u32(empty + st));
        gemm::promote<kBT>(acc, part, ws, ws, sa);
      } else {
        tma::named_bar(bar_wg, 128);  // every warp's wgmmas on sE are done
        decode_mx2(stage + wg * 8192, sE, wt);
        gemm::fence_proxy_async();
        tma::named_bar(bar_wg, 128);
        if (lane == 0) tma::mbar_arrive(tma::smem_u32(empty + st));
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int kc = 2 * ku + c;
          if (kc >= KB) break;
          const uint32_t ea = tma::smem_u32(sE + c * 8192), xa = tma::smem_u32(sX + kc * kBT * 128);
          float part[4][R];
          gemm::wgmma_fence();
#pragma unroll
          for (int k = 0; k < 4; ++k)
            gemm::wgmma_tile<kBT>(part[k], gemm::smem_desc(ea + k * 32), gemm::smem_desc(xa + k * 32), 0);
          gemm::wgmma_commit();
          float sa[kBT / 8][2];
#pragma unroll
          for (int c8 = 0; c8 < kBT / 8; ++c8) {
            sa[c8][0] = sXS[kc * kBT + c8 * 8 + 2 * t4];
            sa[c8][1] = sXS[kc * kBT + c8 * 8 + 2 * t4 + 1];
          }
          const uint32_t sc0 = sSC[rg * KW + kc], sc1 = sSC[(rg + 8) * KW + kc];
          gemm::wgmma_wait0();
#pragma unroll
          for (int k = 0; k < 4; ++k) gemm::fence_regs(part[k]);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const float w0 = gemm::ue8m0_value((sc0 >> (8 * k)) & 0xFF) * 64.0f;
            const float w1 = gemm::ue8m0_value((sc1 >> (8 * k)) & 0xFF) * 64.0f;
            gemm::promote<kBT>(acc, part[k], w0, w1, sa);
          }
        }
      }
    }

    // epilogue: thread rows rg (acc[4 c8 + b]) and rg + 8 (acc[4 c8 + 2 + b]), tokens c8 * 8 + 2 t4 + b
    if (SWIGLU) {
      if (up_rows) {
#pragma unroll
        for (int c = 0; c < R; ++c) xch[(wt - 64) * 8 + c] = acc[c];
      }
      tma::named_bar(bar_wg, 128);
      if (!up_rows) {
        __nv_bfloat16* h = static_cast<__nv_bfloat16*>(a.out);
        const int col = t * 64 + wg * 32 + wq * 16 + g;
#pragma unroll
        for (int c8 = 0; c8 < kBT / 8; ++c8)
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const int p = r0 + c8 * 8 + 2 * t4 + b;
            if (p >= r1) continue;
            const int64_t o = static_cast<int64_t>(p) * a.N;
            if (col < a.N)
              h[o + col] = __float2bfloat16_rn(
                  gemm::swiglu_f(acc[4 * c8 + b], xch[wt * 8 + 4 * c8 + b], a.limit));
            if (col + 8 < a.N)
              h[o + col + 8] = __float2bfloat16_rn(
                  gemm::swiglu_f(acc[4 * c8 + 2 + b], xch[wt * 8 + 4 * c8 + 2 + b], a.limit));
          }
      }
    } else {
      float* y = static_cast<float*>(a.out);
      const int nrow = t * 128 + wg * 64 + rg;
#pragma unroll
      for (int c8 = 0; c8 < kBT / 8; ++c8)
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const int p = r0 + c8 * 8 + 2 * t4 + b;
          if (p >= r1) continue;
          const float w = a.row_weight != nullptr ? a.row_weight[p] : 1.0f;
          const int64_t o = static_cast<int64_t>(p) * a.N;
          if (nrow < a.N) y[o + nrow] = acc[4 * c8 + b] * w;
          if (nrow + 8 < a.N) y[o + nrow + 8] = acc[4 * c8 + 2 + b] * w;
        }
    }
  }
#else
  __trap();  // wgmma / TMA: sm_90a only (launchers call require_sm90a)
#endif
}

int stages_for(bool mx, int K) {
  const int fixed = layout(mx, K, 0).total;
  return std::min(kMaxStages, (227 * 1024 - fixed) / (kStage + 16));
}

template <bool MX, bool SWIGLU, typename AT>
void launch(const Args& a, const Maps& maps, int grid, cudaStream_t stream) {
  auto kern = moe_stream_kernel<MX, SWIGLU, AT>;
  static const cudaError_t attr = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024);
  check_cuda(attr, "cudaFuncSetAttribute(moe_stream_kernel)");
  const bool no_pdl = std::getenv("DEEPFUSE_MOE_NO_PDL") != nullptr;  // to compare the launches
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid, 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = layout(MX, a.K, a.stages).total;
  cfg.stream = stream;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = no_pdl ? 0 : 1;
  check_cuda(cudaLaunchKernelEx(&cfg, kern, a, maps), "moe_stream_kernel");
}

// Maps of one projection: routed [E * N, Kb] (fp8 swizzled / packed mxfp4) and shared [N, K].
bool encode_pair(const MoeProblem& p, const ExpertWeight& w, const ExpertWeight& sw, int N, int K, int box_rows,
                 CUtensorMap& m, CUtensorMap& sm) {
  const bool mx = p.fmt == WeightFmt::kMxfp4;
  if (!tma::encode_u8_2d(m, w.w, static_cast<int64_t>(p.E) * N, mx ? K / 2 : K, 128, box_rows, !mx)) return false;
  if (p.has_shared) return tma::encode_u8_2d(sm, sw.w, N, K, 128, box_rows, true);
  sm = m;  // unused (no task has expert E)
  return true;
}

}  // namespace

bool moe_stream_gemms(const MoeProblem& p, const MoeStreamIO& io, cudaStream_t stream) {
  const bool mx = p.fmt == WeightFmt::kMxfp4;
  // K of either GEMM must hold the 128-byte boxes (fp8: K >= 128; mxfp4 packs two chunks)
  if (p.d < 128 || p.inter < 128 || (mx && (p.d < 256 || p.inter < 256))) return false;
  const int st1 = stages_for(mx, p.d), st2 = stages_for(mx, p.inter);
  if (st1 < 3 || st2 < 3) return false;
  Maps m1{}, m2{};
  if (!encode_pair(p, p.w1, p.sw1, p.inter, p.d, 32, m1.w0, m1.s0) ||
      !encode_pair(p, p.w3, p.sw3, p.inter, p.d, 32, m1.w1, m1.s1) ||
      !encode_pair(p, p.w2, p.sw2, p.d, p.inter, 128, m2.w0, m2.s0))
    return false;
  m2.w1 = m2.w0, m2.s1 = m2.s0;
  const int sms = num_sms();

  Args a1{};
  a1.a = io.x, a1.a_rows = io.rows, a1.K = p.d, a1.N = p.inter, a1.E = p.E, a1.KB = ceil_div(p.d, 128);
  a1.scale0 = p.w1.scale, a1.scale1 = p.w3.scale, a1.scale_u8 = p.w1.scale_u8;
  a1.sscale0 = p.sw1.scale, a1.sscale1 = p.sw3.scale, a1.sscale_u8 = p.sw1.scale_u8;
  a1.tasks = io.tasks, a1.ntasks = io.ntasks, a1.ntiles = ceil_div(p.inter, 64), a1.stages = st1;
  a1.out = io.h, a1.limit = p.limit;
  const int g1 = static_cast<int>(std::min<int64_t>(sms, io.U * a1.ntiles));
  if (mx) {
    if (io.x_bf16) launch<true, true, __nv_bfloat16>(a1, m1, g1, stream);
    else launch<true, true, float>(a1, m1, g1, stream);
  } else {
    if (io.x_bf16) launch<false, true, __nv_bfloat16>(a1, m1, g1, stream);
    else launch<false, true, float>(a1, m1, g1, stream);
  }

  Args a2{};
  a2.a = io.h, a2.a_rows = nullptr, a2.K = p.inter, a2.N = p.d, a2.E = p.E, a2.KB = ceil_div(p.inter, 128);
  a2.scale0 = a2.scale1 = p.w2.scale, a2.scale_u8 = p.w2.scale_u8;
  a2.sscale0 = a2.sscale1 = p.sw2.scale, a2.sscale_u8 = p.sw2.scale_u8;
  a2.tasks = io.tasks, a2.ntasks = io.ntasks, a2.ntiles = ceil_div(p.d, 128), a2.stages = st2;
  a2.out = io.Y, a2.row_weight = io.wrow;
  const int g2 = static_cast<int>(std::min<int64_t>(sms, io.U * a2.ntiles));
  if (mx) launch<true, false, __nv_bfloat16>(a2, m2, g2, stream);
  else launch<false, false, __nv_bfloat16>(a2, m2, g2, stream);
  return true;
}

}  // namespace deepfuse
