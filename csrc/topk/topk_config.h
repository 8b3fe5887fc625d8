// Tuning constants and shared-memory layouts that the plan (topk_plan.cpp) and the kernels
// (topk_kernel.cuh, topk_rows_kernel.cuh) agree on. Host and device code include it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "topk/topk.h"

namespace deepfuse::topk_detail {

// ---- the general kernel (topk_kernel.cuh)
constexpr int kBins = 2048;      // digit: 11 bits
constexpr int kMaxCluster = 8;   // CTAs per row at most (a thread-block cluster)
constexpr int kMinPart = 16384;  // do not split rows into parts smaller than this
constexpr int kBig = 512;        // threads per CTA (one CTA per SM)
constexpr int kU = 3;            // 16-byte vectors per thread and streaming round
constexpr int kStages = 4;       // rounds in the ring (kStages - 1 in flight while one is filtered)
constexpr int kRingBytes = kStages * kU * kBig * 16;
static_assert((kStages & (kStages - 1)) == 0, "stages: a power of two");
constexpr int kBuffer = 13312;      // candidate buffer entries (raw bits, index)
constexpr int kMaxSeg = kBig / 32;  // fast path: one buffer segment per warp (G = 1, long rows)
constexpr int kSegMinLen = 65536;   // rows at least this long use per-warp segments (measured)
constexpr uint32_t kTieList = 256;  // ties ranked in a shared list up to this many entries == T
constexpr int kU256 = 3;  // 256-thread CTAs (B > #SMs): vectors per thread and round, registers
constexpr int kU512 = 4;  // 512-thread CTAs of a cluster (G > 1): the same, registers
static_assert(kRingBytes >= kTopkMaxK * 8, "the sorted pair buffer aliases the ring");
// The robust path: after a compaction to K entries one round of one vector per thread fits.
static_assert(kBuffer - kTopkMaxK >= kBig * 8, "candidate buffer");

struct __align__(16) Shared {
  uint32_t hist[2][kBins];  // zero between uses (find_bucket clears them after its search)
  uint32_t res_bin, res_above, res_cnt, res_total;  // find_bucket result
  uint32_t cnt;   // robust path: buffer entries; fast path: entries reserved in the pool
  uint32_t fail;  // fast path (rank 0's): some append did not fit
  uint32_t mx;    // largest buffered key (0: none)
  uint32_t wa[2][32], wb[2][32];   // per-warp counts / max keys of a block scan (two phases)
  uint32_t rowt[16];               // find_bucket: totals of the 16 rows of 128 bins
  uint32_t segcnt[kMaxSeg];        // fast path (rank 0's): entries in each warp's segment
  unsigned long long full[kStages], empty[kStages];  // ring stage barriers (see Ctx::issue)
};

// ---- the short-row kernel (topk_rows_kernel.cuh)
constexpr int kRowBins = 2048;  // level 1 (and fp32 level 2): 11 bits

struct __align__(16) RowsShared {
  uint32_t h[2][kRowBins];  // level histograms (zeroed at start; fp32 level 3 reuses h[0])
  uint32_t wsum[32];        // per-warp sums of a block scan
  unsigned long long wsum64[32];  // the same, ties in index order (V > 1)
  uint32_t res_bin, res_above;
};

// Configurations (threads, 16-byte vectors per thread) of the short-row kernel.
struct RowsCfg {
  int nt, v;
};
constexpr RowsCfg kRowsCfg[] = {{512, 1}, {512, 2}, {512, 4}, {1024, 1}, {1024, 2}};
constexpr int kRowsMaxVecs = 512 * 4;  // the longest row: 16K 16-bit / 8K fp32 values

// The short-row kernel's launcher and kernel attributes (topk_rows.cu), for topk() (topk.cu).
void topk_rows_launch(const TopkArgs& a, TopkDtype dtype, int64_t B, const TopkPlan& plan, cudaStream_t stream);
void topk_rows_set_attributes();

}  // namespace deepfuse::topk_detail
