// rms_norm / rope / their fusion / the fused store of the result into a cache (rows.h).
// One warp per row, the row in registers (rows.cuh).
#include "common/cuda_utils.h"
#include "norm/rows.cuh"

namespace deepfuse {
namespace {

constexpr int kWarps = 8;

struct NormRopeArgs {
  const __nv_bfloat16* x;
  int64_t x_ld, rows;
  int H, D;
  __nv_bfloat16* y;
  bool norm;
  const float* weight;
  float eps;
  const float* cos;
  const float* sin;
  int half;
  bool inverse;
};

template <int CPL>
__global__ void __launch_bounds__(kWarps * 32) norm_rope_kernel(const NormRopeArgs a, const RowStoreArgs s) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= a.rows) return;
  const int64_t tok = row / a.H;
  int64_t slot = -1;
  if (s.kind != RowStore::kNone) slot = __ldg(s.slots + tok);  // its latency hides behind the row's
  rows::WarpRow<CPL> r;
  rows::load_row(r, a.x + row * a.x_ld, a.D, lane);
  if (a.norm) rows::rms_norm(r, a.weight, a.eps, a.D, lane);
  if (a.cos != nullptr) rows::rope(r, a.cos + tok * a.half, a.sin + tok * a.half, a.half, a.inverse, a.D, lane);
  if (a.y != nullptr) rows::store_row_bf16(r, a.y + row * a.D, a.D, lane);
  if constexpr (CPL <= 2) rows::store(r, s, slot, a.D, lane);
}

template <int CPL>
void launch(const NormRopeArgs& a, const RowStoreArgs& s, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(ceil_div<int64_t>(a.rows, kWarps));
  norm_rope_kernel<CPL><<<blocks, kWarps * 32, 0, stream>>>(a, s);
  check_launch("norm_rope_kernel");
}

// Rows wider than a warp holds (kWarpRowMax < D <= kRowMax: V4.1's and V4-Pro's hidden
// widths): one block of kWideThreads threads per row, thread t the 8-value chunks
// c = t + kWideThreads i, the row in registers; the sum of squares reduced per warp, then
// over the block's warps in a fixed order. Same per-value math as rows.cuh (fmaf sums, one
// rsqrt, bf16 rounding after the norm and after the RoPE). No cache stores (they take
// D <= 512).
constexpr int kWarpRowMax = 4096;
constexpr int kRowMax = 16384;
constexpr int kWideThreads = 128;

template <int CPT>
__global__ void __launch_bounds__(kWideThreads) norm_rope_wide_kernel(const NormRopeArgs a) {
  __shared__ float part[kWideThreads / 32];
  const int t = threadIdx.x, lane = t & 31;
  const int64_t row = blockIdx.x;
  const int64_t tok = row / a.H;
  const int D = a.D;
  float v[CPT][8];
  const __nv_bfloat16* px = a.x + row * a.x_ld;
#pragma unroll
  for (int i = 0; i < CPT; ++i) {
    const int c = t + kWideThreads * i;
    if (c * 8 < D) {
      load8(px + 8 * c, v[i]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[i][j] = 0.0f;
    }
  }
  if (a.norm) {
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < CPT; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) ss = __fmaf_rn(v[i][j], v[i][j], ss);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (lane == 0) part[t >> 5] = ss;
    __syncthreads();
    ss = 0.0f;
#pragma unroll
    for (int w = 0; w < kWideThreads / 32; ++w) ss += part[w];
    const float inv = rsqrtf(__fadd_rn(__fdiv_rn(ss, static_cast<float>(D)), a.eps));
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
      const int c = t + kWideThreads * i;
      if (c * 8 >= D) continue;
      float w[8];
      if (a.weight != nullptr) {
        load8(a.weight + 8 * c, w);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = 1.0f;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) v[i][j] = rows::bf16_round(__fmul_rn(w[j], __fmul_rn(v[i][j], inv)));
    }
  }
  if (a.cos != nullptr) {  // interleaved RoPE on the last 2 * half columns (rows::rope's math)
    const float* cs = a.cos + tok * a.half;
    const float* sn = a.sin + tok * a.half;
    const int r0 = D - 2 * a.half;
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
      const int c = t + kWideThreads * i;
      if (c * 8 >= D || c * 8 + 8 <= r0) continue;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int col = c * 8 + 2 * k;
        if (col < r0) continue;
        const int p = (col - r0) >> 1;
        const float co = __ldg(cs + p), si = a.inverse ? -__ldg(sn + p) : __ldg(sn + p);
        const float x0 = v[i][2 * k], x1 = v[i][2 * k + 1];
        v[i][2 * k] = rows::bf16_round(__fsub_rn(__fmul_rn(x0, co), __fmul_rn(x1, si)));
        v[i][2 * k + 1] = rows::bf16_round(__fadd_rn(__fmul_rn(x1, co), __fmul_rn(x0, si)));
      }
    }
  }
  if (a.y != nullptr) {
    __nv_bfloat16* py = a.y + row * D;
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
      const int c = t + kWideThreads * i;
      if (c * 8 < D) *reinterpret_cast<uint4*>(py + 8 * c) = rows::pack_bf16x8(v[i]);
    }
  }
}

template <int CPT>
void launch_wide(const NormRopeArgs& a, cudaStream_t stream) {
  norm_rope_wide_kernel<CPT><<<static_cast<unsigned>(a.rows), kWideThreads, 0, stream>>>(a);
  check_launch("norm_rope_wide_kernel");
}

}  // namespace

bool norm_rope_fits(int D) { return D > 0 && D % 8 == 0 && D <= kRowMax; }

void norm_rope(const void* x, int64_t x_ld, int64_t rows, int H, int D, void* y, bool norm, const float* weight,
               float eps, const float* cos, const float* sin, int half, bool inverse, const RowStoreArgs& store,
               cudaStream_t stream) {
  if (rows <= 0) return;
  if (!norm_rope_fits(D)) throw std::invalid_argument("deepfuse: norm_rope: D must be a multiple of 8, <= 16384");
  if (store.kind == RowStore::kKvFp8 && D != 512) throw std::invalid_argument("deepfuse: norm_rope: KV rows need D 512");
  if ((store.kind == RowStore::kIdxFp8 || store.kind == RowStore::kIdxFp8Ue8m0) && D != 128)
    throw std::invalid_argument("deepfuse: norm_rope: indexer keys need D 128");
  if (store.kind == RowStore::kDense && D > 512) throw std::invalid_argument("deepfuse: norm_rope: dense store needs D <= 512");
  if (store.kind != RowStore::kNone && H != 1) throw std::invalid_argument("deepfuse: norm_rope: stores need H 1");
  const NormRopeArgs a{static_cast<const __nv_bfloat16*>(x), x_ld, rows, H, D, static_cast<__nv_bfloat16*>(y),
                       norm, weight, eps, cos, sin, half, inverse};
  if (D > kWarpRowMax) {  // stores were refused above (they take D <= 512)
    if (rows > 0x7fffffffLL) throw std::invalid_argument("deepfuse: norm_rope: more than 2^31 - 1 rows of D > 4096");
    if (D <= kWideThreads * 8 * 8) launch_wide<8>(a, stream);
    else launch_wide<16>(a, stream);
    return;
  }
  const int cpl = ceil_div(D, 256);
  if (cpl <= 1) launch<1>(a, store, stream);
  else if (cpl <= 2) launch<2>(a, store, stream);
  else if (cpl <= 4) launch<4>(a, store, stream);
  else if (cpl <= 8) launch<8>(a, store, stream);
  else launch<16>(a, store, stream);
}

}  // namespace deepfuse
