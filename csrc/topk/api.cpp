// deepfuse._C launchers of the topk family: row-wise top-k and its launch plan.
#include <cmath>
#include <limits>
#include <string>

#include "common/api.h"
#include "common/cuda_utils.h"
#include "topk/topk.h"

namespace deepfuse {

namespace api {

TopkDtype topk_dtype(const char* op, const char* name, DType d) {
  switch (d) {
    case DType::kBF16: return TopkDtype::kBf16;
    case DType::kF16: return TopkDtype::kF16;
    case DType::kF32: return TopkDtype::kF32;
    default:
      arg_error(op, name, std::string("must be bfloat16, float16 or float32 (got ") + dtype_name(d) + ")");
  }
}

// x [B, N] (rows may be strided, last dim contiguous) -> indices [B, k] (int32 / int64) and
// values [B, k] (x's dtype; None: not written). lengths: int32 [B] or None. slot_map int64
// [M, >= N] (last dim contiguous) with int64 indices: indices are written as the slots
// slot_map[map_rows[b], index] (map_rows int64 [B]; None: row b). margin: the general kernel's
// threshold margin (NaN: the plan's; tests set it).
void topk(const TensorArg& x, int k, const TensorArg& lengths, const TensorArg& values, const TensorArg& indices,
          bool sorted, const TensorArg& slot_map, const TensorArg& map_rows, double margin) {
  const char* op = "topk";
  Check(op, "x", x).dtype({DType::kBF16, DType::kF16, DType::kF32}).dim(2).inner_contiguous();
  const TopkDtype dtype = topk_dtype(op, "x", x.dtype);
  const int64_t B = x.size(0), N = x.size(1);
  if (N >= (int64_t{1} << 31)) Check(op, "x", x).fail("must have fewer than 2^31 columns");
  if (B > 1 && x.strides(0) < 0) Check(op, "x", x).fail("must have a non-negative row stride");
  if (k < 1 || k > kTopkMaxK)
    arg_error(op, "k", "must be in [1, 4096] (got " + std::to_string(k) + ")");
  Check(op, "lengths", lengths).optional().dtype(DType::kI32).shape({B}).contiguous();
  Check(op, "indices", indices).dtype({DType::kI32, DType::kI64}).shape({B, k}).contiguous();
  const bool idx64 = indices.dtype == DType::kI64;
  Check(op, "values", values).optional().dtype(x.dtype).shape({B, k}).contiguous();
  if (slot_map.defined()) {
    Check(op, "slot_map", slot_map).dtype(DType::kI64).dim(2).inner_contiguous();
    if (slot_map.size(1) < N) Check(op, "slot_map", slot_map).fail("must have >= " + std::to_string(N) + " columns");
    if (slot_map.size(0) > 1 && slot_map.strides(0) < 0)
      Check(op, "slot_map", slot_map).fail("must have a non-negative row stride");
    if (!idx64) Check(op, "indices", indices).fail("must be int64 with a slot_map");
    if (!map_rows.defined() && slot_map.size(0) < B)
      Check(op, "slot_map", slot_map).fail("must have >= " + std::to_string(B) + " rows without map_rows");
  } else if (map_rows.defined()) {
    Check(op, "map_rows", map_rows).fail("needs a slot_map");
  }
  Check(op, "map_rows", map_rows).optional().dtype(DType::kI64).shape({B}).contiguous();
  check_same_cuda_device(op, {{"x", x},
                              {"lengths", lengths},
                              {"values", values},
                              {"indices", indices},
                              {"slot_map", slot_map},
                              {"map_rows", map_rows}});
  if (B == 0) return;
  DeviceScope scope(op, "x", x);
  const int64_t ld = B > 1 ? x.strides(0) : N;  // a single row's stride may be anything
  const bool aligned = reinterpret_cast<std::uintptr_t>(x.data) % 16 == 0 && (ld * dtype_bytes(x.dtype)) % 16 == 0;
  TopkPlan plan = topk_plan(dtype, B, N, k, sorted, num_sms(), aligned);
  if (!std::isnan(margin)) plan.margin = static_cast<float>(margin);
  TopkArgs a{x.data, ld, lengths.ptr<const int32_t>(), values.data, indices.data, static_cast<int>(N), k, idx64,
             sorted, slot_map.ptr<const int64_t>(), slot_map.defined() ? slot_map.strides(0) : 0,
             map_rows.ptr<const int64_t>()};
  deepfuse::topk(a, dtype, B, plan, as_cuda_stream(scope));
}

// The plan topk() runs for a shape with 16-byte aligned rows on CUDA device `device`
// (-1: the current one).
py::tuple topk_plan(const std::string& dtype, int64_t B, int64_t N, int k, bool sorted, int device) {
  TopkDtype d;
  if (dtype == "bfloat16") d = TopkDtype::kBf16;
  else if (dtype == "float16") d = TopkDtype::kF16;
  else if (dtype == "float32") d = TopkDtype::kF32;
  else arg_error("topk_plan", "dtype", "must be bfloat16, float16 or float32 (got " + dtype + ")");
  if (device < 0) check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  const TopkPlan p = deepfuse::topk_plan(d, B, N, k, sorted, sms);
  return py::make_tuple(p.ctas_per_row, p.threads, p.smem_bytes, p.kernel);
}

}  // namespace api

void register_topk(py::module_& m) {
  const auto none = py::none();
  m.def("topk", &api::topk, py::kw_only(), py::arg("x"), py::arg("k"), py::arg("lengths") = none,
        py::arg("values") = none, py::arg("indices"), py::arg("sorted"), py::arg("slot_map") = none,
        py::arg("map_rows") = none, py::arg("margin") = std::numeric_limits<double>::quiet_NaN(),
        "row-wise top-k of x [B, N] (bf16/fp16/fp32) into indices [B, k] (int32/int64) and optional values; "
        "slot_map/map_rows write indices as slots; margin: the sampled threshold's margin (NaN: the plan's)");
  m.def("topk_plan", &api::topk_plan, py::kw_only(), py::arg("dtype"), py::arg("B"), py::arg("N"), py::arg("k"),
        py::arg("sorted"), py::arg("device") = -1,
        "topk launch plan on CUDA device `device`: (CTAs per row, threads per CTA, smem bytes per CTA, "
        "kernel: 0 general, 1 short rows)");
}

}  // namespace deepfuse
