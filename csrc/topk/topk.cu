// topk(): the general kernel's instantiations (topk_kernel.cuh) and the dispatch by plan.
#include <stdexcept>

#include "common/cuda_utils.h"
#include "topk/topk.h"
#include "topk/topk_config.h"
#include "topk/topk_kernel.cuh"

namespace deepfuse {
namespace {

// Opts every kernel variant into large dynamic shared memory, once per device (on the first
// call, so that a later first use of a variant inside a graph capture needs no attribute call).
void set_smem_attributes() {
  static bool done[64] = {};
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev < 64 && done[dev]) return;
  set_general_attributes();
  topk_detail::topk_rows_set_attributes();
  if (dev < 64) done[dev] = true;
}

}  // namespace

void topk(const TopkArgs& a, TopkDtype dtype, int64_t B, const TopkPlan& plan, cudaStream_t stream) {
  if (B <= 0) return;
  if (a.slot_map != nullptr && !a.idx64) throw std::runtime_error("deepfuse: topk: a slot map needs int64 indices");
  if (a.k < 1 || a.k > kTopkMaxK) throw std::runtime_error("deepfuse: topk: k must be in [1, 4096]");
  if (a.N < 0) throw std::runtime_error("deepfuse: topk: N must be >= 0");
  set_smem_attributes();
  if (plan.kernel == 1) {
    topk_detail::topk_rows_launch(a, dtype, B, plan, stream);
    return;
  }
  if (B * plan.ctas_per_row >= (int64_t{1} << 31)) throw std::runtime_error("deepfuse: topk: too many rows");
  if (plan.buffer - a.k < plan.threads * 8) throw std::runtime_error("deepfuse: topk: buffer too small for the plan");
  launch_general(a, dtype, B, plan, stream);
}

}  // namespace deepfuse
