// deepfuse._C launchers of the gemm family (untyped form, being converted to TensorArg).
#include "common/api.h"
#include "common/legacy_launch.h"
#include "gemm/fp8_linear.h"

namespace deepfuse {

using namespace legacy;

namespace {

// linear problem = (M, K, N, mxfp4, w, scale, scale_u8, groups)
deepfuse::LinearProblem linear_problem(const py::tuple& t) {
  if (t.size() != 8) throw std::invalid_argument("deepfuse: fp8_linear: problem needs 8 fields");
  deepfuse::LinearProblem p;
  p.M = t[0].cast<int64_t>();
  p.K = t[1].cast<int>();
  p.N = t[2].cast<int>();
  p.mxfp4 = t[3].cast<bool>();
  p.w = P<const void>(t[4].cast<ptr_t>());
  p.scale = P<const void>(t[5].cast<ptr_t>());
  p.scale_u8 = t[6].cast<bool>();
  p.groups = t[7].cast<int>();
  return p;
}

}  // namespace

void register_gemm(py::module_& m) {
  m.def(
      "fp8_linear_workspace_bytes",
      [](py::tuple problem) { return deepfuse::fp8_linear_workspace_bytes(linear_problem(problem)); },
      py::arg("problem"));
  m.def(
      "fp8_linear",
      [](py::tuple problem, ptr_t x, bool x_bf16, ptr_t out, bool out_bf16, ptr_t workspace, ptr_t stream,
         int device) {
        DeviceGuard guard(device);
        deepfuse::fp8_linear(linear_problem(problem), P<const void>(x), x_bf16, P(out), out_bf16, P(workspace),
                             deepfuse::as_stream(stream));
      },
      py::arg("problem"), py::arg("x"), py::arg("x_bf16"), py::arg("out"), py::arg("out_bf16"), py::arg("workspace"),
      py::arg("stream"), py::arg("device") = -1);
}

}  // namespace deepfuse
