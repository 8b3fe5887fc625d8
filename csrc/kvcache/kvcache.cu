// V4 KV cache kernels (see kvcache.h; formats in python/deepfuse/engine/kv_format.py).
//
// Memory-bound row movers. kv_store and kv_window_copy give one warp to a 512-dim row:
// 32 lanes x 16 values. For the FP8 row, lanes 0..27 quantise 16 no-RoPE values each (a
// 64-value scale group = 4 lanes, amax by xor-shuffles over 2 and 1) and store 16 e4m3
// bytes; lanes 28..31 move the 64 bf16 RoPE values (32 bytes each); lane 0 writes the
// row's 8 scale bytes in one store. indexer_key_store gives 8 lanes to a 128-dim row.
// Scheduling (all kernels): see "scheduling" below.
#include "kvcache/kvcache.h"
#include "common/cuda_utils.h"
#include "common/fp8_utils.cuh"

#include <cuda_fp16.h>

namespace deepfuse {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kDataBytes = 576;  // 448 e4m3 + 64 bf16
constexpr int kScaleBytes = 8;
constexpr int kBf16RowBytes = 1024;

__device__ __forceinline__ int64_t ld_idx(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<int64_t>(__ldg(static_cast<const long long*>(p) + i))
              : static_cast<int64_t>(__ldg(static_cast<const int*>(p) + i));
}

__device__ __forceinline__ uint4 ld16(const void* p) { return __ldg(static_cast<const uint4*>(p)); }
__device__ __forceinline__ void st16(void* p, const uint4& v) { *static_cast<uint4*>(p) = v; }

// Sixteen bf16 (two raw 16-byte vectors) times mul, to sixteen e4m3 bytes.
__device__ __forceinline__ uint4 quant16(const uint4& a, const uint4& b, float mul) {
  float v[8], o[8];
  widen8(a, v);
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = v[i] * mul;
  const uint2 lo = to_e4m3x8(o);
  widen8(b, v);
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = v[i] * mul;
  const uint2 hi = to_e4m3x8(o);
  return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

// ------------------------------------------------------------------------- scheduling
// Each warp owns chunks of up to 32 consecutive rows (grid-stride over chunks). Lane k
// resolves row k of its chunk once (divisions, index loads: all rows' index latencies
// overlap); the warp then moves the rows U at a time, all U rows' loads issued before
// any of their stores, with addresses broadcast by shuffles. The host sizes chunks and
// grid so that about kWarpsPerSm warps per SM (4 blocks, <= 64 registers) cover the
// rows in one wave.
constexpr int kMinBlocks = 4;
constexpr int kWarpsPerSm = kMinBlocks * kWarps;

struct Grid {
  unsigned blocks;
  int chunk;
};

// Rows per chunk: at least min_chunk; above `unit` (rows per step), a multiple of it.
Grid plan(int64_t nrows, int unit, int min_chunk) {
  const int64_t target = int64_t(num_sms()) * kWarpsPerSm;
  int64_t chunk = ceil_div<int64_t>(nrows, target);
  if (chunk < min_chunk) chunk = min_chunk;
  if (chunk > unit) chunk = ceil_div<int64_t>(chunk, unit) * unit;
  if (chunk > 32) chunk = 32;
  const int64_t chunks = ceil_div<int64_t>(nrows, chunk);
  int64_t blocks = ceil_div<int64_t>(chunks, kWarps);
  if (blocks > target / kWarps) blocks = target / kWarps;
  if (blocks < 1) blocks = 1;
  return Grid{static_cast<unsigned>(blocks), static_cast<int>(chunk)};
}

template <typename P>
__device__ __forceinline__ P* bcast(P* p, int lane) {
  return reinterpret_cast<P*>(__shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(p), lane));
}

// ------------------------------------------------------------------------------- kv_store
struct StoreArgs {
  const __nv_bfloat16* kv;
  int64_t kv_layer_ld, kv_row_ld, L, T;
  uint8_t* cache;
  int64_t cache_layer_ld, num_pages, page_bytes;
  int page_size;
  const void* index;
  bool index64;
  int64_t index_layer_ld;
  const void* positions;
  bool positions64;
  int window;
};

template <bool FP8, int U>
__global__ void __launch_bounds__(kThreads, kMinBlocks) kv_store_kernel(const StoreArgs a, const int chunk) {
  const int lane = threadIdx.x & 31;
  const int64_t nrows = a.L * a.T;
  const int64_t step = int64_t(gridDim.x) * kWarps * chunk;
  for (int64_t c0 = (int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * chunk; c0 < nrows; c0 += step) {
    const int n = static_cast<int>(nrows - c0 < chunk ? nrows - c0 : chunk);
    // Lane k < n: row c0 + k. Index loads first; they resolve while group 0's data loads fly.
    const __nv_bfloat16* src = a.kv;
    int64_t l = 0, t = 0, i0 = -1, i1 = 0;
    if (lane < n) {
      const int64_t r = c0 + lane;
      l = r / a.T;
      t = r - l * a.T;
      src = a.kv + l * a.kv_layer_ld + t * a.kv_row_ld;
      if (a.positions == nullptr) {
        i0 = ld_idx(a.index, a.index64, l * a.index_layer_ld + t);
      } else {
        i0 = ld_idx(a.index, a.index64, t);
        i1 = ld_idx(a.positions, a.positions64, t);
      }
    }
    uint4 v[U][2];
    auto load = [&](int g) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = g * U + u;
        if (k < n) {  // warp-uniform
          const __nv_bfloat16* s = bcast(src, k) + lane * 16;
          v[u][0] = ld16(s);
          v[u][1] = ld16(s + 8);
        }
      }
    };
    load(0);
    // Destination of row c0 + lane (nullptr: skip), as store_target defined it.
    uint8_t* dst = nullptr;
    uint8_t* dsc = nullptr;
    if (lane < n) {
      int64_t page = -1, row = 0;
      if (a.positions == nullptr) {
        if (i0 >= 0) {
          page = i0 / a.page_size;
          row = i0 - page * a.page_size;
        }
      } else if (i0 >= 0 && i1 >= 0) {
        page = i0;
        row = i1 % a.window;
      }
      if (page >= 0 && page < a.num_pages) {
        uint8_t* pg = a.cache + l * a.cache_layer_ld + page * a.page_bytes;
        dst = pg + row * (FP8 ? kDataBytes : kBf16RowBytes);
        dsc = pg + static_cast<int64_t>(a.page_size) * kDataBytes + row * kScaleBytes;
      }
    }
    for (int g = 0;;) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = g * U + u;
        if (k >= n) break;
        uint8_t* d = bcast(dst, k);
        if constexpr (FP8) {
          uint8_t* ds = bcast(dsc, k);
          if (d == nullptr) continue;  // warp-uniform
          float amax = fmaxf(finite_amax8_bf16(v[u][0]), finite_amax8_bf16(v[u][1]));
          amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
          amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
          const int e = ue8m0_exponent(amax);
          if (lane < 28) {
            st16(d + lane * 16, quant16(v[u][0], v[u][1], exp2i(-e)));
          } else {
            st16(d + 448 + (lane - 28) * 32, v[u][0]);
            st16(d + 448 + (lane - 28) * 32 + 16, v[u][1]);
          }
          // Scale byte of group q = lane / 4 (lanes < 28) at byte q % 4 of word q / 4:
          // OR over lanes 0,4,8,12 gives word 0 in lane 0, over 16,20,24 word 1 in lane 16.
          uint32_t c = lane < 28 ? static_cast<uint32_t>(e + 127) << (8 * ((lane >> 2) & 3)) : 0u;
          c |= __shfl_xor_sync(0xffffffffu, c, 4);
          c |= __shfl_xor_sync(0xffffffffu, c, 8);
          const uint32_t hi = __shfl_sync(0xffffffffu, c, 16);
          if (lane == 0) *reinterpret_cast<uint2*>(ds) = make_uint2(c, hi);
        } else {
          if (d == nullptr) continue;
          st16(d + lane * 32, v[u][0]);
          st16(d + lane * 32 + 16, v[u][1]);
        }
      }
      if (++g * U >= n) break;
      load(g);
    }
  }
}

constexpr int kStoreRows = 3;  // rows in flight per warp

template <int U>
void launch_store(const StoreArgs& a, bool fp8, cudaStream_t stream) {
  const Grid gr = plan(a.L * a.T, U, 1);
  if (fp8)
    kv_store_kernel<true, U><<<gr.blocks, kThreads, 0, stream>>>(a, gr.chunk);
  else
    kv_store_kernel<false, U><<<gr.blocks, kThreads, 0, stream>>>(a, gr.chunk);
}

// ------------------------------------------------------------------------ indexer keys
struct IdxArgs {
  const __nv_bfloat16* k;
  int64_t k_layer_ld, k_row_ld, L, T;
  uint8_t* cache;
  int64_t cache_layer_ld, num_pages, page_bytes;
  int page_size;
  const void* slots;
  bool slots64;
  int64_t slots_layer_ld;
};

// KIND 0: bf16 copy; 1: fp32 scale; 2: power-of-two scale. Eight lanes per 128-dim row,
// four rows per warp step, U steps (4U rows) in flight; chunks are multiples of 4 rows.
template <int KIND, int U>
__global__ void __launch_bounds__(kThreads, kMinBlocks) indexer_key_store_kernel(const IdxArgs a, const int chunk) {
  const int lane = threadIdx.x & 31, sub = lane >> 3, sl = lane & 7;
  const int64_t nrows = a.L * a.T;
  const int64_t step = int64_t(gridDim.x) * kWarps * chunk;
  for (int64_t c0 = (int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * chunk; c0 < nrows; c0 += step) {
    const int n = static_cast<int>(nrows - c0 < chunk ? nrows - c0 : chunk);
    const __nv_bfloat16* src = a.k;
    int64_t l = 0, slot = -1;
    if (lane < n) {
      const int64_t r = c0 + lane;
      l = r / a.T;
      const int64_t t = r - l * a.T;
      src = a.k + l * a.k_layer_ld + t * a.k_row_ld;
      slot = ld_idx(a.slots, a.slots64, l * a.slots_layer_ld + t);
    }
    uint4 v[U][2];
    auto load = [&](int g) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = (g * U + u) * 4 + sub;
        const __nv_bfloat16* s = bcast(src, k & 31) + sl * 16;
        if (k < n) {
          v[u][0] = ld16(s);
          v[u][1] = ld16(s + 8);
        } else {
          v[u][0] = v[u][1] = make_uint4(0, 0, 0, 0);
        }
      }
    };
    load(0);
    uint8_t* pg = nullptr;  // page of row c0 + lane (nullptr: skip)
    int64_t row = 0;
    if (slot >= 0) {
      const int64_t page = slot / a.page_size;
      row = slot - page * a.page_size;
      if (page < a.num_pages) pg = a.cache + l * a.cache_layer_ld + page * a.page_bytes;
    }
    for (int g = 0;;) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = ((g * U + u) * 4 + sub) & 31;
        uint8_t* p = bcast(pg, k);
        const int64_t rw = __shfl_sync(0xffffffffu, row, k);
        if constexpr (KIND == 0) {
          if (p != nullptr) {  // uniform over the row's 8 lanes
            uint8_t* dst = p + rw * 256 + sl * 32;
            st16(dst, v[u][0]);
            st16(dst + 16, v[u][1]);
          }
        } else {
          float amax = fmaxf(finite_amax8_bf16(v[u][0]), finite_amax8_bf16(v[u][1]));
#pragma unroll
          for (int off = 4; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
          float s, mul;
          if constexpr (KIND == 1) {
            s = fp32_scale(amax);
            mul = 1.0f / s;
          } else {
            const int e = ue8m0_exponent(amax);
            s = exp2i(e);
            mul = exp2i(-e);
          }
          if (p != nullptr) {
            st16(p + rw * 128 + sl * 16, quant16(v[u][0], v[u][1], mul));
            if (sl == 0) *reinterpret_cast<float*>(p + static_cast<int64_t>(a.page_size) * 128 + rw * 4) = s;
          }
        }
      }
      if (++g * U * 4 >= n) break;
      load(g);
    }
  }
}

template <int KIND>
void launch_idx(const IdxArgs& a, cudaStream_t stream) {
  constexpr int U = 2;
  const Grid gr = plan(a.L * a.T, 4 * U, 4);
  indexer_key_store_kernel<KIND, U><<<gr.blocks, kThreads, 0, stream>>>(a, gr.chunk);
}

// ------------------------------------------------------------------------- window copy
struct CopyArgs {
  KvSide src, dst;
  const void* lengths;
  bool lengths64;
  int64_t L, B;
  int window, rows;
  bool fill;
};

// Page byte offset (within the layer) and row of window row j (position pos) of request b.
__device__ __forceinline__ bool locate(const KvSide& s, int64_t b, int64_t pos, int64_t j, int window,
                                       int64_t& page_off, int64_t& row) {
  int64_t page;
  if (s.mode == 2) {
    page = b;
    row = j;
  } else if (s.mode == 0) {
    page = ld_idx(s.index, s.index64, b);
    row = pos % window;
  } else {
    const int64_t col = pos / s.page_size;
    if (col >= s.index_cols) return false;
    page = ld_idx(s.index, s.index64, b * s.index_ld + col);
    row = pos - col * s.page_size;
  }
  page_off = page * s.page_bytes;
  return page >= 0 && page < s.num_pages;
}

template <KvCopyKind KIND, int U>
__global__ void __launch_bounds__(kThreads, kMinBlocks) kv_window_copy_kernel(const CopyArgs a, const int chunk) {
  const int lane = threadIdx.x & 31;
  const int64_t nrows = a.L * a.B * a.rows;
  const int64_t step = int64_t(gridDim.x) * kWarps * chunk;
  constexpr int kSrcRow = KIND == KvCopyKind::kBf16 ? kBf16RowBytes : kDataBytes;
  constexpr int kDstRow = KIND == KvCopyKind::kFp8 ? kDataBytes : kBf16RowBytes;
  for (int64_t c0 = (int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * chunk; c0 < nrows; c0 += step) {
    const int n = static_cast<int>(nrows - c0 < chunk ? nrows - c0 : chunk);
    // Lane k < n locates row c0 + k on both sides. nullptr: no source / nothing to write.
    const uint8_t* sp = nullptr;
    const uint8_t* ssc = nullptr;
    uint8_t* dp = nullptr;
    uint8_t* dsc = nullptr;
    if (lane < n) {
      const int64_t r = c0 + lane;
      const int64_t lb = r / a.rows, j = r - lb * a.rows;
      const int64_t l = lb / a.B, b = lb - l * a.B;
      int64_t len = ld_idx(a.lengths, a.lengths64, b);
      len = len < 0 ? 0 : len;
      const int64_t start = len > a.window ? len - a.window : 0;
      const int64_t pos = start + j;
      int64_t soff = 0, srow = 0, doff = 0, drow = 0;
      const bool in_window = pos < len;
      const bool src_ok = in_window && locate(a.src, b, pos, j, a.window, soff, srow);
      const bool dst_ok = (src_ok || a.fill) && locate(a.dst, b, pos, j, a.window, doff, drow);
      if (dst_ok) {
        uint8_t* dpage = static_cast<uint8_t*>(a.dst.base) + l * a.dst.layer_ld + doff;
        dp = dpage + drow * kDstRow;
        dsc = dpage + static_cast<int64_t>(a.dst.page_size) * kDataBytes + drow * kScaleBytes;
        if (src_ok) {
          const uint8_t* spage = static_cast<const uint8_t*>(a.src.base) + l * a.src.layer_ld + soff;
          sp = spage + srow * kSrcRow;
          ssc = spage + static_cast<int64_t>(a.src.page_size) * kDataBytes + srow * kScaleBytes;
        }
      }
    }
    uint4 v[U][2];
    for (int g = 0; g * U < n; ++g) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = g * U + u;
        v[u][0] = v[u][1] = make_uint4(0, 0, 0, 0);
        if (k >= n) break;  // warp-uniform
        const uint8_t* s = bcast(sp, k);
        if (s == nullptr) continue;
        if constexpr (KIND == KvCopyKind::kFp8) {
          const uint8_t* ss = bcast(ssc, k);
          v[u][0] = ld16(s + lane * 16);
          if (lane < 4) v[u][1] = ld16(s + 512 + lane * 16);
          if (lane == 4) {
            const uint2 sc = __ldg(reinterpret_cast<const uint2*>(ss));
            v[u][1] = make_uint4(sc.x, sc.y, 0, 0);
          }
        } else if constexpr (KIND == KvCopyKind::kBf16) {
          v[u][0] = ld16(s + lane * 16);
          v[u][1] = ld16(s + 512 + lane * 16);
        } else {  // v[0] = 16 e4m3 (lanes < 28) or RoPE part 1, v[1].x = scale byte
          const uint8_t* ss = bcast(ssc, k);
          if (lane < 28) {
            v[u][0] = ld16(s + lane * 16);
            v[u][1].x = __ldg(ss + (lane >> 2));
          } else {
            v[u][0] = ld16(s + 448 + (lane - 28) * 32);
            v[u][1] = ld16(s + 448 + (lane - 28) * 32 + 16);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = g * U + u;
        if (k >= n) break;
        uint8_t* d = bcast(dp, k);
        if constexpr (KIND == KvCopyKind::kFp8) {
          uint8_t* ds = bcast(dsc, k);
          if (d == nullptr) continue;
          st16(d + lane * 16, v[u][0]);
          if (lane < 4) st16(d + 512 + lane * 16, v[u][1]);
          if (lane == 4) *reinterpret_cast<uint2*>(ds) = make_uint2(v[u][1].x, v[u][1].y);
        } else if constexpr (KIND == KvCopyKind::kBf16) {
          if (d == nullptr) continue;
          st16(d + lane * 16, v[u][0]);
          st16(d + 512 + lane * 16, v[u][1]);
        } else {
          const bool have = bcast(sp, k) != nullptr;
          if (d == nullptr) continue;
          uint4 o0 = v[u][0], o1 = v[u][1];
          if (lane < 28) {
            if (have) {
              const float mul = exp2i(static_cast<int>(v[u][1].x) - 127);
              const uint32_t w[4] = {v[u][0].x, v[u][0].y, v[u][0].z, v[u][0].w};
              uint32_t out[8];
#pragma unroll
              for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                  const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(
                      static_cast<__nv_fp8x2_storage_t>((w[i] >> (16 * h)) & 0xffffu), __NV_E4M3);
                  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&hr));
                  const __nv_bfloat162 bb = __floats2bfloat162_rn(f.x * mul, f.y * mul);
                  out[2 * i + h] = *reinterpret_cast<const uint32_t*>(&bb);
                }
              }
              o0 = make_uint4(out[0], out[1], out[2], out[3]);
              o1 = make_uint4(out[4], out[5], out[6], out[7]);
            } else {
              o1 = make_uint4(0, 0, 0, 0);
            }
          }
          st16(d + lane * 32, o0);
          st16(d + lane * 32 + 16, o1);
        }
      }
    }
  }
}

template <KvCopyKind KIND>
void launch_copy(const CopyArgs& a, cudaStream_t stream) {
  constexpr int U = 4;
  const Grid gr = plan(a.L * a.B * a.rows, U, 1);
  kv_window_copy_kernel<KIND, U><<<gr.blocks, kThreads, 0, stream>>>(a, gr.chunk);
}

}  // namespace

void kv_store(const void* kv, int64_t kv_layer_ld, int64_t kv_row_ld, int64_t L, int64_t T,
              void* cache, int64_t cache_layer_ld, int64_t num_pages, int64_t page_bytes,
              int page_size, bool fp8, const void* index, bool index64, int64_t index_layer_ld,
              const void* positions, bool positions64, int window, cudaStream_t stream) {
  if (L <= 0 || T <= 0) return;
  if (page_size <= 0 || (positions != nullptr && window <= 0))
    throw std::invalid_argument("deepfuse: kv_store: page_size and window must be positive");
  const StoreArgs a{static_cast<const __nv_bfloat16*>(kv), kv_layer_ld, kv_row_ld, L, T,
                    static_cast<uint8_t*>(cache), cache_layer_ld, num_pages, page_bytes, page_size,
                    index, index64, index_layer_ld, positions, positions64, window};
  launch_store<kStoreRows>(a, fp8, stream);
  check_launch("kv_store");
}

void indexer_key_store(const void* k, int64_t k_layer_ld, int64_t k_row_ld, int64_t L, int64_t T,
                       void* cache, int64_t cache_layer_ld, int64_t num_pages, int64_t page_bytes,
                       int page_size, int kind, const void* slots, bool slots64,
                       int64_t slots_layer_ld, cudaStream_t stream) {
  if (L <= 0 || T <= 0) return;
  if (page_size <= 0) throw std::invalid_argument("deepfuse: indexer_key_store: page_size must be positive");
  const IdxArgs a{static_cast<const __nv_bfloat16*>(k), k_layer_ld, k_row_ld, L, T,
                  static_cast<uint8_t*>(cache), cache_layer_ld, num_pages, page_bytes, page_size,
                  slots, slots64, slots_layer_ld};
  switch (kind) {
    case 0: launch_idx<0>(a, stream); break;
    case 1: launch_idx<1>(a, stream); break;
    case 2: launch_idx<2>(a, stream); break;
    default: throw std::invalid_argument("deepfuse: indexer_key_store: kind must be 0, 1 or 2");
  }
  check_launch("indexer_key_store");
}

void kv_window_copy(const KvSide& src, const KvSide& dst, const void* lengths, bool lengths64,
                    int64_t L, int64_t B, int window, int rows, KvCopyKind kind, bool fill_missing,
                    cudaStream_t stream) {
  if (L <= 0 || B <= 0 || rows <= 0) return;
  if (window <= 0) throw std::invalid_argument("deepfuse: kv_window_copy: window must be positive");
  if (src.page_size <= 0 || dst.page_size <= 0)
    throw std::invalid_argument("deepfuse: kv_window_copy: page sizes must be positive");
  const CopyArgs a{src, dst, lengths, lengths64, L, B, window, rows, fill_missing};
  switch (kind) {
    case KvCopyKind::kFp8: launch_copy<KvCopyKind::kFp8>(a, stream); break;
    case KvCopyKind::kBf16: launch_copy<KvCopyKind::kBf16>(a, stream); break;
    case KvCopyKind::kFp8ToBf16: launch_copy<KvCopyKind::kFp8ToBf16>(a, stream); break;
    default: throw std::invalid_argument("deepfuse: kv_window_copy: bad kind");
  }
  check_launch("kv_window_copy");
}

}  // namespace deepfuse
