// sm90 TMA / mbarrier helpers shared by the weight-streaming kernels (stream_linear.cu,
// moe/moe_stream.cu), and the driver entry point that encodes tensor maps (host).
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/fp8_utils.cuh"

namespace deepfuse::tma {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred P1;\nLAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// Eight values of a 128-value group spread over 16 consecutive lanes (every lane of the warp
// takes part): scaled into e4m3 range in place; returns the group's fp32 scale (the activation
// cast's rule).
__device__ __forceinline__ float scale8_group128(float (&v)[8]) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, finite_abs(v[i]));
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float s = fp32_scale(amax), mul = 1.0f / s;  // IEEE reciprocal, as the cast
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] *= mul;
  return s;
}

// Item q of an activation cast into e4m3 swizzled [BT x 128] tiles per 128-wide chunk: 8 values
// (raw: one 16-byte bf16 load or two fp32 loads) of row r = (q / 16) % BT, chunk kc = q / (16 BT),
// scaled by their row's fp32 scale over the chunk (fp8_group_cast's math: the 16 consecutive
// lanes of a (chunk, row) reduce the amax together, so every lane calls this). q >= items stores nothing.
template <int V>
__device__ __forceinline__ void cast_item8(const uint4 (&raw)[V], int BT, int q, int items, char* sX, float* sXS) {
  const int kc = q / (BT * 16), r = (q >> 4) % BT, p = q & 15;
  float v[8];
  if constexpr (V == 1) {
    widen8(raw[0], v);
  } else {
    const float* f0 = reinterpret_cast<const float*>(&raw[0]);
    const float* f1 = reinterpret_cast<const float*>(&raw[1]);
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = f0[i], v[4 + i] = f1[i];
  }
  const float s = scale8_group128(v);
  if (q < items) {
    *reinterpret_cast<uint2*>(sX + kc * BT * 128 + r * 128 + ((((p >> 1) ^ (r & 7)) << 4) | ((p & 1) << 3))) =
        to_e4m3x8(v);
    if (p == 0) sXS[kc * BT + r] = s;
  }
}

// Named barrier over `count` threads (a multiple of 32); id 0 is __syncthreads.
__device__ __forceinline__ void named_bar(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (null if unavailable).
inline PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A 2-D uint8 map over rows x row_bytes (row stride row_bytes), box box_bytes x box_rows.
inline bool encode_u8_2d(CUtensorMap& map, const void* base, int64_t rows, int64_t row_bytes, int box_bytes,
                         int box_rows, bool swizzle128) {
  const auto encode = encode_tiled();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_bytes), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t es[2] = {1, 1};
  return encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box, es,
                CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace deepfuse::tma
