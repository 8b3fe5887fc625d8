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
// H = 128 as a 2-CTA cluster sharing the dequantised key tiles (C = 2), for calls of at most
// kClusterWaves waves of CTAs (decode; H200: B 64 s_q 2 -4%, B 128 s_q 2 -1%), not for prefill-sized
// ones (4096 rows: +8%: a cluster needs two free SMs of one GPC at once, so many waves fragment).
constexpr bool kSparseDecodeCluster = true;
constexpr int kClusterWaves = 4;
// Split-KV partials reduced inside a cluster of the row's splits (kRed) instead of the workspace and
// the combine launch, for 2 <= splits <= kMaxRed; H 128 then runs as two independent 64-head CTAs.
constexpr bool kSparseDecodeReduce = false;
// ... and by default for calls of at most kReduceMaxUnits 64-head row blocks (T * H / 64; B 1 decode,
// which the plan gives 16 splits: H200, K 641 in a graph h 64 14.4 us, h 128 14.3 vs 16.4 with the combine).
constexpr int kReduceMaxUnits = 4;
// One split and more CTAs than fit at once: persistent CTAs (one wave; each takes rows t, t + grid, ..)
// with the split softmax (kPersist). By default for MXFP8 outputs (H200, 4096 rows: 1365 vs 1450 us at
// h 64, 2713 vs 2835 at h 128: the epilogue of one row overlaps the next row's fill); bf16 outputs keep
// one CTA per row block (equal at h 64, 1.6% slower at h 128).
constexpr bool kSparseDecodePersist = true;
// The producer's slot indices through a shared-memory ring (one rolled step body); false: the
// previous producer (indices in registers three blocks ahead, its loop unrolled by three), kept for
// the split-softmax plain paths only. DEEPFUSE_SPARSE_DECODE_PROD=0 / 1 overrides.
constexpr bool kSparseDecodeRing = true;

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

namespace {

template <int C, bool kSplit, bool kKeys, bool kRed, bool kPersist = false, bool kOld = false>
void launch_cluster(const AttnParams& p, dim3 grid, dim3 cluster, cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(attn_wg::kThreads, 1, 1);
  cfg.dynamicSmemBytes = attn_wg::kSmemBytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster.x;
  attr[0].val.clusterDim.y = cluster.y;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&cfg, attn_wg::sparse_decode_kernel<C, kSplit, kKeys, kRed, kPersist, kOld>, p),
             "sparse_attention (wgmma): cluster launch");
}

// Whether a cluster of `splits` CTAs of the reduction kernel fits on device dev (asked once per size).
bool reduce_fits(int dev, int splits, int split_mode) {
  static signed char ok[64][2][attn_wg::kMaxRed + 1] = {};  // 0 unknown, 1 yes, -1 no
  const int m = split_mode == 2 ? 1 : 0;
  if (dev < 64 && ok[dev][m][splits] != 0) return ok[dev][m][splits] > 0;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(1, static_cast<unsigned>(splits), 1);
  cfg.blockDim = dim3(attn_wg::kThreads, 1, 1);
  cfg.dynamicSmemBytes = attn_wg::kSmemBytes;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = static_cast<unsigned>(splits);
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  const cudaError_t e = m ? cudaOccupancyMaxActiveClusters(&n, attn_wg::sparse_decode_kernel<1, true, true, true>, &cfg)
                          : cudaOccupancyMaxActiveClusters(&n, attn_wg::sparse_decode_kernel<1, true, false, true>, &cfg);
  if (e != cudaSuccess) (void)cudaGetLastError();  // not launchable as a cluster: the combine path
  const bool fits = e == cudaSuccess && n > 0;
  if (dev < 64) ok[dev][m][splits] = fits ? 1 : -1;
  return fits;
}

}  // namespace

bool sparse_decode_persist_enabled(const AttnParams& p) {
  const char* e = std::getenv("DEEPFUSE_SPARSE_DECODE_PERSIST");
  if (e == nullptr || e[0] == '\0') return kSparseDecodePersist && p.mxfp8;
  return std::strcmp(e, "0") != 0;
}

bool sparse_decode_reduce_enabled(const AttnParams& p) {
  const char* e = std::getenv("DEEPFUSE_SPARSE_DECODE_REDUCE");
  if (e == nullptr || e[0] == '\0')
    return kSparseDecodeReduce || static_cast<int64_t>(p.T) * (p.H / 64) <= kReduceMaxUnits;
  return std::strcmp(e, "0") != 0;
}

bool sparse_decode_launch(const AttnParams& p, cudaStream_t stream) {
  static bool attr_done[64] = {};
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev >= 64 || !attr_done[dev]) {
    for (const void* f : {(const void*)attn_wg::sparse_decode_kernel<1, false>, (const void*)attn_wg::sparse_decode_kernel<2, false>,
                          (const void*)attn_wg::sparse_decode_kernel<1, true>, (const void*)attn_wg::sparse_decode_kernel<2, true>,
                          (const void*)attn_wg::sparse_decode_kernel<1, true, true>,
                          (const void*)attn_wg::sparse_decode_kernel<2, true, true>,
                          (const void*)attn_wg::sparse_decode_kernel<1, true, false, true>,
                          (const void*)attn_wg::sparse_decode_kernel<1, true, true, true>,
                          (const void*)attn_wg::sparse_decode_kernel<1, true, false, false, true>,
                          (const void*)attn_wg::sparse_decode_kernel<2, true, false, false, true>,
                          (const void*)attn_wg::sparse_decode_kernel<1, true, false, false, false, true>,
                          (const void*)attn_wg::sparse_decode_kernel<2, true, false, false, false, true>})
      check_cuda(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, attn_wg::kSmemBytes),
                 "sparse_attention (wgmma): smem attribute");
    for (const void* f : {(const void*)attn_wg::sparse_decode_kernel<1, true, false, true>,
                          (const void*)attn_wg::sparse_decode_kernel<1, true, true, true>})
      check_cuda(cudaFuncSetAttribute(f, cudaFuncAttributeNonPortableClusterSizeAllowed, 1),
                 "sparse_attention (wgmma): cluster size attribute");
    if (dev < 64) attr_done[dev] = true;
  }
  // H = 128 as a 2-CTA cluster sharing the dequantised tiles: by default (kSparseDecodeCluster) for
  // calls with splits or of at most kClusterWaves waves; DEEPFUSE_SPARSE_DECODE_CLUSTER=0 / 1 forces it.
  const char* ce = std::getenv("DEEPFUSE_SPARSE_DECODE_CLUSTER");
  const bool cl_auto = kSparseDecodeCluster && (p.splits > 1 || static_cast<int64_t>(p.T) * 2 <= kClusterWaves * num_sms());
  const bool cl = p.H == 128 && ((ce == nullptr || ce[0] == '\0') ? cl_auto : std::strcmp(ce, "0") != 0);
  // The softmax split (kSparseDecodeSplit): DEEPFUSE_SPARSE_DECODE_SPLIT=0 / 1 / 2 overrides.
  const char* se = std::getenv("DEEPFUSE_SPARSE_DECODE_SPLIT");
  const int split = (se == nullptr || se[0] == '\0') ? kSparseDecodeSplit : (se[0] == '0' ? 0 : se[0] == '2' ? 2 : 1);
  const char* re = std::getenv("DEEPFUSE_SPARSE_DECODE_PROD");
  const bool ring = (re == nullptr || re[0] == '\0') ? kSparseDecodeRing : std::strcmp(re, "0") != 0;
  const dim3 grid(static_cast<unsigned>(static_cast<int64_t>(p.T) * (p.H / 64)), static_cast<unsigned>(p.splits), 1);
  // The split reduction in a cluster of the row's splits: DEEPFUSE_SPARSE_DECODE_REDUCE=1 (off by
  // default, kSparseDecodeReduce); needs the split softmax, 2 <= splits <= kMaxRed and a cluster of
  // that size that fits; otherwise the partials go to the workspace and the combine kernel.
  if (split != 0 && p.splits > 1 && p.splits <= attn_wg::kMaxRed && sparse_decode_reduce_enabled(p) &&
      reduce_fits(dev, p.splits, split)) {
    const dim3 cluster(1, static_cast<unsigned>(p.splits), 1);
    if (split == 2)
      launch_cluster<1, true, true, true>(p, grid, cluster, stream);
    else
      launch_cluster<1, true, false, true>(p, grid, cluster, stream);
    check_launch("sparse_attention (wgmma, split reduction)");
    return true;
  }
  // Persistent CTAs (kSparseDecodePersist: MXFP8 outputs; DEEPFUSE_SPARSE_DECODE_PERSIST=0 / 1 forces
  // it off / on): one split, the split softmax, more cluster units (rows x 64-head blocks / C) than fit
  // in one wave.
  const int cu = cl ? 2 : 1;
  const int64_t units = static_cast<int64_t>(p.T) * (p.H / 64) / cu;
  const int64_t wave = num_sms() / cu;
  if (p.splits == 1 && split == 1 && units > wave && sparse_decode_persist_enabled(p)) {
    const dim3 pg(static_cast<unsigned>(wave * cu), 1, 1);
    if (cl)
      launch_cluster<2, true, false, false, true>(p, pg, dim3(2, 1, 1), stream);
    else
      attn_wg::sparse_decode_kernel<1, true, false, false, true><<<pg, attn_wg::kThreads, attn_wg::kSmemBytes, stream>>>(p);
    check_launch("sparse_attention (wgmma, persistent)");
    return false;
  }
  if (!cl) {
    if (split == 2)
      attn_wg::sparse_decode_kernel<1, true, true><<<grid, attn_wg::kThreads, attn_wg::kSmemBytes, stream>>>(p);
    else if (split == 1 && !ring)
      attn_wg::sparse_decode_kernel<1, true, false, false, false, true><<<grid, attn_wg::kThreads, attn_wg::kSmemBytes, stream>>>(p);
    else if (split == 1)
      attn_wg::sparse_decode_kernel<1, true><<<grid, attn_wg::kThreads, attn_wg::kSmemBytes, stream>>>(p);
    else
      attn_wg::sparse_decode_kernel<1, false><<<grid, attn_wg::kThreads, attn_wg::kSmemBytes, stream>>>(p);
  } else {
    const dim3 cluster(2, 1, 1);
    if (split == 2)
      launch_cluster<2, true, true, false>(p, grid, cluster, stream);
    else if (split == 1 && !ring)
      launch_cluster<2, true, false, false, false, true>(p, grid, cluster, stream);
    else if (split == 1)
      launch_cluster<2, true, false, false>(p, grid, cluster, stream);
    else
      launch_cluster<2, false, false, false>(p, grid, cluster, stream);
  }
  check_launch("sparse_attention (wgmma)");
  return false;
}

}  // namespace deepfuse
