// Shared by the top-k kernels (topk_kernel.cuh, topk_rows_kernel.cuh): order-preserving keys
// per dtype, streaming loads, element access within a 16-byte vector, output slots, a bitonic sort.
// Keys are the op's order exactly: -0.0 gets +0.0's key (equal values, equal keys), so ties
// (broken by the lower index: deepfuse/ops/topk.py) are ties of keys. A key of +0.0 or NaN
// does not give back its raw bits (Fmt::raw): those are read again.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace deepfuse {
namespace {

constexpr unsigned kFull = 0xffffffffu;

// 8-bit mask from four words of two 16-bit lane masks (0xFFFF or 0 each): bit 2w + h is
// half h of word w. One byte of each half (byte_perm), then one bit per byte (a multiply
// sums the bytes' distinct bits into the top byte).
__device__ __forceinline__ uint32_t pack_halves(uint32_t m0, uint32_t m1, uint32_t m2, uint32_t m3) {
  const uint32_t lo = __byte_perm(m0, m1, 0x6420) & 0x08040201u;
  const uint32_t hi = __byte_perm(m2, m3, 0x6420) & 0x08040201u;
  return ((lo * 0x01010101u) >> 24) | (((hi * 0x01010101u) >> 24) << 4);
}

// 8-bit mask of the elements of v not below t2 (bf16x2 or half2 pairs; NaN counts as not
// below): one packed compare per word.
template <class H2>
__device__ __forceinline__ uint32_t ge_mask_pairs(const uint4& v, H2 t2) {
  auto as2 = [](uint32_t w) {
    H2 h;
    memcpy(&h, &w, 4);
    return h;
  };
  return pack_halves(__hgeu2_mask(as2(v.x), t2), __hgeu2_mask(as2(v.y), t2), __hgeu2_mask(as2(v.z), t2),
                     __hgeu2_mask(as2(v.w), t2));
}

template <int FMT>
struct Fmt;
// 16-bit floats, given the bits of +inf: keys, their inverse and the key constants.
template <uint32_t PosInf>
struct Fmt16 {
  using Raw = uint16_t;
  static constexpr int kBits = 16;
  static constexpr uint32_t kNegInf = PosInf | 0x8000u;
  static constexpr uint32_t kKeyNegInf = ~kNegInf & 0xFFFFu, kKeyPosInf = PosInf ^ 0x8000u, kKeyNaN = 0xFFFFu;
  static constexpr uint32_t kKeyZero = 0x8000u;  // +0.0 and -0.0
  static constexpr uint32_t kNaNAbove = PosInf;  // |bits| above this: NaN
  __device__ __forceinline__ static uint32_t key(uint32_t r) {
    r = r == 0x8000u ? 0u : r;
    const uint32_t k = r ^ ((r & 0x8000u) ? 0xFFFFu : 0x8000u);
    return (r & 0x7FFFu) > kNaNAbove ? 0xFFFFu : k;
  }
  // The bits of a non-NaN key.
  __device__ __forceinline__ static uint32_t raw(uint32_t k) { return k ^ ((k & 0x8000u) ? 0x8000u : 0xFFFFu); }
};
template <>
struct Fmt<0> : Fmt16<0x7F80u> {  // bf16
  __device__ __forceinline__ static float to_float(uint32_t r) { return __uint_as_float(r << 16); }
  // Bit i: element i of v is not below t (NaN included; t a bf16 value).
  __device__ __forceinline__ static uint32_t ge_mask(const uint4& v, float t) {
    return ge_mask_pairs(v, __float2bfloat162_rn(t));
  }
};
template <>
struct Fmt<1> : Fmt16<0x7C00u> {  // fp16
  __device__ __forceinline__ static float to_float(uint32_t r) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(r)));
  }
  __device__ __forceinline__ static uint32_t ge_mask(const uint4& v, float t) {
    return ge_mask_pairs(v, __float2half2_rn(t));
  }
};
static_assert(Fmt<0>::kNegInf == 0xFF80u && Fmt<0>::kKeyNegInf == 0x007Fu && Fmt<0>::kKeyPosInf == 0xFF80u, "bf16");
static_assert(Fmt<1>::kNegInf == 0xFC00u && Fmt<1>::kKeyNegInf == 0x03FFu && Fmt<1>::kKeyPosInf == 0xFC00u, "fp16");
template <>
struct Fmt<2> {  // fp32
  using Raw = uint32_t;
  static constexpr int kBits = 32;
  static constexpr uint32_t kNegInf = 0xFF800000u;
  static constexpr uint32_t kKeyNegInf = 0x007FFFFFu, kKeyPosInf = 0xFF800000u, kKeyNaN = 0xFFFFFFFFu;
  static constexpr uint32_t kKeyZero = 0x80000000u;
  __device__ __forceinline__ static uint32_t key(uint32_t r) {
    r = r == 0x80000000u ? 0u : r;
    const uint32_t k = r ^ ((r & 0x80000000u) ? 0xFFFFFFFFu : 0x80000000u);
    return (r & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFFFFFFu : k;
  }
  __device__ __forceinline__ static uint32_t raw(uint32_t k) {
    return k ^ ((k & 0x80000000u) ? 0x80000000u : 0xFFFFFFFFu);
  }
  __device__ __forceinline__ static float to_float(uint32_t r) { return __uint_as_float(r); }
  __device__ __forceinline__ static uint32_t ge_mask(const uint4& v, float t) {
    return static_cast<uint32_t>(!(__uint_as_float(v.x) < t)) |
           static_cast<uint32_t>(!(__uint_as_float(v.y) < t)) << 1 |
           static_cast<uint32_t>(!(__uint_as_float(v.z) < t)) << 2 |
           static_cast<uint32_t>(!(__uint_as_float(v.w) < t)) << 3;
  }
};

// 16 bytes read once: no L1 allocation.
__device__ __forceinline__ uint4 ld_stream(const void* a) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(a));
  return v;
}

// Element i of a 16-byte vector of raw values (i a compile-time constant after unrolling).
template <int VEC>
__device__ __forceinline__ uint32_t elem(const uint4& v, int i) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  if constexpr (VEC == 8) {
    return (w[i >> 1] >> ((i & 1) * 16)) & 0xFFFFu;
  } else {
    return w[i];
  }
}

// Element i of a 16-byte vector, i known only at run time (selects, no local memory).
template <int VEC>
__device__ __forceinline__ uint32_t elem_dyn(const uint4& v, int i) {
  if constexpr (VEC == 8) {
    const uint32_t w = (i & 4) ? ((i & 2) ? v.w : v.z) : ((i & 2) ? v.y : v.x);
    return (i & 1) ? (w >> 16) : (w & 0xFFFFu);
  } else {
    return (i & 2) ? ((i & 1) ? v.w : v.z) : ((i & 1) ? v.y : v.x);
  }
}

// A sorted pair: key above, then the complemented index, so that a descending sort puts
// equal keys in ascending index order. Every real pair is above 0 (key(-inf) > 0).
__device__ __forceinline__ unsigned long long sort_pair(uint32_t key, int e) {
  return (static_cast<unsigned long long>(key) << 32) | ~static_cast<uint32_t>(e);
}
__device__ __forceinline__ int pair_index(unsigned long long pr) {
  return static_cast<int>(~static_cast<uint32_t>(pr));
}

template <class F>
struct Out {
  using Raw = typename F::Raw;
  Raw* values;              // row start or null
  void* indices;            // row start
  unsigned long long* sel;  // sorted: rank 0's pair buffer (maybe remote)
  const int64_t* map;       // row's slot map or null: index e is written as map[e]
  bool idx64, sorted;

  __device__ __forceinline__ void emit(uint32_t pos, int e, uint32_t raw, uint32_t key) const {
    if (sorted) {
      sel[pos] = sort_pair(key, e);
      return;
    }
    if (values) values[pos] = static_cast<Raw>(raw);
    if (map) {
      static_cast<int64_t*>(indices)[pos] = __ldg(map + e);
    } else if (idx64) {
      static_cast<int64_t*>(indices)[pos] = e;
    } else {
      static_cast<int32_t*>(indices)[pos] = e;
    }
  }
  __device__ __forceinline__ void pad(int pos) const {
    if (values) values[pos] = static_cast<Raw>(F::kNegInf);
    if (idx64) {
      static_cast<int64_t*>(indices)[pos] = -1;
    } else {
      static_cast<int32_t*>(indices)[pos] = -1;
    }
  }
};

// Descending bitonic sort of a[0, n), n a power of two, by one CTA.
template <int NT>
__device__ __forceinline__ void sort_desc(unsigned long long* a, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < (n >> 1); t += NT) {
        const int i = 2 * t - (t & (stride - 1));
        const int j = i + stride;
        const unsigned long long x = a[i], y = a[j];
        const bool desc = (i & size) == 0;
        if (desc ? x < y : x > y) {
          a[i] = y;
          a[j] = x;
        }
      }
      __syncthreads();
    }
  }
}

// A row's last step, by its CTA (all NT threads): slots [K, k) get index -1 / value -inf;
// sorted: the K (key, index) pairs in sel are sorted and written out, values read from
// the row p.
template <class F, int NT>
__device__ __forceinline__ void finish_row(const Out<F>& o, unsigned long long* sel, const typename F::Raw* p,
                                           int K, int k) {
  const int tid = threadIdx.x;
  Out<F> og = o;
  og.sorted = false;
  for (int pos = K + tid; pos < k; pos += NT) og.pad(pos);
  if (!o.sorted) return;
  __syncthreads();
  if (K == 0) return;
  int n = 1;
  while (n < K) n <<= 1;
  for (int i = K + tid; i < n; i += NT) sel[i] = 0ull;  // below every real pair
  __syncthreads();
  sort_desc<NT>(sel, n);
  for (int i = tid; i < K; i += NT) {
    const int e = pair_index(sel[i]);
    og.emit(i, e, og.values ? __ldg(p + e) : 0u, 0u);
  }
}

}  // namespace
}  // namespace deepfuse
