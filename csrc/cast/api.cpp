// deepfuse._C launchers of the cast family: FP8 / MXFP8 activation casts, FP8 weight block cast.
#include <string>

#include "cast/block_cast.h"
#include "cast/cast.h"
#include "common/api.h"

namespace deepfuse {

namespace api {

ScaleKind scale_kind(const char* op, const std::string& fmt) {
  if (fmt == "fp32") return ScaleKind::kFp32;
  if (fmt == "ue8m0") return ScaleKind::kUe8m0;
  if (fmt == "ue8m0_packed") return ScaleKind::kUe8m0Packed;
  arg_error(op, "scale_fmt", "must be fp32, ue8m0 or ue8m0_packed (got " + fmt + ")");
}

// x [M, K] (rows may be strided) -> q e4m3 [M, K], scale per `group` values of a row.
void fp8_group_cast(const TensorArg& x, const TensorArg& q, const TensorArg& scale, const std::string& scale_fmt,
                    int group) {
  const char* op = "fp8_group_cast";
  const ScaleKind kind = scale_kind(op, scale_fmt);
  Check(op, "x", x).dtype({DType::kBF16, DType::kF32}).dim(2).inner_contiguous().stride_aligned(0, 16).aligned(16);
  const int64_t M = x.size(0), K = x.size(1);
  if (group != 32 && group != 64 && group != 128)
    arg_error(op, "group", "must be 32, 64 or 128");
  const int64_t G = (K + group - 1) / group;
  Check(op, "q", q).dtype(DType::kF8E4M3).shape({M, K}).contiguous();
  int64_t scale_ld = 0;
  if (kind == ScaleKind::kUe8m0Packed) {
    // [M, ceil(G / 4)] int32 view of an MN-major buffer whose columns are scale_ld apart
    Check(op, "scale", scale).dtype(DType::kI32).shape({M, (G + 3) / 4});
    if (scale.strides(0) != 1) Check(op, "scale", scale).fail("must be MN-major (stride 1 in dim 0)");
    scale_ld = scale.strides(1);
    if (scale_ld < M || scale_ld % 4 != 0) Check(op, "scale", scale).fail("must have a column stride >= M and % 4 == 0");
  } else {
    Check(op, "scale", scale).dtype(kind == ScaleKind::kFp32 ? DType::kF32 : DType::kU8).shape({M, G}).contiguous();
  }
  check_same_cuda_device(op, {{"x", x}, {"q", q}, {"scale", scale}});
  if (M == 0) return;
  DeviceScope scope(op, "x", x);
  deepfuse::fp8_group_cast(x.data, x.dtype == DType::kBF16, q.data, scale.data, kind, M, K, x.strides(0), group,
                           scale_ld, as_cuda_stream(scope));
}

// w [N, K] -> q e4m3 [N, K], one scale per 128 x 128 block.
void fp8_block_cast(const TensorArg& w, const TensorArg& q, const TensorArg& scale, const std::string& scale_fmt) {
  const char* op = "fp8_block_cast";
  const ScaleKind kind = scale_kind(op, scale_fmt);
  if (kind == ScaleKind::kUe8m0Packed) Check(op, "scale", scale).fail("must be fp32 or ue8m0 (packed is per-row only)");
  Check(op, "w", w).dtype({DType::kBF16, DType::kF32}).dim(2).contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  Check(op, "q", q).dtype(DType::kF8E4M3).shape({N, K}).contiguous();
  Check(op, "scale", scale).dtype(kind == ScaleKind::kFp32 ? DType::kF32 : DType::kU8)
      .shape({(N + 127) / 128, (K + 127) / 128}).contiguous();
  check_same_cuda_device(op, {{"w", w}, {"q", q}, {"scale", scale}});
  if (N == 0 || K == 0) return;
  DeviceScope scope(op, "w", w);
  deepfuse::fp8_block_cast(w.data, w.dtype == DType::kBF16, q.data, scale.data, kind == ScaleKind::kUe8m0, N, K,
                           as_cuda_stream(scope));
}

}  // namespace api

void register_cast(py::module_& m) {
#ifdef DEEPFUSE_NO_TILELANG
  m.def("tilelang_kernels", [] { return false; }, "whether this build carries the TileLang kernels");
#else
  m.def("tilelang_kernels", [] { return true; }, "whether this build carries the TileLang kernels");
#endif
  m.def("fp8_group_cast", &api::fp8_group_cast, py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("scale_fmt"),
        py::arg("group"), "x [M, K] bf16/fp32 -> q e4m3 [M, K] and one scale per `group` values of a row");
  m.def("fp8_block_cast", &api::fp8_block_cast, py::arg("w"), py::arg("q"), py::arg("scale"), py::arg("scale_fmt"),
        "weight [N, K] -> e4m3 and one scale per 128 x 128 block (TileLang kernel; raises in builds without it)");
}

}  // namespace deepfuse
