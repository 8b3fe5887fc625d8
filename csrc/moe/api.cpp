// deepfuse._C launchers of the moe family (untyped form, being converted to TensorArg).
#include "common/api.h"
#include "common/legacy_launch.h"
#include "moe/moe.h"

namespace deepfuse {

using namespace legacy;

namespace {

// problem = (T, d, inter, E, k, fmt, limit, (w1, s1, u8), (w3, s3, u8), (w2, s2, u8), shared),
// shared = None or ((w1, s1, u8), (w3, s3, u8), (w2, s2, u8)) of an fp8 shared expert.
deepfuse::MoeProblem moe_problem(const py::tuple& t) {
  if (t.size() != 11) throw std::invalid_argument("deepfuse: moe: problem needs 11 fields");
  auto wt = [](const py::handle& h) {
    const py::tuple x = h.cast<py::tuple>();
    deepfuse::ExpertWeight w;
    w.w = P<const void>(x[0].cast<ptr_t>());
    w.scale = P<const void>(x[1].cast<ptr_t>());
    w.scale_u8 = x[2].cast<bool>();
    return w;
  };
  deepfuse::MoeProblem p;
  p.T = t[0].cast<int>();
  p.d = t[1].cast<int>();
  p.inter = t[2].cast<int>();
  p.E = t[3].cast<int>();
  p.k = t[4].cast<int>();
  p.fmt = static_cast<deepfuse::WeightFmt>(t[5].cast<int>());
  p.limit = t[6].cast<float>();
  p.w1 = wt(t[7]);
  p.w3 = wt(t[8]);
  p.w2 = wt(t[9]);
  if (!t[10].is_none()) {
    const py::tuple s = t[10].cast<py::tuple>();
    p.has_shared = true;
    p.sw1 = wt(s[0]);
    p.sw3 = wt(s[1]);
    p.sw2 = wt(s[2]);
  }
  return p;
}

}  // namespace

void register_moe(py::module_& m) {
  m.def(
      "moe_route",
      [](ptr_t logits, ptr_t bias, ptr_t hash_ids, bool hash_is64, ptr_t weights, ptr_t ids, int T, int E, int k,
         float route_scale, int score, ptr_t stream, int device) {
        DeviceGuard guard(device);
        deepfuse::moe_route(P<const float>(logits), P<const float>(bias), P<const void>(hash_ids), hash_is64,
                            P<float>(weights), P<int64_t>(ids), T, E, k, route_scale,
                            static_cast<deepfuse::ScoreFunc>(score), deepfuse::as_stream(stream));
      },
      py::arg("logits"), py::arg("bias"), py::arg("hash_ids"), py::arg("hash_is64"), py::arg("weights"),
      py::arg("ids"), py::arg("T"), py::arg("E"), py::arg("k"), py::arg("route_scale"), py::arg("score"),
      py::arg("stream"), py::arg("device") = -1);
  m.def(
      "moe_workspace_bytes", [](py::tuple problem) { return deepfuse::moe_workspace_bytes(moe_problem(problem)); },
      py::arg("problem"), "workspace bytes moe_experts needs for a problem");
  m.def(
      "moe_experts",
      [](py::tuple problem, ptr_t x, bool x_bf16, ptr_t ids, bool ids_is64, ptr_t weights, ptr_t out,
         ptr_t workspace, ptr_t stream, int device) {
        DeviceGuard guard(device);
        deepfuse::moe_experts(moe_problem(problem), P<const void>(x), x_bf16, P<const void>(ids), ids_is64,
                              P<const float>(weights), P(out), P(workspace), deepfuse::as_stream(stream));
      },
      py::arg("problem"), py::arg("x"), py::arg("x_bf16"), py::arg("ids"), py::arg("ids_is64"), py::arg("weights"),
      py::arg("out"), py::arg("workspace"), py::arg("stream"), py::arg("device") = -1);
}

}  // namespace deepfuse
