// indexer_logits_paged (indexer.h) on archs other than sm_90a (there: indexer_logits_wgmma.cu,
// FP8 wgmma): one CTA per (group of G <= 4 consecutive tokens, run of
// 64-entry tiles). Warp w owns heads [16 w, 16 w + 16): the q (fp16) of the group's tokens stays
// in registers as MMA B fragments; the keys of a tile (64 rows of 128 e4m3) are gathered from
// their pages into shared memory with cp.async (double-buffered, 16-byte chunks XOR-swizzled per
// row), widened to fp16 A fragments once per warp and tile, and m16n8k16 MMAs (fp32 accumulate)
// give each token's [64 entries x 16 heads] dot products. ReLU, the head weights and the sum over
// heads follow in registers and through shared memory. Tokens of one request (decode with
// drafts, prefill) share every tile; a group spanning requests runs its tokens one at a time.
// The K dimension of each MMA is a permutation of the dims (thread t of a quad covers dims
// [32 t, 32 t + 32) over the 8 k-steps), the same for A and B, so the dot products are exact;
// a token's MMAs and sums run in the same order whatever its group, so G changes no bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <stdexcept>
#include <string>

#include "common/cuda_utils.h"
#include "indexer/indexer.h"

namespace deepfuse {
namespace {

constexpr int kThreads = 128;
constexpr int kTile = 64;  // entries per tile
constexpr int kRowBytes = kIndexerDim;

struct Args {
  const __nv_bfloat16* q;
  const float* weights;
  const uint8_t* pages;
  int64_t page_bytes, num_pages;
  int page_size;
  const int64_t* entry_slots;
  int64_t slots_ld;
  const int64_t* token_req;
  const int32_t* n_vis;
  int C;
  float scale;
  float* out;
  int64_t N;
  int tiles_per_cta;
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool ok) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 4 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t w) {
  __nv_bfloat162 b = *reinterpret_cast<__nv_bfloat162*>(&w);
  __half2 h = __float22half2_rn(__bfloat1622float2(b));
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Shared memory of a CTA of up to G rows: a double-buffered key tile and its scales, and the
// per-warp partial sums of each row.
template <int G>
struct Smem {
  alignas(128) uint8_t keys[2][kTile * kRowBytes];
  float kscale[2][kTile];
  float red[2][G][4][kTile];
};

// Rows n0 .. n0 + R - 1 (all of request `req`) against entries [e_begin, e_end): each key tile
// is gathered and widened once for the R rows. Row r's MMAs, ReLU, weights and sums run in the
// same order as for one row alone, so its results do not depend on R. A row writes -inf from
// its own n_vis on.
template <int R, int G>
__device__ __forceinline__ void rows_pass(const Args& a, Smem<G>& sm, int64_t n0, int64_t req, int e_begin,
                                          int e_end) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  int live[R];
  int live_end = e_begin;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int nv = min(__ldg(a.n_vis + n0 + r), a.C);
    float* orow = a.out + (n0 + r) * a.C;
    for (int e = max(e_begin, nv) + tid; e < e_end; e += kThreads) orow[e] = -INFINITY;
    live[r] = min(e_end, nv);
    live_end = max(live_end, live[r]);
  }
  if (e_begin >= live_end) return;  // uniform over the CTA
  const int64_t* srow = a.entry_slots + req * a.slots_ld;

  auto load_tile = [&](int stage, int e0) {
#pragma unroll
    for (int k = 0; k < (kTile * kRowBytes / 16) / kThreads; ++k) {
      const int idx = tid + kThreads * k, row = idx >> 3, ch = idx & 7, e = e0 + row;
      const int64_t slot = e < live_end ? __ldg(srow + e) : -1;
      const int64_t page = slot >= 0 ? slot / a.page_size : 0;
      const bool ok = slot >= 0 && page < a.num_pages;
      const uint8_t* src = ok ? a.pages + page * a.page_bytes + (slot - page * a.page_size) * kRowBytes + ch * 16
                              : a.pages;
      cp_async16(&sm.keys[stage][row * kRowBytes + ((ch ^ (row & 7)) << 4)], src, ok);
      if (ch == 0) {
        const uint8_t* ssrc = ok ? a.pages + page * a.page_bytes + int64_t(a.page_size) * kRowBytes +
                                       (slot - page * a.page_size) * 4
                                 : a.pages;
        cp_async4(&sm.kscale[stage][row], ssrc, ok);
      }
    }
    cp_commit();
  };

  const int ntiles = (live_end - e_begin + kTile - 1) / kTile;
  load_tile(0, e_begin);

  // B fragments: q of row r, heads 16 warp + 8 nt + g, dims [32 t, 32 t + 32), as fp16 pairs.
  uint32_t qf[R][2][16];
  float wv[R][2][2];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int h = 16 * warp + 8 * nt + g;
      const uint4* qp = reinterpret_cast<const uint4*>(a.q + ((n0 + r) * kIndexerHeads + h) * kIndexerDim + 32 * t);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint4 v = __ldg(qp + c);
#pragma unroll
        for (int i = 0; i < 4; ++i) qf[r][nt][4 * c + i] = bf16x2_to_f16x2(word(v, i));
      }
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wv[r][nt][j] = __ldg(a.weights + (n0 + r) * kIndexerHeads + 16 * warp + 8 * nt + 2 * t + j);
    }
  }

  for (int it = 0; it < ntiles; ++it) {
    const int st = it & 1, e0 = e_begin + it * kTile;
    if (it + 1 < ntiles) {
      load_tile(st ^ 1, e0 + kTile);
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    const uint8_t* ks = sm.keys[st];
#pragma unroll
    for (int mt = 0; mt < kTile / 16; ++mt) {
      const int r0 = mt * 16 + g, r1 = r0 + 8;
      const uint4 a0 = *reinterpret_cast<const uint4*>(ks + r0 * kRowBytes + (((2 * t) ^ (r0 & 7)) << 4));
      const uint4 a1 = *reinterpret_cast<const uint4*>(ks + r0 * kRowBytes + (((2 * t + 1) ^ (r0 & 7)) << 4));
      const uint4 b0 = *reinterpret_cast<const uint4*>(ks + r1 * kRowBytes + (((2 * t) ^ (r1 & 7)) << 4));
      const uint4 b1 = *reinterpret_cast<const uint4*>(ks + r1 * kRowBytes + (((2 * t + 1) ^ (r1 & 7)) << 4));
      float acc[R][2][4] = {};
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        const uint32_t wa = s < 4 ? word(a0, s) : word(a1, s - 4);  // row r0, dims 32 t + 4 s .. + 3
        const uint32_t wb = s < 4 ? word(b0, s) : word(b1, s - 4);  // row r1
        const uint32_t x0 = e4m3x2_to_f16x2(wa), x1 = e4m3x2_to_f16x2(wb);
        const uint32_t x2 = e4m3x2_to_f16x2(wa >> 16), x3 = e4m3x2_to_f16x2(wb >> 16);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) mma_f16(acc[r][nt], x0, x1, x2, x3, qf[r][nt][2 * s], qf[r][nt][2 * s + 1]);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float p0 = 0.0f, p1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          p0 += wv[r][nt][0] * fmaxf(acc[r][nt][0], 0.0f) + wv[r][nt][1] * fmaxf(acc[r][nt][1], 0.0f);
          p1 += wv[r][nt][0] * fmaxf(acc[r][nt][2], 0.0f) + wv[r][nt][1] * fmaxf(acc[r][nt][3], 0.0f);
        }
        p0 += __shfl_xor_sync(0xffffffffu, p0, 1);
        p0 += __shfl_xor_sync(0xffffffffu, p0, 2);
        p1 += __shfl_xor_sync(0xffffffffu, p1, 1);
        p1 += __shfl_xor_sync(0xffffffffu, p1, 2);
        if (t == 0) {
          sm.red[st][r][warp][r0] = p0;
          sm.red[st][r][warp][r1] = p1;
        }
      }
    }
    // Read before the barrier: past it, the next tile's copies may overwrite this stage.
    const float ksc = sm.kscale[st][tid % kTile];
    __syncthreads();
    const int c = tid % kTile, e = e0 + c;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if ((r & 1) == tid / kTile && e < live[r]) {  // threads [0, 64) even rows, [64, 128) odd
        const float sum = (sm.red[st][r][0][c] + sm.red[st][r][1][c]) + (sm.red[st][r][2][c] + sm.red[st][r][3][c]);
        a.out[(n0 + r) * a.C + e] = a.scale * ksc * sum;
      }
    }
  }
}

// One CTA per (group of G consecutive rows, run of tiles_per_cta tiles). A group whose rows all
// belong to one request shares every key tile; any other group runs its rows one at a time.
template <int G>
__global__ void __launch_bounds__(kThreads) indexer_logits_kernel(const Args a) {
  __shared__ Smem<G> sm;
  const int64_t n0 = int64_t(blockIdx.x) * G;
  const int rows = a.N - n0 < G ? static_cast<int>(a.N - n0) : G;
  const int e_begin = blockIdx.y * a.tiles_per_cta * kTile;
  const int e_end = min(a.C, e_begin + a.tiles_per_cta * kTile);
  const int64_t req = __ldg(a.token_req + n0);
  bool shared = rows == G;
  if constexpr (G > 1) {
#pragma unroll
    for (int r = 1; r < G; ++r) shared = shared && (r >= rows || __ldg(a.token_req + n0 + r) == req);
  }
  if (shared) {
    rows_pass<G>(a, sm, n0, req, e_begin, e_end);
  } else {
    for (int r = 0; r < rows; ++r) {
      if (r) __syncthreads();
      rows_pass<1>(a, sm, n0 + r, __ldg(a.token_req + n0 + r), e_begin, e_end);
    }
  }
}

}  // namespace

int indexer_rows_per_cta(int64_t N, int64_t num_reqs) {
  if (num_reqs <= 0 || N < 2 * num_reqs) return 1;
  if (N % num_reqs != 0) return 4;  // tokens per request vary: groups inside a request share, others fall back
  const int64_t per = N / num_reqs;
  return per % 4 == 0 ? 4 : per % 3 == 0 ? 3 : per % 2 == 0 ? 2 : 4;
}

namespace {
template <int G>
void launch(const Args& a, int64_t N, int C, cudaStream_t stream) {
  const int64_t groups = ceil_div<int64_t>(N, G);
  const int64_t tiles = ceil_div<int64_t>(C, kTile);
  // CTAs for one to two waves: 8 per SM for single tokens (5 resident), 2 waves of the resident
  // count for groups (their q fills the register file: 2-3 CTAs per SM).
  static const int resident = [] {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, indexer_logits_kernel<G>, kThreads, 0) != cudaSuccess) {
      (void)cudaGetLastError();  // not the launch's error
      n = 0;
    }
    return n > 0 ? n : 1;
  }();
  const int64_t target = int64_t(num_sms()) * (G == 1 ? 8 : 2 * resident);
  int per = static_cast<int>(ceil_div<int64_t>(groups * tiles, target));
  per = per < 1 ? 1 : per > 16 ? 16 : per;
  const int64_t splits = ceil_div<int64_t>(tiles, per);
  Args b = a;
  b.tiles_per_cta = per;
  indexer_logits_kernel<G><<<dim3(static_cast<unsigned>(groups), static_cast<unsigned>(splits)), kThreads, 0,
                             stream>>>(b);
  check_launch("indexer_logits_kernel");
}
}  // namespace

void indexer_logits_paged(const void* q, int H, int q_terms, const float* weights, const uint8_t* pages,
                          int64_t page_bytes, int64_t num_pages, int page_size, const int64_t* entry_slots,
                          int64_t slots_ld, int64_t num_reqs, const int64_t* token_req, const int32_t* n_vis,
                          int64_t N, int C, float scale, float* out, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  if (device_cc() == 90) {
    indexer_logits_paged_wgmma(q, H, q_terms, weights, pages, page_bytes, num_pages, page_size, entry_slots,
                               slots_ld, num_reqs, token_req, n_vis, N, C, scale, out, stream);
    return;
  }
  if (H != kIndexerHeads || q_terms != 2)
    throw std::invalid_argument("deepfuse: indexer_logits_paged: no kernel for H " + std::to_string(H) +
                                ", q_fp8 on sm_" + std::to_string(device_cc()) + " (sm_90a only)");
  if (N > 0x7fffffff) throw std::invalid_argument("deepfuse: indexer_logits_paged: too many tokens");
  const Args a{static_cast<const __nv_bfloat16*>(q), weights, pages, page_bytes, num_pages, page_size, entry_slots,
               slots_ld, token_req, n_vis, C, scale, out, N, 1};
  switch (indexer_rows_per_cta(N, num_reqs)) {
    case 4: launch<4>(a, N, C, stream); break;
    case 3: launch<3>(a, N, C, stream); break;
    case 2: launch<2>(a, N, C, stream); break;
    default: launch<1>(a, N, C, stream); break;
  }
}

}  // namespace deepfuse
