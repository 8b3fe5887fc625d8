// Sparse attention launch policy (host only): how many split-KV parts for a call shape.
// One CTA per SM (the kernel takes ~208 KB of shared memory); a call with fewer CTAs than
// SMs splits its keys so that about one wave runs, at most one 64-key block of the wgmma kernel
// per split (K_total / 64 rounded up; the mma.sync kernel: about two of its 32-key blocks).
// Both kernels give split y the blocks y * bps .. with bps = ceil(blocks / splits): fewer splits
// than 64-key blocks double a split's chain (K 641 at 10 splits: 6 splits of 2 blocks, 4 empty).
#include <algorithm>

#include "attention/sparse_attention.h"
#include "common/cuda_utils.h"

namespace deepfuse {

AttnPlan sparse_attention_plan(int T, int H, int K_total, int G) {
  AttnPlan pl{};
  pl.G = G;
  const int C = G * std::max(1, H / 64);
  const int64_t groups = (static_cast<int64_t>(T) + G - 1) / G;
  const int64_t ctas = groups * C;
  pl.blocks = (K_total + 31) / 32;
  const int64_t sms = num_sms();
  int64_t s = 1;
  if (ctas > 0 && ctas < sms) s = sms / ctas;
  s = std::min<int64_t>(s, std::max(1, (K_total + 63) / 64));
  // Calls of at most kSmallCtas CTAs (B 1 decode) with >= 8 blocks: 16 splits, whose partials the wgmma
  // kernel merges in a 16-CTA cluster by default (sparse_decode_sm90.cu, kReduceMaxUnits): the merge of
  // 64 head rows is spread over 16 CTAs (H200, K 641 in a graph: h 64 14.4 us vs 14.8 at 11 splits,
  // h 128 14.3 vs 16.4 with the combine).
  constexpr int64_t kSmallCtas = 4;
  if (G == 1 && ctas > 0 && ctas <= kSmallCtas && (K_total + 63) / 64 >= 8 && sms >= 16 * ctas) s = 16;
  s = std::max<int64_t>(1, std::min<int64_t>(s, 65535));
  pl.splits = static_cast<int>(s);
  pl.ctas = static_cast<int>(std::min<int64_t>(ctas * s, 1 << 30));
  return pl;
}

int64_t sparse_attention_workspace_floats(int T, int H, int splits) {
  if (splits <= 1) return 0;
  return static_cast<int64_t>(splits) * T * H * (512 + 2);
}

}  // namespace deepfuse
