// Decode-path expert GEMMs of moe_experts (T <= 256, tasks of <= 16 rows): persistent,
// warp-specialised weight streaming (semantics: deepfuse/ops/moe.py; the plan, combine and the
// other path: moe_experts.cu).
//
// One CTA per SM, 288 threads: a producer warp and two consumer warpgroups. The work is the
// sequence of (task, 128-row weight tile) in task order, cut into one contiguous, equal range
// per CTA, so every touched expert's weights are streamed once, by many CTAs at the same time.
// - Producer warp: one lane issues every stage (16 KB): one 128-K chunk of the tile's 128 rows
//   (fp8) or two chunks of packed e2m1 (mxfp4), loaded by TMA (`cp.async.bulk.tensor`, 128-byte
//   swizzle) into a ring of up to 16 stages; full / empty mbarriers per stage; it runs ahead
//   across tile and task boundaries. mxfp4: before each tile's stages the 32 lanes copy the
//   tile's UE8M0 group scales (128 rows x K/32 bytes) into one of two scale slots (cp.async,
//   completion tracked by the slot's mbarrier), so no consumer waits on a scale load.
// - Consumers: warpgroup w takes rows [64 w, 64 w + 64) of every stage (swapped wgmma m64 x 16
//   x k32, e4m3, tokens from shared memory). fp8: weights from shared memory, one promotion per
//   chunk with the 128 x 128 block scale; the stage is released after the wgmmas are waited.
//   mxfp4: each thread loads the packed words of its two rows of the stage (one 32-bit word per
//   row per 32-value group), releases the stage at once, and decodes e2m1 -> e4m3 straight into
//   wgmma's register A fragments (exact: the e4m3 bits m << 2 | s << 7 are the e2m1 value x 2^-6):
//   the even elements of its word are the fragment's k slots 4 t..4 t + 3, the odd ones slots
//   16 + 4 t.., so the token tiles of mxfp4 tasks are stored with K permuted the same way within
//   each 32-group (the dot product is unchanged). A chunk's four k32 wgmmas (one MX group each)
//   accumulate apart; each is scaled by its row's 2^(s - 127) x 2^6 and summed, then times the
//   token scale; the next chunk's decode and wgmmas overlap the previous chunk's wait.
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
// threads per CTA: fp8 a producer warp; mxfp4 a producer warpgroup (one working warp) so that
// setmaxnreg can move registers to the consumers (wgmma kernels allocate per warpgroup)
constexpr int threads_of(bool mx) { return kConsumers + (mx ? 128 : 32); }
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
  bool sc16;              // mxfp4: the group scales are copied 16 bytes at a time (else 4)
  const int* tasks;       // [U, 3]: expert, first position, end position
  const int* ntasks;
  int ntiles;             // tiles per task
  int stages;
  void* out;              // GEMM1: h bf16 [P, N]; GEMM2: fp32 [P, N]
  const float* row_weight;
  float limit;
  int sh_tasks;           // the shared expert's tasks (the last ones of the plan; mxfp4: fp8 tiles of KB stages)
  bool balance;           // equal stage ranges per CTA (tiles split between two CTAs), else whole tiles
  int* bcnt;              // balance: arrivals per CTA boundary (zeroed by the plan kernel)
  float* bpart;           // balance: [boundary][2 sides][kConsumers][kBT / 2] partial accumulators
};

struct Layout {
  int ring, x, xs, ws, sc, ss, xch, flag, bar, total;
};

// mxfp4 scale slot row stride (bytes): K/32 plus a pad that spreads a warp's eight rows over the banks
__host__ __device__ inline int scale_stride(int K) { return (K / 32) % 16 == 0 ? K / 32 + 16 : K / 32 + 4; }

__host__ __device__ inline Layout layout(bool mx, int K, int stages) {
  const int KB = (K + 127) / 128;
  Layout L{};
  int off = 0;
  L.ring = off;
  off += stages * kStage;
  L.x = off;
  off += KB * kBT * 128;
  L.xs = off;
  off += KB * kBT * 4;
  L.ws = off;
  off += 2 * 2 * KB * 4;  // per warpgroup: fp8 block scales of gate, up (or w2) per chunk
  L.sc = off;
  L.ss = mx ? scale_stride(K) : 0;
  off += mx ? 2 * 128 * L.ss : 0;  // mxfp4: two slots of a tile's 128 rows of UE8M0 group scales
  L.xch = off;
  off += 2 * 64 * 8 * 4;  // per warpgroup: the up half's accumulators
  L.flag = off;
  off += 16;  // balance: the boundary counter's old value
  off = (off + 7) & ~7;
  L.bar = off;
  off += 2 * stages * 8 + (mx ? 4 * 8 : 0);  // full, empty per stage; mxfp4: full, empty per scale slot
  L.total = off + 1024;
  return L;
}

// Rows [r0, r1) of A (through a_rows) -> e4m3 swizzled [kBT x 128] tiles per chunk + fp32 scales;
// rows from r1 on are zeros. All kConsumers threads; 16 consecutive lanes own one (chunk, row).
// perm (the tokens of mxfp4 tiles): within each 32-group, element 8 t + 2 i goes to k slot 4 t + i
// and element 8 t + 2 i + 1 to slot 16 + 4 t + i (the register A fragments' order, see the top).
template <typename AT>
__device__ __forceinline__ void cast_a(const Args& a, int r0, int r1, char* sX, float* sXS, bool perm) {
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
    if (!perm) {
#pragma unroll
      for (int u = 0; u < U; ++u) tma::cast_item8<V>(raw[u], kBT, q0 + u * kConsumers + tid, items, sX, sXS);
      continue;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {  // tma::cast_item8 with the permuted store
      const int q = q0 + u * kConsumers + tid, kc = q / (kBT * 16), r = (q >> 4) % kBT, p = q & 15;
      float v[8];
      if constexpr (V == 1) {
        widen8(raw[u][0], v);
      } else {
        const float* f0 = reinterpret_cast<const float*>(&raw[u][0]);
        const float* f1 = reinterpret_cast<const float*>(&raw[u][1]);
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = f0[i], v[4 + i] = f1[i];
      }
      const float s = tma::scale8_group128(v);
      if (q < items) {
        const uint2 o = to_e4m3x8(v);
        char* t = sX + kc * kBT * 128 + r * 128 + 4 * (p & 3);
        const int G = p >> 2;
        *reinterpret_cast<uint32_t*>(t + (((2 * G) ^ (r & 7)) << 4)) = __byte_perm(o.x, o.y, 0x6420);
        *reinterpret_cast<uint32_t*>(t + (((2 * G + 1) ^ (r & 7)) << 4)) = __byte_perm(o.x, o.y, 0x7531);
        if (p == 0) sXS[kc * kBT + r] = s;
      }
    }
  }
}

// wgmma m64n16k32 e4m3 with A from registers (this thread's fragment: rows g, g + 8 of its warp's
// 16, k slots 4 t.. (a0: row g, a1: row g + 8) and 16 + 4 t.. (a2, a3)); d = A B (scale-d 0).
__device__ __forceinline__ void wgmma_rs_m64n16k32(float (&d)[8], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(0));
}
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// One 128-K chunk of packed e2m1 (words w[4 c..4 c + 3]: this thread's word of each 32-group of
// row g (wa) and row g + 8 (wb)) -> four register fragments -> four k32 wgmmas into p[0..3];
// dx: the token chunk's shared-memory descriptor (its 32-byte k steps add 2).
__device__ __forceinline__ void mx_chunk_mma(float (&p)[4][kBT / 2], const uint32_t (&wa)[8], const uint32_t (&wb)[8],
                                             int c, uint64_t dx) {
  uint32_t f[4][4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t x = wa[4 * c + k], y = wb[4 * c + k];
    f[k][0] = ((x << 2) & 0x1C1C1C1Cu) | ((x << 4) & 0x80808080u);  // even elements
    f[k][2] = ((x >> 2) & 0x1C1C1C1Cu) | (x & 0x80808080u);         // odd elements
    f[k][1] = ((y << 2) & 0x1C1C1C1Cu) | ((y << 4) & 0x80808080u);
    f[k][3] = ((y >> 2) & 0x1C1C1C1Cu) | (y & 0x80808080u);
  }
  gemm::wgmma_fence();
#pragma unroll
  for (int k = 0; k < 4; ++k) wgmma_rs_m64n16k32(p[k], f[k], dx + 2 * k);
  gemm::wgmma_commit();
}

// 2^(s - 127) x 2^6 for UE8M0 byte k of w (= gemm::ue8m0_value(s) * 64 for every s: s = 0 gives
// 2^-121, s >= 249 infinity).
__device__ __forceinline__ float mx_scale(uint32_t w, int k) {
  return __uint_as_float((min((w >> (8 * k)) & 0xFFu, 249u) + 6u) << 23);
}

// acc += (sum_k p[k] x row scale_k) x token scale, for chunk kc (wgmmas waited, p fenced).
__device__ __forceinline__ void mx_promote(float (&acc)[kBT / 2], float (&p)[4][kBT / 2], uint32_t sa, uint32_t sb,
                                           const float* sXS, int kc, int t4) {
  gemm::fence_regs(p[0]), gemm::fence_regs(p[1]), gemm::fence_regs(p[2]), gemm::fence_regs(p[3]);
  float c[kBT / 2];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float w0 = mx_scale(sa, k), w1 = mx_scale(sb, k);
#pragma unroll
    for (int i = 0; i < kBT / 2; ++i) {
      const float w = (i & 2) ? w1 : w0;
      c[i] = k == 0 ? p[k][i] * w : fmaf(p[k][i], w, c[i]);
    }
  }
#pragma unroll
  for (int c8 = 0; c8 < kBT / 8; ++c8)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const float s = sXS[kc * kBT + c8 * 8 + 2 * t4 + b];
      acc[4 * c8 + b] = fmaf(c[4 * c8 + b], s, acc[4 * c8 + b]);
      acc[4 * c8 + 2 + b] = fmaf(c[4 * c8 + 2 + b], s, acc[4 * c8 + 2 + b]);
    }
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

template <bool MX, bool SWIGLU, typename AT>
__global__ void __launch_bounds__(threads_of(MX), 1) moe_stream_kernel(const Args a, const __grid_constant__ Maps maps) {
#if DEEPFUSE_SM90A_DEVICE
  constexpr int R = kBT / 2;
  extern __shared__ char smem_raw[];
  // 1024-aligned; offset from smem_raw (not through an integer) so that its loads and stores
  // stay shared-memory instructions (LDS / STS, not generic LD / ST)
  char* base = smem_raw + ((1024u - (tma::smem_u32(smem_raw) & 1023u)) & 1023u);
  const int S = a.stages;
  const Layout L = layout(MX, a.K, S);
  uint64_t* full = reinterpret_cast<uint64_t*>(base + L.bar);
  uint64_t* empty = full + S;
  uint64_t* sfull = empty + S;  // mxfp4 scale slots
  uint64_t* sempty = sfull + 2;
  const int tid = threadIdx.x;
  // Programmatic dependent launch (both GEMMs are launched with it): GEMM1 waits for the plan
  // (and x) before anything, its task count included (the plan kernel may trigger its dependents
  // early), then lets GEMM2 launch; GEMM2's producer streams weights at once (the plan it reads
  // finished before GEMM1 passed its wait) and its consumers wait for h.
  if (SWIGLU) {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  }
  const int KB = a.KB;
  // The work: stages (task, tile, u) in task order; routed mxfp4 tiles have nR = ceil(KB / 2) stages,
  // fp8 tiles (and the shared expert's, the last sh_tasks tasks) nF = KB. This CTA takes stages
  // [s0, s1): whole tiles, or (balance) an equal share, a tile then split between two CTAs.
  const int ntk = *a.ntasks, nF = KB, nR = MX ? (KB + 1) / 2 : KB;
  const int Rt = MX ? max(0, ntk - a.sh_tasks) : ntk;
  const int64_t stR = static_cast<int64_t>(Rt) * a.ntiles * nR;
  const int64_t total = stR + static_cast<int64_t>(ntk - Rt) * a.ntiles * nF;
  int64_t s0, s1;
  // Balance only while the plan's rows are placed deterministically into tasks (each routed expert in one task;
  // the shared expert's rows in token order): a split tile's sum order depends on its task's place in the work.
  if (a.balance && a.ntasks[1] == 0) {  // ranges of >= nmax stages: a tile meets at most two CTAs
    const int nmax = ntk > Rt ? max(nR, nF) : nR;
    const int64_t G = max64(1, min64(gridDim.x, total / nmax));
    if (blockIdx.x >= G) return;  // the whole CTA
    s0 = total * blockIdx.x / G, s1 = total * (blockIdx.x + 1) / G;
  } else {
    const int64_t tiles = static_cast<int64_t>(ntk) * a.ntiles;
    const int64_t j0 = tiles * blockIdx.x / gridDim.x, j1 = tiles * (blockIdx.x + 1) / gridDim.x;
    auto first_stage = [&](int64_t j) {
      return j < static_cast<int64_t>(Rt) * a.ntiles ? j * nR : stR + (j - static_cast<int64_t>(Rt) * a.ntiles) * nF;
    };
    s0 = first_stage(j0), s1 = first_stage(j1);
  }
  if (s0 >= s1) return;  // the whole CTA
  // stage s -> task, tile t, stage u of the tile, n stages per tile
  auto locate = [&](int64_t s, int& task, int& t, int& u, int& n) {
    int64_t q = s;
    n = nR;
    int tb = 0;
    if (s >= stR) q = s - stR, n = nF, tb = Rt;
    const int64_t per = static_cast<int64_t>(a.ntiles) * n;
    task = tb + static_cast<int>(q / per);
    const int r = static_cast<int>(q - (task - tb) * per);
    t = r / n, u = r - t * n;
  };
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      tma::mbar_init(tma::smem_u32(full + s), 1);
      tma::mbar_init(tma::smem_u32(empty + s), 8);  // one arrival per consumer warp
    }
    if (MX) {
      for (int s = 0; s < 2; ++s) {
        tma::mbar_init(tma::smem_u32(sfull + s), 32);  // the producer lanes' cp.async arrivals
        tma::mbar_init(tma::smem_u32(sempty + s), 8);
      }
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  auto rot_of = [&](int e, int t, int n) { return (t * 5 + e * 11) % n; };

  if (tid >= kConsumers) {  // producer warp
    if (MX) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
      if (tid >= kConsumers + 32) return;
    }
    const int lane = tid & 31;
    int i = 0, jj = 0;  // ring stages, pieces (a tile or the part of a split tile that is this CTA's)
    for (int64_t s = s0; s < s1; ++jj) {
      int task, t, u0, n;
      locate(s, task, t, u0, n);
      const int u1 = static_cast<int>(min64(n, u0 + (s1 - s)));
      s += u1 - u0;
      const int e = a.tasks[task * 3];
      const bool sh = e == a.E, f8 = !MX || sh;
      if (MX) {  // the tile's group scales into slot jj & 1 (every piece takes a slot; fp8 tiles leave it empty)
        const int slot = jj & 1;
        if (jj >= 2) tma::mbar_wait(tma::smem_u32(sempty + slot), ((jj >> 1) - 1) & 1);
        if (!f8) {
          const int KWB = a.K / 32;  // bytes per row; each lane copies rows lane, lane + 32, ..
          char* dst0 = base + L.sc + slot * 128 * L.ss;
#pragma unroll 1
          for (int R = lane; R < 128; R += 32) {
            const int n = SWIGLU ? t * 64 + (R >> 6) * 32 + (R & 31) : t * 128 + R;
            const uint8_t* sp = static_cast<const uint8_t*>(SWIGLU && (R & 32) ? a.scale1 : a.scale0);
            const bool ok = n < a.N;
            const uint8_t* src = sp + (ok ? (static_cast<int64_t>(e) * a.N + n) * KWB : 0);
            char* dst = dst0 + R * L.ss;
            if (a.sc16) {
              for (int c = 0; c < KWB; c += 16) gemm::cp_async16(dst + c, src + c, ok);
            } else {
              for (int c = 0; c < KWB; c += 4) gemm::cp_async4(dst + c, src + c, ok);
            }
          }
        }
        cp_async_mbar_arrive(tma::smem_u32(sfull + slot));
      }
      if (lane == 0) {  // one thread issues every stage
        const int rot = rot_of(e, t, n);
        const CUtensorMap* m0 = sh ? &maps.s0 : &maps.w0;
        const CUtensorMap* m1 = sh ? &maps.s1 : &maps.w1;
        const int rb = sh ? 0 : e * a.N;
        for (int u = u0; u < u1; ++u, ++i) {
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
      __syncwarp();
    }
    return;
  }

  // consumers
  if (MX) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int wg = tid >> 7, wt = tid & 127, wq = wt >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int rg = wq * 16 + g;  // this thread's rows rg, rg + 8 of its warpgroup's 64
  char* sX = base + L.x;
  float* sXS = reinterpret_cast<float*>(base + L.xs);
  float* sWS = reinterpret_cast<float*>(base + L.ws) + wg * 2 * KB;
  float* xch = reinterpret_cast<float*>(base + L.xch) + wg * 64 * 8;
  const int bar_wg = 2 + wg;
  const int NB = (a.N + 127) / 128;

  if (!SWIGLU) asm volatile("griddepcontrol.wait;\n" ::: "memory");
  int cur = -1, r0 = 0, r1 = 0, i = 0, jj = 0;
  int* sflag = reinterpret_cast<int*>(base + L.flag);
  float acc[R];
  for (int64_t s = s0; s < s1; ++jj) {
    int task, t, u0, n;
    locate(s, task, t, u0, n);
    const int u1 = static_cast<int>(min64(n, u0 + (s1 - s)));
    s += u1 - u0;
    const int e = a.tasks[task * 3];
    const bool sh = e == a.E, f8 = !MX || sh;
    if (task != cur) {  // the task's activations (both warpgroups are past their last wgmma on x)
      tma::named_bar(kBarAll, kConsumers);
      cur = task, r0 = a.tasks[task * 3 + 1], r1 = a.tasks[task * 3 + 2];
      cast_a<AT>(a, r0, r1, sX, sXS, MX && !sh);
      gemm::fence_proxy_async();
      tma::named_bar(kBarAll, kConsumers);
    }
    const bool up_rows = SWIGLU && wq >= 2;
    if (f8) {  // this warpgroup's block scales for the tile (after every warp's last read of the previous ones)
      tma::named_bar(bar_wg, 128);
      const int nb = SWIGLU ? (t * 64) / 128 : t;
      for (int q = wt; q < (SWIGLU ? 2 : 1) * KB; q += 128) {
        const int m = q / KB, kb = q % KB;
        const void* sp = sh ? (m ? a.sscale1 : a.sscale0) : (m ? a.scale1 : a.scale0);
        const bool u8 = sh ? a.sscale_u8 : a.scale_u8;
        const int64_t off = (static_cast<int64_t>(sh ? 0 : e) * NB + nb) * KB + kb;
        sWS[m * KB + kb] =
            u8 ? gemm::ue8m0_value(static_cast<const uint8_t*>(sp)[off]) : static_cast<const float*>(sp)[off];
      }
      tma::named_bar(bar_wg, 128);
    }
#pragma unroll
    for (int c = 0; c < R; ++c) acc[c] = 0.0f;
    const int rot = rot_of(e, t, n);
    if (f8) {
      for (int u = u0; u < u1; ++u, ++i) {
        const int st = i % S, ku = (u + rot) % n;
        const char* stage = base + L.ring + st * kStage;
        tma::mbar_wait(tma::smem_u32(full + st), (i / S) & 1);
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
      }
    }
    if (MX) {
      const int slot = jj & 1;
      tma::mbar_wait(tma::smem_u32(sfull + slot), (jj >> 1) & 1);
      if (!f8) {
        // this thread's rows of the stage: Ra = 64 wg + rg and Ra + 8 (both have row & 7 == g)
        const int Ra = wg * 64 + rg;
        const char* sca = base + L.sc + slot * 128 * L.ss + Ra * L.ss;
        const char* scb = sca + 8 * L.ss;
        // Stage u: chunks 2 ku (q0) and 2 ku + 1 (q1; with K / 128 odd, the last stage's second
        // chunk is TMA's zero fill against token chunk 0 and is not promoted). The previous
        // stage's two chunks (p0, p1, waited) are promoted while this stage's eight wgmmas run;
        // every stage ends with wait 0 (a wgmma in flight across the loop's back edge makes
        // ptxas serialise them), so two register sets alternate: the loop is unrolled by two.
        float A0[4][R], A1[4][R], B0[4][R], B1[4][R];
        int kcp = 0;
        uint32_t spa0 = 0, spb0 = 0, spa1 = 0, spb1 = 0;
        auto promote_prev = [&](float (&p0)[4][R], float (&p1)[4][R]) {
          mx_promote(acc, p0, spa0, spb0, sXS, kcp, t4);
          if (kcp + 1 < KB) mx_promote(acc, p1, spa1, spb1, sXS, kcp + 1, t4);
        };
        int st = i % S, ph = (i / S) & 1, ku = (u0 + rot) % n;  // ring slot, its phase, the stage's chunk pair
        const uint64_t dx0 = gemm::smem_desc(tma::smem_u32(sX));  // token chunk kc: + kc * kBT * 128 / 16
        auto stage = [&](float (&q0)[4][R], float (&q1)[4][R], float (&p0)[4][R], float (&p1)[4][R], bool first) {
          const char* ra = base + L.ring + st * kStage + Ra * 128 + 4 * t4;
          tma::mbar_wait(tma::smem_u32(full + st), ph);
          uint32_t wa[8], wb[8];
#pragma unroll
          for (int G = 0; G < 8; ++G) {  // 128-byte swizzle: group G of row r at 16-byte unit G ^ (r & 7)
            wa[G] = *reinterpret_cast<const uint32_t*>(ra + ((G ^ g) << 4));
            wb[G] = *reinterpret_cast<const uint32_t*>(ra + 8 * 128 + ((G ^ g) << 4));
          }
          __syncwarp();
          if (lane == 0) tma::mbar_arrive(tma::smem_u32(empty + st));
          ++i;
          if (++st == S) st = 0, ph ^= 1;
          const int kc = 2 * ku;
          const bool two = kc + 1 < KB;
          mx_chunk_mma(q0, wa, wb, 0, dx0 + kc * (kBT * 128 / 16));
          mx_chunk_mma(q1, wa, wb, 1, dx0 + (two ? kc + 1 : 0) * (kBT * 128 / 16));
          if (!first) promote_prev(p0, p1);
          kcp = kc;
          spa0 = *reinterpret_cast<const uint32_t*>(sca + 8 * ku);
          spb0 = *reinterpret_cast<const uint32_t*>(scb + 8 * ku);
          spa1 = two ? *reinterpret_cast<const uint32_t*>(sca + 8 * ku + 4) : 0u;
          spb1 = two ? *reinterpret_cast<const uint32_t*>(scb + 8 * ku + 4) : 0u;
          if (++ku == n) ku = 0;
          gemm::wgmma_wait0();
        };
        stage(A0, A1, B0, B1, true);
        const int m = u1 - u0;
        int u = 1;
        for (; u + 1 < m; u += 2) {
          stage(B0, B1, A0, A1, false);
          stage(A0, A1, B0, B1, false);
        }
        if (u < m) {
          stage(B0, B1, A0, A1, false);
          promote_prev(B0, B1);
        } else {
          promote_prev(A0, A1);
        }
      }
      __syncwarp();
      if (lane == 0) tma::mbar_arrive(tma::smem_u32(sempty + slot));
    }

    // A split tile (balance): its first stages were this CTA's last piece (head) or its last stages
    // this CTA's first piece (tail). Both sides store their partial sums, the second to arrive adds
    // the other's (a sum of two: the same either way round) and runs the epilogue.
    if (u0 > 0 || u1 < n) {
      const bool head = u0 == 0;
      const int bd = head ? blockIdx.x : blockIdx.x - 1;
      float* side = a.bpart + static_cast<int64_t>(bd) * 2 * kConsumers * R;
      float4* mine = reinterpret_cast<float4*>(side + ((head ? 0 : 1) * kConsumers + tid) * R);
      const float4* other = reinterpret_cast<const float4*>(side + ((head ? 1 : 0) * kConsumers + tid) * R);
#pragma unroll
      for (int c = 0; c < R / 4; ++c) mine[c] = make_float4(acc[4 * c], acc[4 * c + 1], acc[4 * c + 2], acc[4 * c + 3]);
      __threadfence();
      tma::named_bar(kBarAll, kConsumers);
      if (tid == 0) {
        *sflag = atomicAdd(a.bcnt + bd, 1);
        __threadfence();
      }
      tma::named_bar(kBarAll, kConsumers);
      if (*sflag == 0) continue;  // the neighbour finishes the tile
#pragma unroll
      for (int c = 0; c < R / 4; ++c) {
        const float4 o = __ldcg(other + c);
        acc[4 * c] += o.x, acc[4 * c + 1] += o.y, acc[4 * c + 2] += o.z, acc[4 * c + 3] += o.w;
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
  cfg.blockDim = dim3(threads_of(MX), 1, 1);
  cfg.dynamicSmemBytes = layout(MX, a.K, a.stages).total;
  cfg.stream = stream;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = no_pdl ? 0 : 1;
  check_cuda(cudaLaunchKernelEx(&cfg, kern, a, maps), "moe_stream_kernel");
}

// Maps of one projection (128-byte swizzled boxes): routed [E * N, Kb] (fp8 / packed mxfp4) and shared [N, K].
bool encode_pair(const MoeProblem& p, const ExpertWeight& w, const ExpertWeight& sw, int N, int K, int box_rows,
                 CUtensorMap& m, CUtensorMap& sm) {
  const bool mx = p.fmt == WeightFmt::kMxfp4;
  if (!tma::encode_u8_2d(m, w.w, static_cast<int64_t>(p.E) * N, mx ? K / 2 : K, 128, box_rows, true)) return false;
  if (p.has_shared) return tma::encode_u8_2d(sm, sw.w, N, K, 128, box_rows, true);
  sm = m;  // unused (no task has expert E)
  return true;
}

}  // namespace

int64_t moe_stream_part_floats(int nbd) { return 2LL * nbd * 2 * kConsumers * (kBT / 2); }

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
  const int sms = std::min(num_sms(), io.nbd > 0 ? io.nbd : num_sms());  // balance: a boundary slot per CTA
  // mxfp4 group scales: rows of K/32 bytes copied 16 (or 4) bytes at a time need that alignment
  auto aligned = [&](int a, int K) {
    return (K / 32) % a == 0 && reinterpret_cast<uintptr_t>(p.w1.scale) % a == 0 &&
           reinterpret_cast<uintptr_t>(p.w3.scale) % a == 0 && reinterpret_cast<uintptr_t>(p.w2.scale) % a == 0;
  };
  if (mx && (!aligned(4, p.d) || !aligned(4, p.inter))) return false;

  Args a1{};
  a1.a = io.x, a1.a_rows = io.rows, a1.K = p.d, a1.N = p.inter, a1.E = p.E, a1.KB = ceil_div(p.d, 128);
  a1.scale0 = p.w1.scale, a1.scale1 = p.w3.scale, a1.scale_u8 = p.w1.scale_u8;
  a1.sscale0 = p.sw1.scale, a1.sscale1 = p.sw3.scale, a1.sscale_u8 = p.sw1.scale_u8;
  a1.sc16 = mx && aligned(16, p.d);
  a1.tasks = io.tasks, a1.ntasks = io.ntasks, a1.ntiles = ceil_div(p.inter, 64), a1.stages = st1;
  a1.out = io.h, a1.limit = p.limit;
  const bool balance = p.T <= p.stream_balance_max_t && io.bcnt != nullptr;
  const int sh_tasks = p.has_shared ? ceil_div(p.T, kBT) : 0;
  a1.sh_tasks = sh_tasks, a1.balance = balance, a1.bcnt = io.bcnt, a1.bpart = io.bpart;
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
  a2.sc16 = mx && aligned(16, p.inter);
  a2.tasks = io.tasks, a2.ntasks = io.ntasks, a2.ntiles = ceil_div(p.d, 128), a2.stages = st2;
  a2.out = io.Y, a2.row_weight = io.wrow;
  a2.sh_tasks = sh_tasks, a2.balance = balance;
  a2.bcnt = io.bcnt + (balance ? io.nbd : 0), a2.bpart = io.bpart + (balance ? moe_stream_part_floats(io.nbd) / 2 : 0);
  const int g2 = static_cast<int>(std::min<int64_t>(sms, io.U * a2.ntiles));
  if (mx) launch<true, false, __nv_bfloat16>(a2, m2, g2, stream);
  else launch<false, false, __nv_bfloat16>(a2, m2, g2, stream);
  return true;
}

}  // namespace deepfuse
