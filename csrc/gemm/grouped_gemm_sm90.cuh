// Grouped expert GEMM for sm90: wgmma (m64nNk32, e4m3 x e4m3 -> f32, both operands in
// shared memory, 128-byte swizzled K-major tiles) over a multi-stage cp.async pipeline.
// (mma.sync's e4m3 form is not native on sm90: it runs through an f16 conversion.)
//
// Swapped operands: the weights are wgmma's M side (64 rows per warpgroup) and the task's
// tokens its N side (BT per CTA), so a decode task of one token wastes no weight reads.
// One CTA computes 64 * WG weight rows x BT tokens of one task (an expert's run of <= BT
// sorted pair positions):
//   SWIGLU (GEMM1): in each warp's 16 rows, rows 0-7 are w1 rows i.. and rows 8-15 the w3 rows
//                   of the same i, so every thread holds gate and up of the same (i, token);
//                   the epilogue writes h = silu(min(g, L)) * clamp(u, -L, L) as bf16 [P, inter].
//   plain (GEMM2):  w2 rows; the epilogue writes acc * routing weight as fp32 [P, d].
// Activations are FP8 with one fp32 scale per token per 128 of K (deepfuse's activation cast).
//   fp8   128 x 128 weight block scales: a 128-K chunk's four wgmmas accumulate apart, then
//         are scaled once into the fp32 accumulator (DeepGEMM's promotion).
//   mxfp4 e2m1 decoded to e4m3 in shared memory (e4m3 bits (m << 2 | s << 7) hold the e2m1
//         value times 2^-6, exactly, subnormals included); each k32 wgmma is one MX group, so
//         its partial sum takes that group's per-row UE8M0 scale (times 2^6).
// Rows are summed in a fixed order whatever tile they land in, so results do not depend on
// the routing plan's placement (atomics there are harmless).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/arch.h"
#include "common/cuda_utils.h"
#include "common/fp8_utils.cuh"
#include "gemm/wgmma_e4m3.cuh"

namespace deepfuse::gemm {

struct GemmOperand {        // one expert-stacked projection
  const uint8_t* w;         // [E, N, Kb]
  const void* scale;        // fp8: [E, ceil(N/128), ceil(K/128)]; mxfp4: uint8 [E, N, K/32]
  bool scale_u8;
};

struct GemmArgs {
  const uint8_t* a;         // fp8 [*, K]
  const float* a_scale;     // fp32 [*, ceil(K/128)]
  const int* a_rows;        // position -> A row; null: the position itself
  int K, N, E;
  GemmOperand b0, b1;       // routed: w1 / w3 (SWIGLU) or w2
  GemmOperand sb0, sb1;     // shared expert (task expert == E), always fp8
  const int* tasks;         // [U, 3]: expert, first row, end row (positions); null: a dense
                            // linear (expert 0, rows blockIdx.y * BT .., M of them)
  const int* ntasks;
  int M;                    // rows of a dense linear
  int ksplit;               // dense linear: K split over blockIdx.z (fp32 partials [ksplit, M, N])
  int groups;               // > 0: block-diagonal linear, group e = blockIdx.z owns weight rows
                            // [e N, (e + 1) N) and reads / writes rows p * groups + e
  void* out;                // SWIGLU: bf16 [P, N]; plain: fp32 [P, N] (bf16 if out_bf16)
  bool out_bf16;
  const float* row_weight;  // plain: [P] or null (1)
  float limit;
};

constexpr int kMaxKChunks = 128;  // K <= 16384

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {  // keep reads after wgmma_wait0
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

template <int BT>
__device__ __forceinline__ void wgmma_tile(float (&d)[BT / 2], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (BT == 16) wgmma_m64n16k32(d, da, db, scale_d);
  else if constexpr (BT == 32) wgmma_m64n32k32(d, da, db, scale_d);
  else if constexpr (BT == 64) wgmma_m64n64k32(d, da, db, scale_d);
  else wgmma_m64n128k32(d, da, db, scale_d);
}

__device__ __forceinline__ float ue8m0_value(uint32_t b) { return exp2i(static_cast<int>(b) - 127); }

// Eight packed e2m1 (one 32-bit word, element 2i in the low nibble of byte i) -> eight e4m3
// bytes in element order, each the e2m1 value times 2^-6.
__device__ __forceinline__ uint2 e2m1x8_to_e4m3(uint32_t x) {
  const uint32_t lo = ((x << 2) & 0x1C1C1C1Cu) | ((x << 4) & 0x80808080u);  // elements 0, 2, 4, 6
  const uint32_t hi = ((x >> 2) & 0x1C1C1C1Cu) | (x & 0x80808080u);         // elements 1, 3, 5, 7
  return make_uint2(__byte_perm(lo, hi, 0x5140), __byte_perm(lo, hi, 0x7362));
}

template <int BT_, int WG_, int STAGES_, bool MXL_, int KCH_ = 1>
struct GemmCfg {  // MXL: the shared-memory layout has the mxfp4 staging areas; KCH: 128-K chunks per stage
  static constexpr int BT = BT_, WG = WG_, STAGES = STAGES_, KCH = KCH_;
  static constexpr bool MXL = MXL_;
  static constexpr int kThreads = WG * 128;
  static constexpr int ROWS = 64 * WG;  // weight rows per CTA
  static constexpr int IPT = 32 * WG;   // SwiGLU: intermediate columns per CTA
  static_assert(BT == 16 || BT == 32 || BT == 64 || BT == 128, "wgmma N");
  static_assert(128 % ROWS == 0 || ROWS == 128, "a tile stays inside one 128-row scale block");
  // per stage, 1024-aligned: weight tile, token tile; then per stage: token scales, mxfp4
  // packed weights and group scales; then the rows and the fp8 block scales.
  static constexpr int kW1 = ROWS * 128, kX1 = BT * 128;  // one 128-K chunk
  static constexpr int kW = KCH * kW1, kX = KCH * kX1, kStage = kW + kX;
  static constexpr int kAS = KCH * BT * 4, kPK = KCH * ROWS * 64, kSC = KCH * ROWS * 4;
  static constexpr int kAux = kAS + (MXL ? kPK + kSC : 0);
  static constexpr int kSmem = 1024 + STAGES * (kStage + kAux) + BT * 4 + 2 * kMaxKChunks * 4;
};

template <class C>
struct Smem {
  char* base;
  __device__ char* W(int st) const { return base + st * C::kStage; }
  __device__ char* X(int st) const { return base + st * C::kStage + C::kW; }
  __device__ char* aux(int st) const { return base + C::STAGES * C::kStage + st * C::kAux; }
  __device__ float* AS(int st) const { return reinterpret_cast<float*>(aux(st)); }
  __device__ uint8_t* PK(int st) const { return reinterpret_cast<uint8_t*>(aux(st) + C::kAS); }
  __device__ uint8_t* SC(int st) const { return reinterpret_cast<uint8_t*>(aux(st) + C::kAS + C::kPK); }
  __device__ int* rows() const { return reinterpret_cast<int*>(base + C::STAGES * (C::kStage + C::kAux)); }
  __device__ float* ws() const { return reinterpret_cast<float*>(base + C::STAGES * (C::kStage + C::kAux) + C::BT * 4); }
};

// Tile row R's weight row (and which matrix): see the header comment.
template <class C, bool SWIGLU>
__device__ __forceinline__ int weight_row(int R, int col0, bool& up) {
  if (SWIGLU) {
    const int wg = R >> 6, r = R & 63;
    up = (r & 15) >= 8;
    return col0 + wg * 32 + (r >> 4) * 8 + (r & 7);
  }
  up = false;
  return col0 + R;
}

// acc += part * (row scale x token scale): rows rg (w0) and rg + 8 (w1), token pairs sa.
template <int BT>
__device__ __forceinline__ void promote(float (&acc)[BT / 2], const float (&part)[BT / 2], float w0, float w1,
                                        const float (&sa)[BT / 8][2]) {
#pragma unroll
  for (int c8 = 0; c8 < BT / 8; ++c8) {
    acc[4 * c8 + 0] += part[4 * c8 + 0] * (w0 * sa[c8][0]);
    acc[4 * c8 + 1] += part[4 * c8 + 1] * (w0 * sa[c8][1]);
    acc[4 * c8 + 2] += part[4 * c8 + 2] * (w1 * sa[c8][0]);
    acc[4 * c8 + 3] += part[4 * c8 + 3] * (w1 * sa[c8][1]);
  }
}

template <class C, bool MX, bool SWIGLU>
__device__ __forceinline__ void gemm_mainloop(const GemmArgs& args, const GemmOperand& b0, const GemmOperand& b1,
                                              int e, int col0, const Smem<C>& sm, float (&acc)[C::BT / 2]) {
  static_assert(!MX || C::MXL, "the mxfp4 path needs the mxfp4 shared-memory layout");
  constexpr int R = C::BT / 2;
  const int tid = threadIdx.x, lane = tid % 32, wg = tid / 128, wq = (tid / 32) % 4;
  const int K = args.K, N = args.N, KB = (K + 127) / 128;
  const int64_t kbytes = MX ? K / 2 : K;
  const int* s_rows = sm.rows();
  float* s_ws = sm.ws();

  if (!MX) {  // the CTA's 128 x 128 weight block scales over all of K (gate, up)
    const int NB = (N + 127) / 128, nb = col0 / 128;
    for (int i = tid; i < (SWIGLU ? 2 : 1) * KB; i += C::kThreads) {
      const GemmOperand& op = (i >= KB) ? b1 : b0;
      const int kb = i % KB;
      const int64_t off = (static_cast<int64_t>(e) * NB + nb) * KB + kb;
      s_ws[(i >= KB) * kMaxKChunks + kb] =
          op.scale_u8 ? ue8m0_value(static_cast<const uint8_t*>(op.scale)[off]) : static_cast<const float*>(op.scale)[off];
    }
  }

  // stage st holds chunks kb0 .. kb0 + KCH - 1 (each a swizzled [ROWS x 128] / [BT x 128] tile)
  auto load = [&](int st, int kb0) {
#pragma unroll
    for (int c = 0; c < C::KCH; ++c) {
      const int kb = kb0 + c;
      const bool kin = kb < KB;
      char* sW = sm.W(st) + c * C::kW1;
      char* sX = sm.X(st) + c * C::kX1;
      for (int q = tid; q < C::BT * 8; q += C::kThreads) {
        const int r = q >> 3, ch = q & 7, row = s_rows[r];
        const int kbyte = kb * 128 + ch * 16;
        const bool ok = row >= 0 && kbyte < K;
        cp_async16(sX + r * 128 + ((ch ^ (r & 7)) << 4), ok ? args.a + static_cast<int64_t>(row) * K + kbyte : args.a,
                   ok);
      }
      for (int r = tid; r < C::BT; r += C::kThreads) {
        const int row = s_rows[r];
        const bool ok = row >= 0 && kin;
        cp_async4(sm.AS(st) + c * C::BT + r, ok ? args.a_scale + static_cast<int64_t>(row) * KB + kb : args.a_scale, ok);
      }
      if (!MX) {
        for (int q = tid; q < C::ROWS * 8; q += C::kThreads) {
          const int r = q >> 3, ch = q & 7;
          bool up;
          const int wr = weight_row<C, SWIGLU>(r, col0, up);
          const uint8_t* base = up ? b1.w : b0.w;
          const int kbyte = kb * 128 + ch * 16;
          const bool ok = wr < N && kbyte < K;
          const uint8_t* src = base + (static_cast<int64_t>(e) * N + wr) * kbytes + kbyte;
          cp_async16(sW + r * 128 + ((ch ^ (r & 7)) << 4), ok ? src : base, ok);
        }
      } else {
        uint8_t* pk = sm.PK(st) + c * C::ROWS * 64;
        for (int q = tid; q < C::ROWS * 4; q += C::kThreads) {
          const int r = q >> 2, ch = q & 3;
          bool up;
          const int wr = weight_row<C, SWIGLU>(r, col0, up);
          const uint8_t* base = up ? b1.w : b0.w;
          const bool ok = wr < N && kin;
          const uint8_t* src = base + (static_cast<int64_t>(e) * N + wr) * kbytes + kb * 64 + ch * 16;
          cp_async16(pk + r * 64 + ch * 16, ok ? src : base, ok);
        }
        for (int r = tid; r < C::ROWS; r += C::kThreads) {
          bool up;
          const int wr = weight_row<C, SWIGLU>(r, col0, up);
          const uint8_t* sc = static_cast<const uint8_t*>(up ? b1.scale : b0.scale);
          const bool ok = wr < N && kin;
          cp_async4(sm.SC(st) + (c * C::ROWS + r) * 4,
                    ok ? sc + (static_cast<int64_t>(e) * N + wr) * (K / 32) + kb * 4 : sc, ok);
        }
      }
    }
  };

  // Stages are walked from a start that depends on the n-tile and the expert (never on the
  // task, so a row's summation order does not depend on the plan): CTAs in flight together
  // then read different columns of their rows instead of all hitting the same DRAM channels.
  // split K (dense linears): this CTA takes stages [s_lo, s_lo + NS) of K
  const int NS_all = (KB + C::KCH - 1) / C::KCH;
  const int per = (NS_all + args.ksplit - 1) / args.ksplit;
  const int s_lo = (args.ksplit > 1 ? static_cast<int>(blockIdx.z) : 0) * per;
  const int NS = max(0, min(NS_all, s_lo + per) - s_lo);
  const int rot = NS ? (blockIdx.x * 5 + e * 11) % NS : 0;
#pragma unroll
  for (int s = 0; s < C::STAGES - 1; ++s) {
    if (s < NS) load(s, (s_lo + (s + rot) % NS) * C::KCH);
    cp_async_commit();
  }
  const int g = lane >> 2, t4 = lane & 3;
  const int rg = wg * 64 + wq * 16 + g;  // this thread's tile rows rg, rg + 8
  float part[R];
  for (int it = 0; it < NS; ++it) {
    const int kb0 = (s_lo + (it + rot) % NS) * C::KCH;
    cp_async_wait<C::STAGES - 2>();
    fence_proxy_async();
    __syncthreads();
    // the next stage's loads are issued after this stage's first wgmmas (fp8), so that their
    // address math overlaps the tensor cores; the stage they overwrite was consumed (waited)
    // before the barrier above
    auto issue_next = [&] {
      if (it + C::STAGES - 1 < NS)
        load((it + C::STAGES - 1) % C::STAGES, (s_lo + (it + C::STAGES - 1 + rot) % NS) * C::KCH);
      cp_async_commit();
    };
    const int st = it % C::STAGES;
    if (MX) issue_next();
    if (MX) {  // packed e2m1 -> swizzled e4m3 tiles
      for (int q = tid; q < C::KCH * C::ROWS * 4; q += C::kThreads) {
        const int c = q / (C::ROWS * 4), n = (q >> 2) % C::ROWS, qq = q & 3;
        const uint4 v = *reinterpret_cast<const uint4*>(sm.PK(st) + (c * C::ROWS + n) * 64 + qq * 16);
        char* sW = sm.W(st) + c * C::kW1;
        const uint2 o0 = e2m1x8_to_e4m3(v.x), o1 = e2m1x8_to_e4m3(v.y);
        const uint2 o2 = e2m1x8_to_e4m3(v.z), o3 = e2m1x8_to_e4m3(v.w);
        *reinterpret_cast<uint4*>(sW + n * 128 + (((2 * qq) ^ (n & 7)) << 4)) = make_uint4(o0.x, o0.y, o1.x, o1.y);
        *reinterpret_cast<uint4*>(sW + n * 128 + (((2 * qq + 1) ^ (n & 7)) << 4)) = make_uint4(o2.x, o2.y, o3.x, o3.y);
      }
      fence_proxy_async();
      __syncthreads();
    }
#pragma unroll
    for (int c = 0; c < C::KCH; ++c) {
      const int kb = kb0 + c;
      if (kb >= KB) break;
      const uint32_t wa = smem_u32(sm.W(st) + c * C::kW1) + wg * 64 * 128, xa = smem_u32(sm.X(st) + c * C::kX1);
      const float* sAS = sm.AS(st) + c * C::BT;
      float sa[C::BT / 8][2];
#pragma unroll
      for (int c8 = 0; c8 < C::BT / 8; ++c8) {
        sa[c8][0] = sAS[c8 * 8 + 2 * t4];
        sa[c8][1] = sAS[c8 * 8 + 2 * t4 + 1];
      }
      if (!MX) {
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) wgmma_tile<C::BT>(part, smem_desc(wa + j * 32), smem_desc(xa + j * 32), j);
        wgmma_commit();
        if (c == 0) issue_next();
        wgmma_wait0();
        fence_regs(part);
        const float w0 = s_ws[kb], w1 = s_ws[(SWIGLU ? kMaxKChunks : 0) + kb];  // rows rg (gate), rg + 8 (up)
        promote<C::BT>(acc, part, w0, w1, sa);
      } else {
        const uint8_t* sc = sm.SC(st) + c * C::ROWS * 4;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          wgmma_fence();
          wgmma_tile<C::BT>(part, smem_desc(wa + j * 32), smem_desc(xa + j * 32), 0);
          wgmma_commit();
          wgmma_wait0();
          fence_regs(part);
          const float w0 = ue8m0_value(sc[rg * 4 + j]) * 64.0f, w1 = ue8m0_value(sc[(rg + 8) * 4 + j]) * 64.0f;
          promote<C::BT>(acc, part, w0, w1, sa);
        }
      }
    }
  }
  cp_async_wait<0>();
}

__device__ __forceinline__ float swiglu_f(float gt, float up, float limit) {
  if (limit > 0.0f) {
    gt = fminf(gt, limit);
    up = fminf(fmaxf(up, -limit), limit);
  }
  return gt / (1.0f + expf(-gt)) * up;
}

template <class C, bool MX, bool SWIGLU>
__global__ void __launch_bounds__(C::kThreads) grouped_gemm_kernel(const GemmArgs args) {
#if DEEPFUSE_SM90A_DEVICE
  const int task = blockIdx.y;
  int e = args.groups > 0 ? static_cast<int>(blockIdx.z) : 0, r0 = task * C::BT, r1 = min(args.M, r0 + C::BT);
  if (args.tasks != nullptr) {
    if (task >= *args.ntasks) return;
    e = args.tasks[task * 3], r0 = args.tasks[task * 3 + 1], r1 = args.tasks[task * 3 + 2];
  }
  extern __shared__ char smem_raw[];
  const Smem<C> sm{reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023))};
  const int col0 = blockIdx.x * (SWIGLU ? C::IPT : C::ROWS);
  int* s_rows = sm.rows();
  for (int r = threadIdx.x; r < C::BT; r += C::kThreads) {
    const int p = r0 + r;
    s_rows[r] = p >= r1 ? -1 : args.groups > 0 ? p * args.groups + e : (args.a_rows != nullptr ? args.a_rows[p] : p);
  }
  __syncthreads();

  float acc[C::BT / 2];
#pragma unroll
  for (int i = 0; i < C::BT / 2; ++i) acc[i] = 0.0f;
  if (e == args.E)
    gemm_mainloop<C, false, SWIGLU>(args, args.sb0, args.sb1, 0, col0, sm, acc);
  else
    gemm_mainloop<C, MX, SWIGLU>(args, args.b0, args.b1, e, col0, sm, acc);

  const int lane = threadIdx.x % 32, wg = threadIdx.x / 128, wq = (threadIdx.x / 32) % 4;
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int c8 = 0; c8 < C::BT / 8; ++c8)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int p = r0 + c8 * 8 + 2 * t4 + b;
      if (p >= r1) continue;
      if (SWIGLU) {
        const int i = col0 + wg * 32 + wq * 8 + g;
        if (i < args.N)
          static_cast<__nv_bfloat16*>(args.out)[static_cast<int64_t>(p) * args.N + i] =
              __float2bfloat16_rn(swiglu_f(acc[4 * c8 + b], acc[4 * c8 + 2 + b], args.limit));
      } else {
        const int n = col0 + wg * 64 + wq * 16 + g;
        const float w = args.row_weight != nullptr ? args.row_weight[p] : 1.0f;
        const int64_t o = (args.groups > 0 ? static_cast<int64_t>(p) * args.groups + e
                                            : static_cast<int64_t>(blockIdx.z) * args.M + p) * args.N;
        if (args.out_bf16) {
          __nv_bfloat16* out = static_cast<__nv_bfloat16*>(args.out) + o;
          if (n < args.N) out[n] = __float2bfloat16_rn(acc[4 * c8 + b] * w);
          if (n + 8 < args.N) out[n + 8] = __float2bfloat16_rn(acc[4 * c8 + 2 + b] * w);
        } else {
          float* out = static_cast<float*>(args.out) + o;
          if (n < args.N) out[n] = acc[4 * c8 + b] * w;
          if (n + 8 < args.N) out[n + 8] = acc[4 * c8 + 2 + b] * w;
        }
      }
    }
#else
  __trap();  // wgmma is sm_90a only; launchers refuse other archs (require_sm90a)
#endif
}

// Host: launch with the kernel's dynamic shared memory enabled (once per instantiation and
// translation unit: each .cu including this header has its own copy of the kernel, so the
// launcher and its once-flag have internal linkage; a shared inline one would set the
// attribute on one unit's copy only).
template <class C, bool MX, bool SWIGLU>
static inline void launch_grouped_gemm(const GemmArgs& args, dim3 grid, cudaStream_t stream, const char* what) {
  auto kern = grouped_gemm_kernel<C, MX, SWIGLU>;
  static const cudaError_t attr = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
  check_cuda(attr, "cudaFuncSetAttribute(grouped_gemm_kernel)");
  kern<<<grid, C::kThreads, C::kSmem, stream>>>(args);
  check_launch(what);
}

}  // namespace deepfuse::gemm
