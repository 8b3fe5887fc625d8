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

}  // namespace

bool norm_rope_fits(int D) { return D > 0 && D % 8 == 0 && D <= 4096; }

void norm_rope(const void* x, int64_t x_ld, int64_t rows, int H, int D, void* y, bool norm, const float* weight,
               float eps, const float* cos, const float* sin, int half, bool inverse, const RowStoreArgs& store,
               cudaStream_t stream) {
  if (rows <= 0) return;
  if (!norm_rope_fits(D)) throw std::invalid_argument("deepfuse: norm_rope: D must be a multiple of 8, <= 4096");
  if (store.kind == RowStore::kKvFp8 && D != 512) throw std::invalid_argument("deepfuse: norm_rope: KV rows need D 512");
  if ((store.kind == RowStore::kIdxFp8 || store.kind == RowStore::kIdxFp8Ue8m0) && D != 128)
    throw std::invalid_argument("deepfuse: norm_rope: indexer keys need D 128");
  if (store.kind == RowStore::kDense && D > 512) throw std::invalid_argument("deepfuse: norm_rope: dense store needs D <= 512");
  if (store.kind != RowStore::kNone && H != 1) throw std::invalid_argument("deepfuse: norm_rope: stores need H 1");
  const NormRopeArgs a{static_cast<const __nv_bfloat16*>(x), x_ld, rows, H, D, static_cast<__nv_bfloat16*>(y),
                       norm, weight, eps, cos, sin, half, inverse};
  const int cpl = ceil_div(D, 256);
  if (cpl <= 1) launch<1>(a, store, stream);
  else if (cpl <= 2) launch<2>(a, store, stream);
  else if (cpl <= 4) launch<4>(a, store, stream);
  else if (cpl <= 8) launch<8>(a, store, stream);
  else launch<16>(a, store, stream);
}

}  // namespace deepfuse
