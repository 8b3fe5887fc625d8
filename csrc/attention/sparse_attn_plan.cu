// Sparse attention launch policy (host only): how many split-KV parts for a call shape.
// One CTA per SM (the kernel takes ~208 KB of shared memory); a call with fewer CTAs than
// SMs splits its key blocks so that about one wave runs, keeping >= 2 blocks per split.
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
  s = std::min<int64_t>(s, std::max(1, pl.blocks / 2));
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
