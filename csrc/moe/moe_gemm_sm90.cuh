// Grouped expert GEMM for sm90: FP8 e4m3 mma.sync (m16n8k32) over a cp.async pipeline.
//
// One CTA computes a BM x BN tile of one task (an expert's run of up to BM sorted rows):
//   SWIGLU (GEMM1): tile columns [0, BN/2) are w1 rows col0.., [BN/2, BN) w3 rows col0..;
//                   the epilogue writes h = silu(min(g, L)) * clamp(u, -L, L) as bf16 [P, inter].
//   plain (GEMM2):  tile columns are w2 rows col0..; the epilogue writes acc * row weight as fp32.
// A is FP8 with one fp32 scale per row per 128 of K (deepfuse's activation cast). Weights:
//   fp8   128 x 128 block scales: a 128-K chunk's four MMAs accumulate apart, then scale once.
//   mxfp4 e2m1 decoded to e4m3 in shared memory (e4m3 bits (m << 2 | s << 7) hold the e2m1
//         value times 2^-6, exactly, subnormals included); each k32 MMA is one MX group, so
//         its partial sum takes that group's UE8M0 scale (times 2^6).
// Rows are summed in a fixed order whatever tile they land in, so results do not depend on
// the routing plan's placement (atomics there are harmless).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace deepfuse::moe {

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
  const int* tasks;         // [U, 3]: expert, first row, end row (positions)
  const int* ntasks;
  void* out;                // SWIGLU: bf16 [P, N]; plain: fp32 [P, N]
  const float* row_weight;  // plain: [P]
  float limit;
};

constexpr int kMaxKChunks = 64;  // K <= 8192

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

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void mma_e4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float ue8m0_value(uint32_t b) {
  return b ? __uint_as_float(b << 23) : __uint_as_float(0x00400000u);  // 2^(b-127)
}

// Eight packed e2m1 (one 32-bit word, element 2i in the low nibble of byte i) -> eight e4m3
// bytes in element order, each the e2m1 value times 2^-6.
__device__ __forceinline__ uint2 e2m1x8_to_e4m3(uint32_t x) {
  const uint32_t lo = ((x << 2) & 0x1C1C1C1Cu) | ((x << 4) & 0x80808080u);  // elements 0, 2, 4, 6
  const uint32_t hi = ((x >> 2) & 0x1C1C1C1Cu) | (x & 0x80808080u);         // elements 1, 3, 5, 7
  return make_uint2(__byte_perm(lo, hi, 0x5140), __byte_perm(lo, hi, 0x7362));
}

template <int BM_, int BN_, int WM_, int WN_, int STAGES_>
struct GemmCfg {
  static constexpr int BM = BM_, BN = BN_, WM = WM_, WN = WN_, STAGES = STAGES_;
  static constexpr int kThreads = WM * WN * 32;
  static constexpr int WTM = BM / WM, WTN = BN / WN;
  static constexpr int MI = WTM / 16, NI = WTN / 8, HALF = NI / 2;
  static_assert(WTM % 16 == 0 && WTN % 16 == 0 && BN <= 128 && 128 % BN == 0, "tile shape");
  // per stage: A tile, B region (fp8 tile, or mxfp4 packed tile + group scales), A scales
  static constexpr int kA = BM * 128, kB = BN * 128, kAS = BM * 4;
  static constexpr int kStage = kA + kB + kAS;
  // + converted mxfp4 tile, rows, weight block scales (2 x kMaxKChunks)
  static constexpr int kSmem = STAGES * kStage + kB + BM * 4 + 2 * kMaxKChunks * 4;
};

// Column (within the CTA tile) of warp column wn's n8 subtile `sub`: the first HALF subtiles
// in the tile's first half, the rest at the same offsets in the second half (SwiGLU pairs).
template <class C>
__device__ __forceinline__ int tile_col(int wn, int sub) {
  return sub < C::HALF ? wn * C::HALF * 8 + sub * 8 : C::BN / 2 + wn * C::HALF * 8 + (sub - C::HALF) * 8;
}

template <class C, bool MX, bool SWIGLU>
__device__ __forceinline__ void gemm_mainloop(const GemmArgs& args, const GemmOperand& b0, const GemmOperand& b1,
                                              int e, int col0, char* smem, float (&acc)[C::MI][C::NI][4]) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp / C::WN, wn = warp % C::WN;
  const int K = args.K, N = args.N, KB = (K + 127) / 128;
  const int* s_rows = reinterpret_cast<const int*>(smem + C::STAGES * C::kStage + C::kB);
  float* s_ws = reinterpret_cast<float*>(smem + C::STAGES * C::kStage + C::kB + C::BM * 4);
  uint8_t* s_cb = reinterpret_cast<uint8_t*>(smem + C::STAGES * C::kStage);
  const int64_t kbytes = MX ? K / 2 : K;

  // the tile row n's weight row and matrix
  auto wrow = [&](int n, const uint8_t*& base) -> int {
    if (SWIGLU) {
      const bool up = n >= C::BN / 2;
      base = (up ? b1.w : b0.w);
      return col0 + (up ? n - C::BN / 2 : n);
    }
    base = b0.w;
    return col0 + n;
  };

  if (!MX) {  // this tile's 128 x 128 weight block scales over all of K
    const int NB = (N + 127) / 128, nb = col0 / 128;
    for (int i = tid; i < (SWIGLU ? 2 : 1) * KB; i += C::kThreads) {
      const GemmOperand& op = (i >= KB) ? b1 : b0;
      const int kb = i % KB;
      const int64_t off = (static_cast<int64_t>(e) * NB + nb) * KB + kb;
      s_ws[(i >= KB) * kMaxKChunks + kb] =
          op.scale_u8 ? ue8m0_value(static_cast<const uint8_t*>(op.scale)[off]) : static_cast<const float*>(op.scale)[off];
    }
  }

  auto load = [&](int st, int kb) {
    char* sA = smem + st * C::kStage;
    char* sB = sA + C::kA;
    float* sAS = reinterpret_cast<float*>(sB + C::kB);
    for (int c = tid; c < C::BM * 8; c += C::kThreads) {
      const int r = c >> 3, ch = c & 7, row = s_rows[r];
      const int kbyte = kb * 128 + ch * 16;
      const bool ok = row >= 0 && kbyte < K;
      cp_async16(sA + r * 128 + ((ch ^ (r & 7)) << 4), ok ? args.a + static_cast<int64_t>(row) * K + kbyte : args.a, ok);
    }
    for (int r = tid; r < C::BM; r += C::kThreads) {
      const int row = s_rows[r];
      cp_async4(sAS + r, row >= 0 ? args.a_scale + static_cast<int64_t>(row) * KB + kb : args.a_scale, row >= 0);
    }
    if (!MX) {
      for (int c = tid; c < C::BN * 8; c += C::kThreads) {
        const int n = c >> 3, ch = c & 7;
        const uint8_t* base;
        const int wr = wrow(n, base);
        const int kbyte = kb * 128 + ch * 16;
        const bool ok = wr < N && kbyte < K;
        const uint8_t* src = base + (static_cast<int64_t>(e) * N + wr) * kbytes + kbyte;
        cp_async16(sB + n * 128 + ((ch ^ (n & 7)) << 4), ok ? src : base, ok);
      }
    } else {
      for (int c = tid; c < C::BN * 4; c += C::kThreads) {
        const int n = c >> 2, ch = c & 3;
        const uint8_t* base;
        const int wr = wrow(n, base);
        const bool ok = wr < N;
        const uint8_t* src = base + (static_cast<int64_t>(e) * N + wr) * kbytes + kb * 64 + ch * 16;
        cp_async16(sB + n * 64 + ch * 16, ok ? src : base, ok);
      }
      for (int n = tid; n < C::BN; n += C::kThreads) {
        const uint8_t* base;
        const int wr = wrow(n, base);
        const bool ok = wr < N;
        const uint8_t* sc = static_cast<const uint8_t*>(SWIGLU && n >= C::BN / 2 ? b1.scale : b0.scale);
        cp_async4(sB + C::BN * 64 + n * 4, ok ? sc + (static_cast<int64_t>(e) * N + wr) * (K / 32) + kb * 4 : sc, ok);
      }
    }
  };

#pragma unroll
  for (int s = 0; s < C::STAGES - 1; ++s) {
    if (s < KB) load(s, s);
    cp_async_commit();
  }
  const int g = lane >> 2, t4 = lane & 3;
  for (int kb = 0; kb < KB; ++kb) {
    cp_async_wait<C::STAGES - 2>();
    __syncthreads();
    if (kb + C::STAGES - 1 < KB) load((kb + C::STAGES - 1) % C::STAGES, kb + C::STAGES - 1);
    cp_async_commit();
    const int st = kb % C::STAGES;
    const char* sA = smem + st * C::kStage;
    const char* sB = sA + C::kA;
    const float* sAS = reinterpret_cast<const float*>(sB + C::kB);
    const uint8_t* tileB = reinterpret_cast<const uint8_t*>(sB);
    if (MX) {
      for (int c = tid; c < C::BN * 4; c += C::kThreads) {
        const int n = c >> 2, q = c & 3;
        const uint4 pk = *reinterpret_cast<const uint4*>(sB + n * 64 + q * 16);
        const uint2 o0 = e2m1x8_to_e4m3(pk.x), o1 = e2m1x8_to_e4m3(pk.y);
        const uint2 o2 = e2m1x8_to_e4m3(pk.z), o3 = e2m1x8_to_e4m3(pk.w);
        *reinterpret_cast<uint4*>(s_cb + n * 128 + (((2 * q) ^ (n & 7)) << 4)) = make_uint4(o0.x, o0.y, o1.x, o1.y);
        *reinterpret_cast<uint4*>(s_cb + n * 128 + (((2 * q + 1) ^ (n & 7)) << 4)) = make_uint4(o2.x, o2.y, o3.x, o3.y);
      }
      __syncthreads();
      tileB = s_cb;
    }
    float sa[C::MI][2];
#pragma unroll
    for (int i = 0; i < C::MI; ++i) {
      sa[i][0] = sAS[wm * C::WTM + i * 16 + g];
      sa[i][1] = sAS[wm * C::WTM + i * 16 + g + 8];
    }
    float part[C::MI][C::NI][4];
#pragma unroll
    for (int i = 0; i < C::MI; ++i)
#pragma unroll
      for (int s = 0; s < C::NI; ++s)
#pragma unroll
        for (int v = 0; v < 4; ++v) part[i][s][v] = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t af[C::MI][4], bf[C::NI][2];
#pragma unroll
      for (int i = 0; i < C::MI; ++i) {
        const int r = wm * C::WTM + i * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int ch = j * 2 + (lane >> 4);
        ldmatrix_x4(af[i], sA + r * 128 + ((ch ^ (r & 7)) << 4));
      }
#pragma unroll
      for (int p = 0; p < C::NI / 2; ++p) {
        const int sub = (lane >> 4) ? 2 * p + 1 : 2 * p;
        const int n = tile_col<C>(wn, sub) + (lane & 7);
        const int ch = j * 2 + ((lane >> 3) & 1);
        uint32_t r4[4];
        ldmatrix_x4(r4, tileB + n * 128 + ((ch ^ (n & 7)) << 4));
        bf[2 * p][0] = r4[0], bf[2 * p][1] = r4[1], bf[2 * p + 1][0] = r4[2], bf[2 * p + 1][1] = r4[3];
      }
#pragma unroll
      for (int i = 0; i < C::MI; ++i)
#pragma unroll
        for (int s = 0; s < C::NI; ++s) mma_e4m3(part[i][s], af[i], bf[s][0], bf[s][1]);
      if (MX) {  // group j of this chunk: per-column UE8M0 scale
        const uint8_t* sc = reinterpret_cast<const uint8_t*>(sB + C::BN * 64);
#pragma unroll
        for (int s = 0; s < C::NI; ++s) {
          const int n = tile_col<C>(wn, s) + 2 * t4;
          const float w0 = ue8m0_value(sc[n * 4 + j]) * 64.0f, w1 = ue8m0_value(sc[(n + 1) * 4 + j]) * 64.0f;
#pragma unroll
          for (int i = 0; i < C::MI; ++i) {
            acc[i][s][0] += part[i][s][0] * (sa[i][0] * w0);
            acc[i][s][1] += part[i][s][1] * (sa[i][0] * w1);
            acc[i][s][2] += part[i][s][2] * (sa[i][1] * w0);
            acc[i][s][3] += part[i][s][3] * (sa[i][1] * w1);
#pragma unroll
            for (int v = 0; v < 4; ++v) part[i][s][v] = 0.0f;
          }
        }
      }
    }
    if (!MX) {
#pragma unroll
      for (int s = 0; s < C::NI; ++s) {
        const float ws = s_ws[(SWIGLU && s >= C::HALF) * kMaxKChunks + kb];
#pragma unroll
        for (int i = 0; i < C::MI; ++i) {
          const float f0 = sa[i][0] * ws, f1 = sa[i][1] * ws;
          acc[i][s][0] += part[i][s][0] * f0;
          acc[i][s][1] += part[i][s][1] * f0;
          acc[i][s][2] += part[i][s][2] * f1;
          acc[i][s][3] += part[i][s][3] * f1;
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
__global__ void __launch_bounds__(C::kThreads) moe_gemm_kernel(const GemmArgs args) {
  const int task = blockIdx.y;
  if (task >= *args.ntasks) return;
  extern __shared__ __align__(128) char smem[];
  const int e = args.tasks[task * 3], r0 = args.tasks[task * 3 + 1], r1 = args.tasks[task * 3 + 2];
  const int col0 = blockIdx.x * (SWIGLU ? C::BN / 2 : C::BN);
  int* s_rows = reinterpret_cast<int*>(smem + C::STAGES * C::kStage + C::kB);
  for (int r = threadIdx.x; r < C::BM; r += C::kThreads) {
    const int p = r0 + r;
    s_rows[r] = p < r1 ? (args.a_rows != nullptr ? args.a_rows[p] : p) : -1;
  }
  __syncthreads();

  float acc[C::MI][C::NI][4];
#pragma unroll
  for (int i = 0; i < C::MI; ++i)
#pragma unroll
    for (int s = 0; s < C::NI; ++s)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[i][s][v] = 0.0f;
  if (e == args.E)
    gemm_mainloop<C, false, SWIGLU>(args, args.sb0, args.sb1, 0, col0, smem, acc);
  else
    gemm_mainloop<C, MX, SWIGLU>(args, args.b0, args.b1, e, col0, smem, acc);

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int wm = warp / C::WN, wn = warp % C::WN, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int i = 0; i < C::MI; ++i)
#pragma unroll
    for (int hv = 0; hv < 2; ++hv) {
      const int p = r0 + wm * C::WTM + i * 16 + g + hv * 8;
      if (p >= r1) continue;
      if (SWIGLU) {
        __nv_bfloat16* out = static_cast<__nv_bfloat16*>(args.out) + static_cast<int64_t>(p) * args.N;
#pragma unroll
        for (int s = 0; s < C::HALF; ++s) {
          const int col = col0 + tile_col<C>(wn, s) + 2 * t4;
          if (col >= args.N) continue;
          const float h0 = swiglu_f(acc[i][s][2 * hv], acc[i][s + C::HALF][2 * hv], args.limit);
          const float h1 = swiglu_f(acc[i][s][2 * hv + 1], acc[i][s + C::HALF][2 * hv + 1], args.limit);
          *reinterpret_cast<__nv_bfloat162*>(out + col) = __floats2bfloat162_rn(h0, h1);
        }
      } else {
        float* out = static_cast<float*>(args.out) + static_cast<int64_t>(p) * args.N;
        const float w = args.row_weight[p];
#pragma unroll
        for (int s = 0; s < C::NI; ++s) {
          const int col = col0 + tile_col<C>(wn, s) + 2 * t4;
          if (col >= args.N) continue;
          *reinterpret_cast<float2*>(out + col) = make_float2(acc[i][s][2 * hv] * w, acc[i][s][2 * hv + 1] * w);
        }
      }
    }
}

}  // namespace deepfuse::moe
