// topk_plan(): which kernel, how many CTAs and threads, how much shared memory, the candidate
// buffer and the threshold margin for a shape (measurements: docs/notes/topk-perf.md).
#include <algorithm>

#include "topk/topk.h"
#include "topk/topk_config.h"

namespace deepfuse {
namespace {

using namespace topk_detail;

// Short rows (topk_rows_kernel.cuh): aligned rows of at most kRowsMaxVecs 16-byte vectors,
// where it measured faster than the general kernel (bf16 512 x 16384 k = 512 excepted: 10%
// slower).
bool rows_fit(TopkDtype dtype, int64_t B, int64_t N) {
  const int64_t vec = dtype == TopkDtype::kF32 ? 4 : 8;
  return B >= 1 && B < (int64_t{1} << 31) && N >= 1 && N % vec == 0 && N / vec <= kRowsMaxVecs;
}

// The short-row configuration (kRowsCfg) by row length in vectors: 1024 threads while B <=
// #SMs and rows exceed 512 vectors (fewer elements per thread: shorter chains on an SM that
// has one row); 512 threads when SMs take several rows (several CTAs overlap) and for
// shorter rows.
int rows_cfg(int64_t B, int64_t nvec, int64_t sms) {
  if (nvec <= 512) return 0;
  if (B <= sms) return nvec <= 1024 ? 3 : 4;
  return nvec <= 1024 ? 1 : 2;
}

int rows_smem(int k, bool sorted) {
  int n = 1;
  while (n < k) n <<= 1;
  return static_cast<int>(sizeof(RowsShared)) + (sorted ? n * 8 : 0);
}

// Candidate buffer entries. 512 threads (one CTA per SM): large, so that a sampled threshold
// practically never overflows it. 256 threads (B > #SMs): as large as the CTAs one wave
// needs per SM (ceil(B / #SMs), at most 4) allow, at least 2K + 2048 (the robust path
// appends one vector per thread after a compaction to K; that minimum may cost residency).
int buffer_entries(int64_t B, int k, int nt, bool sorted, int64_t sms) {
  if (nt == kBig) return kBuffer;
  const int64_t per_sm = std::min<int64_t>(4, std::max<int64_t>(1, (B + sms - 1) / sms));
  const int64_t budget =
      228 * 1024 / per_sm - 1024 - static_cast<int64_t>(sizeof(Shared)) - (sorted ? kTopkMaxK * 8 : 0);
  const int fit = static_cast<int>(std::min<int64_t>(16384, budget / 8)) & ~255;
  return std::max(fit, k <= 512 ? 4096 : 2 * k + 3072);
}

// A row re-streams (about 2x its time) when its sample puts thr above its K-th key: a normal
// tail of z sigma. z grows with B so that a call meets it with <= ~3% chance (tails 1.3e-3,
// 2.3e-4, 3.2e-5, 3.4e-6); a larger z costs candidates on every row.
float margin(int64_t B) { return B <= 16 ? 3.f : (B <= 128 ? 3.5f : (B <= 1024 ? 4.f : 4.5f)); }

}  // namespace

TopkPlan topk_plan(TopkDtype dtype, int64_t B, int64_t N, int k, bool sorted, int sms, bool aligned) {
  if (aligned && rows_fit(dtype, B, N)) {
    const RowsCfg c = kRowsCfg[rows_cfg(B, N / (dtype == TopkDtype::kF32 ? 4 : 8), sms)];
    return TopkPlan{1, c.nt, rows_smem(k, sorted), 1, c.v, 0, 0.f};
  }
  // G = 1: min(B, #SMs) persistent 512-thread CTAs streaming through a ring (bulk copies);
  // G > 1 (short parts): a cluster per row, register double buffering (measured faster
  // there); B > #SMs: a 256-thread CTA per row (up to 4 per SM), register double buffering.
  int g = 1;  // a cluster per row while B * G fits one CTA per SM and parts stay long
  while (g < kMaxCluster && B * 2 * g <= sms && N / (2 * g) >= kMinPart) g *= 2;
  const int nt = B <= sms ? kBig : 256;
  const int vecs = nt == kBig ? (g > 1 ? kU512 : kU) : kU256;
  const int buffer = buffer_entries(B, k, nt, sorted, sms);
  const int64_t mid = nt == kBig && g == 1 ? kRingBytes : (sorted ? kTopkMaxK * 8 : 0);
  const int64_t smem = static_cast<int64_t>(sizeof(Shared)) + mid + 8 * static_cast<int64_t>(buffer);
  return TopkPlan{g, nt, static_cast<int>(smem), 0, vecs, buffer, margin(B)};
}

}  // namespace deepfuse
