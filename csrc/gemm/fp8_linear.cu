// fp8_linear host launch: dense M <= 64 goes to the one-launch streaming kernel
// (stream_linear.cu) where it serves the shape; otherwise activation cast, then the grouped
// GEMM kernel in dense mode. Small M there streams the weight through 64-row x 16-token tiles; large M takes 128 x 128 tiles
// (the Python side prefers cuBLASLt through torch._scaled_mm there where it is faster).
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>

#include <cuda_bf16.h>

#include "cast/cast.h"
#include "common/cuda_utils.h"
#include "gemm/fp8_linear.h"
#include "gemm/grouped_gemm_sm90.cuh"

namespace deepfuse {
namespace {

template <bool MX>
using SmallM = gemm::GemmCfg<16, 1, 4, MX>;
template <bool MX>
using LargeM = gemm::GemmCfg<128, 2, 4, MX>;

int64_t align256(int64_t v) { return (v + 255) / 256 * 256; }

// K splits for small M: enough CTAs for two per SM, each at least two 128-K chunks.
int k_splits(const LinearProblem& p) {
  if (p.M > 64 || p.groups > 0) return 1;
  const int tiles = ceil_div(p.N, SmallM<false>::ROWS);
  const int kb = ceil_div(p.K, 128);
  return std::max(1, std::min(ceil_div(2 * num_sms(), tiles), kb / 2));
}

// out[m, n] = sum over z of part[z, m, n], in z order.
template <typename Out>
__global__ void split_reduce_kernel(const float* __restrict__ part, Out* __restrict__ out, int64_t MN, int splits) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < MN;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int z = 0; z < splits; ++z) s += part[z * MN + i];
    if constexpr (sizeof(Out) == 4) out[i] = s;
    else out[i] = __float2bfloat16_rn(s);
  }
}

template <class C, bool MX>
void launch(const gemm::GemmArgs& a, int64_t M, cudaStream_t stream) {
  const dim3 grid(ceil_div(a.N, C::ROWS), static_cast<unsigned>(ceil_div<int64_t>(M, C::BT)),
                  a.groups > 0 ? a.groups : a.ksplit);
  gemm::launch_grouped_gemm<C, MX, false>(a, grid, stream, "grouped_gemm_kernel (linear)");
}

}  // namespace

int64_t fp8_linear_workspace_bytes(const LinearProblem& p) {
  const int z = k_splits(p);
  const int64_t rows = p.M * std::max(1, p.groups);
  const int64_t grouped =
      align256(rows * p.K) + align256(4 * rows * ceil_div(p.K, 128)) + (z > 1 ? 4LL * z * p.M * p.N : 0);
  return p.persist ? std::max(grouped, persist_linear_workspace_bytes(p)) : grouped;
}

void fp8_linear(const LinearProblem& p, const void* x, bool x_bf16, void* out, bool out_bf16, void* workspace,
                cudaStream_t stream) {
  require_sm90a("fp8_linear");
  if (p.M <= 0 || p.N <= 0) return;
  if (p.M > (1LL << 30)) throw std::runtime_error("deepfuse: fp8_linear: too many rows");
  if (p.persist && persist_linear(p, x, x_bf16, out, out_bf16, workspace, stream)) return;
  if (stream_linear(p, p.stream_max_m, x, x_bf16, out, out_bf16, stream)) return;
  if (p.x_mx)
    throw std::invalid_argument(
        "deepfuse.fp8_linear: argument 'x' (MXFP8 with x_scale) is served by the streaming kernel only "
        "(M <= stream_max_m <= 64; grouped: stream_grouped and 64 | rows per group); this shape is not");
  const int64_t rows = p.M * std::max(1, p.groups);
  uint8_t* xq = static_cast<uint8_t*>(workspace);
  float* xs = reinterpret_cast<float*>(xq + align256(rows * p.K));
  fp8_group_cast(x, x_bf16, xq, xs, ScaleKind::kFp32, rows, p.K, p.K, 128, 0, stream);
  gemm::GemmArgs a{};
  a.a = xq, a.a_scale = xs, a.a_rows = nullptr;
  a.K = p.K, a.N = p.N, a.E = std::max(1, p.groups), a.M = static_cast<int>(p.M), a.groups = p.groups;
  a.b0 = a.b1 = a.sb0 = a.sb1 = gemm::GemmOperand{static_cast<const uint8_t*>(p.w), p.scale, p.scale_u8};
  a.tasks = nullptr, a.ntasks = nullptr;
  const int z = k_splits(p);
  float* part = reinterpret_cast<float*>(xq + align256(rows * p.K) + align256(4 * rows * ceil_div(p.K, 128)));
  a.ksplit = z;
  a.out = z > 1 ? static_cast<void*>(part) : out, a.out_bf16 = z > 1 ? false : out_bf16, a.row_weight = nullptr;
  if (p.M <= 64) {
    if (p.mxfp4) launch<SmallM<true>, true>(a, p.M, stream);
    else launch<SmallM<false>, false>(a, p.M, stream);
    if (z > 1) {
      const int64_t MN = p.M * p.N;
      const int blocks = static_cast<int>(std::min<int64_t>(ceil_div<int64_t>(MN, 256), 4 * num_sms()));
      if (out_bf16)
        split_reduce_kernel<<<blocks, 256, 0, stream>>>(part, static_cast<__nv_bfloat16*>(out), MN, z);
      else
        split_reduce_kernel<<<blocks, 256, 0, stream>>>(part, static_cast<float*>(out), MN, z);
      check_launch("split_reduce_kernel");
    }
  } else {
    if (p.mxfp4) launch<LargeM<true>, true>(a, p.M, stream);
    else launch<LargeM<false>, false>(a, p.M, stream);
  }
}

}  // namespace deepfuse
