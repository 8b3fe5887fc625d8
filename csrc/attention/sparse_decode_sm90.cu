// Sparse attention over paged FP8 KV, sm90a: launch of the warp-specialised wgmma kernel
// (sparse_decode_sm90.cuh). The split-KV combine is launched by sparse_attention_paged
// (sparse_attn_sm90_bf16.cu), shared with the mma.sync kernel.
#include <cstdlib>
#include <cstring>

#include "attention/sparse_decode_sm90.cuh"
#include "common/cuda_utils.h"

namespace deepfuse {

// The consumer warpgroups' softmax (sparse_decode_sm90.cuh): 0 full tile in both, 1 split by keys
// after a QK split by dims (kSplit), 2 QK itself split by keys (kSplit + kKeys).
constexpr int kSparseDecodeSplit = 1;
// H = 128 as a 2-CTA cluster sharing the dequantised key tiles (C = 2).
constexpr bool kSparseDecodeCluster = true;

bool sparse_decode_covers(const AttnParams& p) {
  if (p.G != 1 || (p.H != 64 && p.H != 128)) return false;
  for (int si = 0; si < 2; ++si)
    if (p.src[si].K > 0 && !p.src[si].fp8) return false;
  return true;
}

bool sparse_decode_enabled() {
  const char* e = std::getenv("DEEPFUSE_SPARSE_DECODE");
  if (e == nullptr || e[0] == '\0') return kSparseDecodeDefault;
  return std::strcmp(e, "0") != 0;
}

void sparse_decode_launch(const AttnParams& p, cudaStream_t stream) {
  static bool attr_done[64] = {};
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev >= 64 || !attr_done[dev]) {
    for (const void* f : {(const void*)attn_wg::sparse_decode_kernel<1, false>, (const void*)attn_wg::sparse_decode_kernel<2, false>,
                          (const void*)attn_wg::sparse_decode_kernel<1, true>, (const void*)attn_wg::sparse_decode_kernel<2, true>,
                          (const void*)attn_wg::sparse_decode_kernel<1, true, true>,
                          (const void*)attn_wg::sparse_decode_kernel<2, true, true>})
      check_cuda(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, attn_wg::kSmemBytes),
                 "sparse_attention (wgmma): smem attribute");
    if (dev < 64) attr_done[dev] = true;
  }
  // H = 128 as a 2-CTA cluster sharing the dequantised tiles: on by default (kSparseDecodeCluster;
  // 6% faster than two independent CTAs at B 64 on the H200, docs/notes/attention.md);
  // DEEPFUSE_SPARSE_DECODE_CLUSTER=0 / 1 overrides.
  const char* ce = std::getenv("DEEPFUSE_SPARSE_DECODE_CLUSTER");
  const bool cl = p.H == 128 && ((ce == nullptr || ce[0] == '\0') ? kSparseDecodeCluster : std::strcmp(ce, "0") != 0);
  // The softmax split (kSparseDecodeSplit): DEEPFUSE_SPARSE_DECODE_SPLIT=0 / 1 / 2 overrides.
  const char* se = std::getenv("DEEPFUSE_SPARSE_DECODE_SPLIT");
  const int split = (se == nullptr || se[0] == '\0') ? kSparseDecodeSplit : (se[0] == '0' ? 0 : se[0] == '2' ? 2 : 1);
  const dim3 grid(static_cast<unsigned>(static_cast<int64_t>(p.T) * (p.H / 64)), static_cast<unsigned>(p.splits), 1);
  if (!cl) {
    if (split == 2)
      attn_wg::sparse_decode_kernel<1, true, true><<<grid, attn_wg::kThreads, attn_wg::kSmemBytes, stream>>>(p);
    else if (split == 1)
      attn_wg::sparse_decode_kernel<1, true><<<grid, attn_wg::kThreads, attn_wg::kSmemBytes, stream>>>(p);
    else
      attn_wg::sparse_decode_kernel<1, false><<<grid, attn_wg::kThreads, attn_wg::kSmemBytes, stream>>>(p);
  } else {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(attn_wg::kThreads, 1, 1);
    cfg.dynamicSmemBytes = attn_wg::kSmemBytes;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 2;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    check_cuda(split == 2   ? cudaLaunchKernelEx(&cfg, attn_wg::sparse_decode_kernel<2, true, true>, p)
               : split == 1 ? cudaLaunchKernelEx(&cfg, attn_wg::sparse_decode_kernel<2, true>, p)
                            : cudaLaunchKernelEx(&cfg, attn_wg::sparse_decode_kernel<2, false>, p),
               "sparse_attention (wgmma): cluster launch");
  }
  check_launch("sparse_attention (wgmma)");
}

}  // namespace deepfuse
