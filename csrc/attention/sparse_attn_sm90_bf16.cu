// Sparse attention over paged KV, sm90: kernel instantiations and launches (bf16 MMAs over
// FP8-dequantised or bf16 keys). The policy (groups, splits) is in sparse_attn_plan.cu.
#include "attention/sparse_attn_sm90_bf16.cuh"
#include "common/cuda_utils.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace deepfuse {

namespace {

// The split-KV combine as a programmatic dependent launch of the main kernel (H200: B 1 s_q 2 in a
// graph h 128 18.3 -> 17.9 us, h 64 16.6 -> 16.7; B 64 s_q 1 h 64 49.7 -> 48.5).
constexpr bool kCombinePDL = true;

template <int G>
void launch_main(const AttnParams& p, int C, cudaStream_t stream) {
  static bool attr_done[64][9] = {};  // per device (function attributes are) and cluster size
  const int smem = attn::smem_bytes(C);
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev >= 64 || !attr_done[dev][C]) {
    check_cuda(cudaFuncSetAttribute(attn::sparse_attn_kernel<G>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    attn::smem_bytes(1)),
               "sparse_attention: smem attribute");
    if (dev < 64) attr_done[dev][C] = true;
  }
  const int64_t groups = (static_cast<int64_t>(p.T) + G - 1) / G;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(groups * C), static_cast<unsigned>(p.splits), 1);
  cfg.blockDim = dim3(attn::kThreads, 1, 1);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(C);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = C > 1 ? 1 : 0;
  check_cuda(cudaLaunchKernelEx(&cfg, attn::sparse_attn_kernel<G>, p), "sparse_attention: launch");
  check_launch("sparse_attention");
}

}  // namespace

void sparse_attention_paged(const AttnParams& p, cudaStream_t stream) {
  if (p.T == 0 || p.H == 0) return;
  if (p.H != 64 && p.H != 128) throw std::invalid_argument("deepfuse: sparse_attention_paged: H must be 64 or 128");
  if (p.G != 1 && p.G != 2 && p.G != 4) throw std::invalid_argument("deepfuse: sparse_attention_paged: G must be 1, 2 or 4");
  const int C = p.G * (p.H / attn::kRows);
  if (C > 8) throw std::invalid_argument("deepfuse: sparse_attention_paged: G * H / 64 must be <= 8");
  if (p.splits < 1 || p.splits > 65535) throw std::invalid_argument("deepfuse: sparse_attention_paged: bad splits");
  if (p.splits > 1 && (p.ws_o == nullptr || p.ws_ml == nullptr))
    throw std::invalid_argument("deepfuse: sparse_attention_paged: splits > 1 needs a workspace");
  bool reduced = false;  // the split-KV partials already merged by the main kernel
  if (sparse_decode_covers(p) && sparse_decode_enabled()) {
    reduced = sparse_decode_launch(p, stream);
  } else {
    switch (p.G) {
      case 1: launch_main<1>(p, C, stream); break;
      case 2: launch_main<2>(p, C, stream); break;
      default: launch_main<4>(p, C, stream); break;
    }
  }
  if (p.splits > 1 && !reduced) {
    const int64_t n = static_cast<int64_t>(p.T) * p.H;
    // Programmatic dependent launch (the main kernel's CTAs release it when they start; its CTAs are
    // scheduled on the free SMs and wait in griddepcontrol.wait): the launch latency overlaps the main
    // kernel. kCombinePDL; DEEPFUSE_SPARSE_ATTN_PDL=0 / 1 overrides.
    const char* e = std::getenv("DEEPFUSE_SPARSE_ATTN_PDL");
    const bool pdl = (e == nullptr || e[0] == '\0') ? kCombinePDL : std::strcmp(e, "0") != 0;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(n), 1, 1);
    cfg.blockDim = dim3(128, 1, 1);
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    check_cuda(cudaLaunchKernelEx(&cfg, attn::sparse_attn_combine_kernel, p), "sparse_attention: combine");
    check_launch("sparse_attention: combine");
  }
}

}  // namespace deepfuse
