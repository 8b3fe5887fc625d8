// The short-row kernel's instantiations (topk_rows_kernel.cuh), launched by topk() (topk.cu).
#include "topk/topk.h"
#include "topk/topk_config.h"
#include "topk/topk_rows_kernel.cuh"

namespace deepfuse::topk_detail {

void topk_rows_launch(const TopkArgs& a, TopkDtype dtype, int64_t B, const TopkPlan& plan, cudaStream_t stream) {
  launch_rows(a, dtype, B, plan, stream);
}

void topk_rows_set_attributes() { set_rows_attributes(); }

}  // namespace deepfuse::topk_detail
