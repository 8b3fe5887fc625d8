// V4 KV cache kernels (see kvcache.h; formats in python/deepfuse/engine/kv_format.py).
//
// Memory-bound row movers. kv_store and kv_window_copy give one warp to a 512-dim row:
// 32 lanes x 16 values (two 16-byte loads per lane); a warp handles R rows with all loads
// issued before any store, so 2R 16-byte loads are in flight per thread. For the FP8 row,
// lanes 0..27 quantise 16 no-RoPE values each (a 64-value scale group = 4 lanes, amax by
// xor-shuffles over 2 and 1) and store 16 e4m3 bytes; lanes 28..31 move the 64 bf16 RoPE
// values (32 bytes each); lane 0 writes the row's 8 scale bytes in one store.
// indexer_key_store gives 8 lanes to a 128-dim row (4 rows per warp per step).
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

// Destination of row (l, t): byte offset of its page in layer l, and its row; false = skip.
__device__ __forceinline__ bool store_target(const StoreArgs& a, int64_t l, int64_t t,
                                             int64_t& page, int64_t& row) {
  if (a.positions == nullptr) {
    const int64_t slot = ld_idx(a.index, a.index64, l * a.index_layer_ld + t);
    if (slot < 0) return false;
    page = slot / a.page_size;
    row = slot - page * a.page_size;
  } else {
    page = ld_idx(a.index, a.index64, t);
    const int64_t pos = ld_idx(a.positions, a.positions64, t);
    if (page < 0 || pos < 0) return false;
    row = pos % a.window;
  }
  return page < a.num_pages;
}

template <bool FP8, int R>
__global__ void __launch_bounds__(kThreads) kv_store_kernel(const StoreArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * R;
  const int64_t nrows = a.L * a.T;
  uint4 v[R][2];
  int64_t page[R], row[R];
  bool ok[R];
#pragma unroll
  for (int u = 0; u < R; ++u) {
    const int64_t r = first + u;
    ok[u] = r < nrows;
    v[u][0] = v[u][1] = make_uint4(0, 0, 0, 0);
    if (ok[u]) {
      const int64_t l = r / a.T, t = r - l * a.T;
      const __nv_bfloat16* src = a.kv + l * a.kv_layer_ld + t * a.kv_row_ld + lane * 16;
      v[u][0] = ld16(src);
      v[u][1] = ld16(src + 8);
      ok[u] = store_target(a, l, t, page[u], row[u]);
    }
  }
#pragma unroll
  for (int u = 0; u < R; ++u) {
    const int64_t r = first + u;
    uint8_t* pg = nullptr;
    if (ok[u]) pg = a.cache + (r / a.T) * a.cache_layer_ld + page[u] * a.page_bytes;
    if constexpr (FP8) {
      float amax = fmaxf(finite_amax8_bf16(v[u][0]), finite_amax8_bf16(v[u][1]));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      const int e = ue8m0_exponent(amax);
      uint32_t code[7];
#pragma unroll
      for (int g = 0; g < 7; ++g) code[g] = static_cast<uint32_t>(__shfl_sync(0xffffffffu, e, 4 * g) + 127);
      if (!ok[u]) continue;  // warp-uniform
      uint8_t* dst = pg + row[u] * kDataBytes;
      if (lane < 28) {
        st16(dst + lane * 16, quant16(v[u][0], v[u][1], exp2i(-e)));
      } else {
        st16(dst + 448 + (lane - 28) * 32, v[u][0]);
        st16(dst + 448 + (lane - 28) * 32 + 16, v[u][1]);
      }
      if (lane == 0) {
        const uint2 s = make_uint2(code[0] | (code[1] << 8) | (code[2] << 16) | (code[3] << 24),
                                   code[4] | (code[5] << 8) | (code[6] << 16));
        *reinterpret_cast<uint2*>(pg + static_cast<int64_t>(a.page_size) * kDataBytes + row[u] * kScaleBytes) = s;
      }
    } else {
      if (!ok[u]) continue;
      uint8_t* dst = pg + row[u] * kBf16RowBytes + lane * 32;
      st16(dst, v[u][0]);
      st16(dst + 16, v[u][1]);
    }
  }
}

template <int R>
void launch_store(const StoreArgs& a, bool fp8, cudaStream_t stream) {
  const int64_t warps = ceil_div<int64_t>(a.L * a.T, R);
  const int64_t blocks = ceil_div<int64_t>(warps, kWarps);
  if (blocks > 0x7fffffff) throw std::runtime_error("deepfuse: kv_store: too many rows for one launch");
  if (fp8)
    kv_store_kernel<true, R><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  else
    kv_store_kernel<false, R><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
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

// KIND 0: bf16 copy; 1: fp32 scale; 2: power-of-two scale.
template <int KIND, int R>
__global__ void __launch_bounds__(kThreads) indexer_key_store_kernel(const IdxArgs a) {
  const int lane = threadIdx.x & 31, sub = lane >> 3, sl = lane & 7;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * (4 * R);
  const int64_t nrows = a.L * a.T;
  uint4 v[R][2];
  int64_t page[R], row[R], lay[R];
  bool ok[R];
#pragma unroll
  for (int u = 0; u < R; ++u) {
    const int64_t r = first + u * 4 + sub;
    ok[u] = r < nrows;
    v[u][0] = v[u][1] = make_uint4(0, 0, 0, 0);
    lay[u] = 0;
    if (ok[u]) {
      const int64_t l = r / a.T, t = r - l * a.T;
      lay[u] = l;
      const __nv_bfloat16* src = a.k + l * a.k_layer_ld + t * a.k_row_ld + sl * 16;
      v[u][0] = ld16(src);
      v[u][1] = ld16(src + 8);
      const int64_t slot = ld_idx(a.slots, a.slots64, l * a.slots_layer_ld + t);
      page[u] = slot / a.page_size;
      row[u] = slot - page[u] * a.page_size;
      ok[u] = slot >= 0 && page[u] < a.num_pages;
    }
  }
#pragma unroll
  for (int u = 0; u < R; ++u) {
    uint8_t* pg = a.cache + lay[u] * a.cache_layer_ld + (ok[u] ? page[u] : 0) * a.page_bytes;
    if constexpr (KIND == 0) {
      if (!ok[u]) continue;
      uint8_t* dst = pg + row[u] * 256 + sl * 32;
      st16(dst, v[u][0]);
      st16(dst + 16, v[u][1]);
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
      if (!ok[u]) continue;
      st16(pg + row[u] * 128 + sl * 16, quant16(v[u][0], v[u][1], mul));
      if (sl == 0) *reinterpret_cast<float*>(pg + static_cast<int64_t>(a.page_size) * 128 + row[u] * 4) = s;
    }
  }
}

template <int KIND>
void launch_idx(const IdxArgs& a, cudaStream_t stream) {
  constexpr int R = 2;
  const int64_t blocks = ceil_div<int64_t>(a.L * a.T, int64_t(4) * R * kWarps);
  if (blocks > 0x7fffffff) throw std::runtime_error("deepfuse: indexer_key_store: too many rows for one launch");
  indexer_key_store_kernel<KIND, R><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
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

template <KvCopyKind KIND, int R>
__global__ void __launch_bounds__(kThreads) kv_window_copy_kernel(const CopyArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * R;
  const int64_t nrows = a.L * a.B * a.rows;
  uint4 v[R][2];
  uint8_t* dst_row[R];   // dst data row (nullptr: nothing to write)
  uint8_t* dst_scale[R];
  bool have[R];          // source row read
#pragma unroll
  for (int u = 0; u < R; ++u) {
    const int64_t r = first + u;
    dst_row[u] = dst_scale[u] = nullptr;
    have[u] = false;
    v[u][0] = v[u][1] = make_uint4(0, 0, 0, 0);
    if (r >= nrows) continue;
    const int64_t lb = r / a.rows, j = r - lb * a.rows;
    const int64_t l = lb / a.B, b = lb - l * a.B;
    int64_t n = ld_idx(a.lengths, a.lengths64, b);
    n = n < 0 ? 0 : n;
    const int64_t start = n > a.window ? n - a.window : 0;
    const int64_t pos = start + j;
    int64_t soff = 0, srow = 0, doff = 0, drow = 0;
    const bool in_window = pos < n;
    const bool src_ok = in_window && locate(a.src, b, pos, j, a.window, soff, srow);
    const bool dst_ok = (src_ok || a.fill) && locate(a.dst, b, pos, j, a.window, doff, drow);
    if (!dst_ok) continue;
    uint8_t* dpage = static_cast<uint8_t*>(a.dst.base) + l * a.dst.layer_ld + doff;
    const uint8_t* spage = static_cast<const uint8_t*>(a.src.base) + l * a.src.layer_ld + soff;
    if constexpr (KIND == KvCopyKind::kFp8) {
      dst_row[u] = dpage + drow * kDataBytes;
      dst_scale[u] = dpage + static_cast<int64_t>(a.dst.page_size) * kDataBytes + drow * kScaleBytes;
      if (src_ok) {
        const uint8_t* s = spage + srow * kDataBytes;
        v[u][0] = ld16(s + lane * 16);
        if (lane < 4) v[u][1] = ld16(s + 512 + lane * 16);
        if (lane == 4) {
          const uint2 sc = __ldg(reinterpret_cast<const uint2*>(
              spage + static_cast<int64_t>(a.src.page_size) * kDataBytes + srow * kScaleBytes));
          v[u][1] = make_uint4(sc.x, sc.y, 0, 0);
        }
      }
    } else if constexpr (KIND == KvCopyKind::kBf16) {
      dst_row[u] = dpage + drow * kBf16RowBytes;
      if (src_ok) {
        const uint8_t* s = spage + srow * kBf16RowBytes;
        v[u][0] = ld16(s + lane * 16);
        v[u][1] = ld16(s + 512 + lane * 16);
      }
    } else {  // dequantise: v[0] = 16 e4m3 (lanes < 28) or RoPE part 1, v[1].x = scale byte
      dst_row[u] = dpage + drow * kBf16RowBytes;
      if (src_ok) {
        const uint8_t* s = spage + srow * kDataBytes;
        if (lane < 28) {
          v[u][0] = ld16(s + lane * 16);
          v[u][1].x = __ldg(spage + static_cast<int64_t>(a.src.page_size) * kDataBytes + srow * kScaleBytes + (lane >> 2));
        } else {
          v[u][0] = ld16(s + 448 + (lane - 28) * 32);
          v[u][1] = ld16(s + 448 + (lane - 28) * 32 + 16);
        }
      }
    }
    have[u] = src_ok;
  }
#pragma unroll
  for (int u = 0; u < R; ++u) {
    if (dst_row[u] == nullptr) continue;
    if constexpr (KIND == KvCopyKind::kFp8) {
      st16(dst_row[u] + lane * 16, v[u][0]);
      if (lane < 4) st16(dst_row[u] + 512 + lane * 16, v[u][1]);
      if (lane == 4) *reinterpret_cast<uint2*>(dst_scale[u]) = make_uint2(v[u][1].x, v[u][1].y);
    } else if constexpr (KIND == KvCopyKind::kBf16) {
      st16(dst_row[u] + lane * 16, v[u][0]);
      st16(dst_row[u] + 512 + lane * 16, v[u][1]);
    } else {
      uint4 o0 = v[u][0], o1 = v[u][1];
      if (lane < 28) {
        if (have[u]) {
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
      st16(dst_row[u] + lane * 32, o0);
      st16(dst_row[u] + lane * 32 + 16, o1);
    }
  }
}

template <KvCopyKind KIND>
void launch_copy(const CopyArgs& a, cudaStream_t stream) {
  constexpr int R = 2;
  const int64_t blocks = ceil_div<int64_t>(a.L * a.B * a.rows, int64_t(R) * kWarps);
  if (blocks > 0x7fffffff) throw std::runtime_error("deepfuse: kv_window_copy: too many rows for one launch");
  kv_window_copy_kernel<KIND, R><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
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
  // Small launches: one row per warp (more warps); large: two rows per warp in flight.
  if (L * T >= int64_t(num_sms()) * kWarps * 8)
    launch_store<2>(a, fp8, stream);
  else
    launch_store<1>(a, fp8, stream);
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
