// deepfuse._C launchers of the gemm family: the block-scaled FP8 / MXFP4 linear.
#include <algorithm>
#include <string>

#include "common/api.h"
#include "gemm/fp8_linear.h"

namespace deepfuse {

namespace api {

namespace {

constexpr int64_t kMaxK = 16384;  // csrc/gemm/grouped_gemm_sm90.cuh (kMaxKChunks)

// x [M, K] (dense) or [M, G, K] (block-diagonal: w [G * N, K]) times w -> LinearProblem. The
// weight format comes from w's dtype: fp8 e4m3 [rows, K] with scales [ceil(rows/128),
// ceil(K/128)] fp32 / uint8 UE8M0, or mxfp4 packed uint8 [rows, K/2] with uint8 scales [rows, K/32].
LinearProblem linear_problem(const char* op, const TensorArg& x, const TensorArg& w, const TensorArg& w_scale,
                             const TensorArg& x_scale = TensorArg{}) {
  if (x_scale.defined()) Check(op, "x", x).dtype(DType::kF8E4M3).contiguous().aligned(16);
  else Check(op, "x", x).dtype({DType::kBF16, DType::kF32}).contiguous().aligned(16);
  if (x.ndim != 2 && x.ndim != 3) Check(op, "x", x).fail("must have 2 dims ([M, K]) or 3 ([M, groups, K])");
  const int64_t M = x.size(0), K = x.size(-1), groups = x.ndim == 3 ? x.size(1) : 0;
  if (K % 32 || K > kMaxK) Check(op, "x", x).fail("must have K % 32 == 0 and K <= 16384 (the kernels' limits)");
  if (x.ndim == 3 && groups < 1) Check(op, "x", x).fail("must have at least one group");
  Check(op, "w", w).dtype({DType::kF8E4M3, DType::kU8, DType::kF4x2}).dim(2);
  const bool mx = w.dtype != DType::kF8E4M3;
  const int64_t rows = w.size(0);
  if (groups > 0 && rows % groups)
    Check(op, "w", w).fail("must have a multiple of the " + std::to_string(groups) + " groups of x as rows");
  const int64_t N = groups > 0 ? rows / groups : rows;
  if (mx && K % 128) Check(op, "x", x).fail("must have K % 128 == 0 for an mxfp4 w");
  if (!mx && groups > 0 && N % 128) Check(op, "w", w).fail("(fp8, grouped) must have a multiple of 128 rows per group");
  Check(op, "w", w).shape({rows, mx ? K / 2 : K}).contiguous().aligned(16);
  if (mx) Check(op, "w_scale", w_scale).dtype(DType::kU8).shape({rows, K / 32}).contiguous().aligned(4);
  else Check(op, "w_scale", w_scale).dtype({DType::kF32, DType::kU8}).shape({(rows + 127) / 128, (K + 127) / 128})
      .contiguous();
  if (x_scale.defined()) {
    Check cs(op, "x_scale", x_scale);
    cs.dtype(DType::kU8);
    if (groups > 0) cs.shape({M, groups, K / 32});
    else cs.shape({M, K / 32});
    cs.contiguous();
  }
  LinearProblem p;
  p.M = M, p.K = static_cast<int>(K), p.N = static_cast<int>(N), p.mxfp4 = mx;
  p.x_mx = x_scale.defined(), p.x_scale = x_scale.data;
  p.w = w.data, p.scale = w_scale.data, p.scale_u8 = w_scale.dtype == DType::kU8, p.groups = static_cast<int>(groups);
  return p;
}

}  // namespace

// Workspace bytes fp8_linear needs for x times w on x's device (its SM count sets the K splits).
int64_t fp8_linear_workspace_bytes(const TensorArg& x, const TensorArg& w, const TensorArg& w_scale, bool persist,
                                   int64_t persist_splits) {
  const char* op = "fp8_linear_workspace_bytes";
  LinearProblem p = linear_problem(op, x, w, w_scale);
  p.persist = persist;
  if (persist_splits < 0 || persist_splits > 64)
    arg_error(op, "persist_splits", "must be in [0, 64] (got " + std::to_string(persist_splits) + ")");
  p.persist_splits = static_cast<int>(persist_splits);
  check_same_cuda_device(op, {{"x", x}, {"w", w}, {"w_scale", w_scale}});
  DeviceScope scope(op, "x", x);
  return deepfuse::fp8_linear_workspace_bytes(p);
}

// x [M, K] -> out [M, N], or x [M, G, K] -> out [M, G, N]; bf16 / fp32 in and out.
// stream_max_m: dense M up to this runs the streaming kernel (0: never; tests and benchmarks
// compare the paths); stream_max_splits: it serves only shapes whose plan needs at most this
// many K splits (thread-block cluster size), the grouped kernel the others; stream_wgs: consumer
// warpgroups per streaming CTA (1 or 2; 2 where a plan keeps one CTA per SM with >= 2 weight tiles,
// BT >= 32); stream_policy: the plan's occupancy choice (0: the most CTAs per SM that fit, 1: the
// most ring stages resident). stream_grouped: block-diagonal w
// (x [M, G, K]) through the streaming kernel too where it serves the shape. x_scale: x is MXFP8
// (e4m3 x with UE8M0 scales per 32 values, uint8 [M, K/32] or [M, G, K/32]); only the streaming
// kernel takes it (a shape it does not serve raises). persist: dense fp8 M <= 64 runs the persistent
// kernel (persist_linear.cu) where it serves the shape (the workspace sized with the same persist and
// persist_splits); persist_splits: its K splits (0: the plan's choice, else at most this many).
void fp8_linear(const TensorArg& x, const TensorArg& w, const TensorArg& w_scale, const TensorArg& out,
                const TensorArg& workspace, int64_t stream_max_m, int64_t stream_max_splits, int64_t stream_wgs,
                int64_t stream_policy, bool stream_grouped, const TensorArg& x_scale, bool persist,
                int64_t persist_splits) {
  const char* op = "fp8_linear";
  LinearProblem p = linear_problem(op, x, w, w_scale, x_scale);
  p.stream_grouped = stream_grouped;
  p.persist = persist && !p.x_mx;
  if (persist_splits < 0 || persist_splits > 64)
    arg_error(op, "persist_splits", "must be in [0, 64] (got " + std::to_string(persist_splits) + ")");
  p.persist_splits = static_cast<int>(persist_splits);
  if (stream_max_m < 0) arg_error(op, "stream_max_m", "must be >= 0 (got " + std::to_string(stream_max_m) + ")");
  p.stream_max_m = static_cast<int>(std::min<int64_t>(stream_max_m, 64));
  if (stream_max_splits != 1 && stream_max_splits != 2 && stream_max_splits != 4 && stream_max_splits != 8)
    arg_error(op, "stream_max_splits", "must be 1, 2, 4 or 8 (got " + std::to_string(stream_max_splits) + ")");
  p.stream_max_splits = static_cast<int>(stream_max_splits);
  if (stream_wgs != 1 && stream_wgs != 2)
    arg_error(op, "stream_wgs", "must be 1 or 2 (got " + std::to_string(stream_wgs) + ")");
  p.stream_wgs = static_cast<int>(stream_wgs);
  if (stream_policy != 0 && stream_policy != 1)
    arg_error(op, "stream_policy", "must be 0 or 1 (got " + std::to_string(stream_policy) + ")");
  p.stream_policy = static_cast<int>(stream_policy);
  Check co(op, "out", out);
  co.dtype({DType::kBF16, DType::kF32});
  if (p.groups > 0) co.shape({p.M, p.groups, p.N});
  else co.shape({p.M, p.N});
  co.contiguous();
  Check(op, "workspace", workspace).dtype(DType::kU8).dim(1).contiguous().aligned(16);
  check_same_cuda_device(op, {{"x", x}, {"w", w}, {"w_scale", w_scale}, {"out", out}, {"workspace", workspace}});
  if (x_scale.defined()) check_same_cuda_device(op, {{"x", x}, {"x_scale", x_scale}});
  if (p.M == 0 || p.N == 0) return;
  DeviceScope scope(op, "x", x);
  const int64_t need = p.x_mx ? 0 : deepfuse::fp8_linear_workspace_bytes(p);  // MXFP8 x: no cast, no workspace
  if (workspace.numel() < need)
    Check(op, "workspace", workspace)
        .fail("must hold at least " + std::to_string(need) + " bytes (fp8_linear_workspace_bytes)");
  deepfuse::fp8_linear(p, x.data, x.dtype != DType::kF32, out.data, out.dtype == DType::kBF16, workspace.data,
                       as_cuda_stream(scope));
}

}  // namespace api

void register_gemm(py::module_& m) {
  m.def("fp8_linear_workspace_bytes", &api::fp8_linear_workspace_bytes, py::kw_only(), py::arg("x"), py::arg("w"),
        py::arg("w_scale"), py::arg("persist") = false, py::arg("persist_splits") = 0,
        "workspace bytes fp8_linear needs for x times w (on x's device)");
  m.def("fp8_linear", &api::fp8_linear, py::kw_only(), py::arg("x"), py::arg("w"), py::arg("w_scale"), py::arg("out"),
        py::arg("workspace"), py::arg("stream_max_m") = 64,
        py::arg("stream_max_splits") = 8, py::arg("stream_wgs") = 1, py::arg("stream_policy") = 0,
        py::arg("stream_grouped") = false,
        py::arg("x_scale") = py::none(), py::arg("persist") = false, py::arg("persist_splits") = 0,
        "x [M, K] or [M, groups, K] bf16 / fp32 times fp8 / mxfp4 w -> out [M, N] or [M, groups, N] bf16 / fp32");
}

}  // namespace deepfuse
