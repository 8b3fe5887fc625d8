// deepfuse._C launchers of the moe family: router, fused routed (+ shared) experts.
#include <algorithm>
#include <initializer_list>
#include <string>

#include "common/api.h"
#include "moe/moe.h"
#include "moe/moe_prefill.h"

namespace deepfuse {

namespace api {

namespace {

constexpr int64_t kRouteMaxE = 1024, kRouteMaxK = 32;  // csrc/moe/moe_route.cu
constexpr int64_t kMaxExperts = 2046;                   // routed + shared (csrc/moe/moe_experts.cu)
constexpr int64_t kMaxDim = 8192;                       // d and inter


int64_t ceil128(int64_t n) { return (n + 127) / 128; }

ScoreFunc score_func_of(const char* op, const std::string& s) {
  if (s == "sqrtsoftplus") return ScoreFunc::kSqrtSoftplus;
  if (s == "sigmoid") return ScoreFunc::kSigmoid;
  if (s == "softmax") return ScoreFunc::kSoftmax;
  arg_error(op, "score_func", "must be sqrtsoftplus, sigmoid or softmax (got " + s + ")");
}

// One projection of E stacked experts, logical [E, N, K]: fp8 e4m3 [E, N, K] with block scales
// [E, ceil(N/128), ceil(K/128)] fp32 / uint8 UE8M0, or mxfp4 packed [E, N, K/2] with uint8
// scales [E, N, K/32]. E < 0: a single (shared) expert, [N, K] and 2-D scales.
ExpertWeight expert_weight(const char* op, const char* wname, const TensorArg& w, const char* sname,
                           const TensorArg& s, WeightFmt fmt, int64_t E, int64_t N, int64_t K) {
  const bool mx = fmt == WeightFmt::kMxfp4;
  Check cw(op, wname, w);
  if (mx) cw.dtype({DType::kU8, DType::kF4x2});
  else cw.dtype(DType::kF8E4M3);
  const int64_t Kw = mx ? K / 2 : K;
  if (E >= 0) cw.shape({E, N, Kw});
  else cw.shape({N, Kw});
  cw.contiguous().aligned(16);
  Check cs(op, sname, s);
  if (mx) cs.dtype(DType::kU8).aligned(4);
  else cs.dtype({DType::kF32, DType::kU8});
  const int64_t r = mx ? N : ceil128(N), c = mx ? K / 32 : ceil128(K);
  if (E >= 0) cs.shape({E, r, c});
  else cs.shape({r, c});
  cs.contiguous();
  ExpertWeight e;
  e.w = w.data;
  e.scale = s.data;
  e.scale_u8 = s.dtype == DType::kU8;
  return e;
}

}  // namespace

// logits fp32 [T, E]; bias fp32 [E] | None; hash_ids int32 / int64 [T, k] | None
// -> weights fp32 [T, k], ids int64 [T, k].
void moe_route(const TensorArg& logits, const TensorArg& bias, const TensorArg& hash_ids, const TensorArg& weights,
               const TensorArg& ids, double route_scale, const std::string& score_func) {
  const char* op = "moe_route";
  const ScoreFunc score = score_func_of(op, score_func);
  Check(op, "logits", logits).dtype(DType::kF32).dim(2).contiguous();
  const int64_t T = logits.size(0), E = logits.size(1);
  if (E > kRouteMaxE) Check(op, "logits", logits).fail("must have at most 1024 experts (the kernel's limit)");
  Check(op, "weights", weights).dtype(DType::kF32).dim(2).size(0, T).contiguous();
  const int64_t k = weights.size(1);
  if (k < 1 || k > kRouteMaxK || k > E)
    Check(op, "weights", weights).fail("must have k in [1, min(32, E)] columns (E = " + std::to_string(E) + ")");
  Check(op, "ids", ids).dtype(DType::kI64).shape({T, k}).contiguous();
  Check(op, "bias", bias).optional().dtype(DType::kF32).shape({E}).contiguous();
  Check(op, "hash_ids", hash_ids).optional().dtype({DType::kI32, DType::kI64}).shape({T, k}).contiguous();
  check_same_cuda_device(op, {{"logits", logits}, {"weights", weights}, {"ids", ids}, {"bias", bias},
                              {"hash_ids", hash_ids}});
  if (T == 0) return;
  DeviceScope scope(op, "logits", logits);
  deepfuse::moe_route(logits.ptr<const float>(), bias.ptr<const float>(), hash_ids.data,
                      hash_ids.dtype == DType::kI64, weights.ptr<float>(), ids.ptr<int64_t>(), static_cast<int>(T),
                      static_cast<int>(E), static_cast<int>(k), static_cast<float>(route_scale), score,
                      as_cuda_stream(scope));
}

int64_t moe_workspace_bytes(int64_t T, int64_t d, int64_t inter, int64_t E, int64_t k, bool shared) {
  const char* op = "moe_workspace_bytes";
  if (T < 0) arg_error(op, "T", "must be >= 0");
  if (d < 1 || d > kMaxDim) arg_error(op, "d", "must be in [1, 8192]");
  if (inter < 1 || inter > kMaxDim) arg_error(op, "inter", "must be in [1, 8192]");
  if (E < 1 || E + shared > kMaxExperts) arg_error(op, "E", "must be >= 1 with E (+ 1 shared) <= 2046");
  if (k < 1) arg_error(op, "k", "must be >= 1");
  MoeProblem p;
  p.T = static_cast<int>(T), p.d = static_cast<int>(d), p.inter = static_cast<int>(inter);
  p.E = static_cast<int>(E), p.k = static_cast<int>(k), p.has_shared = shared;
  return deepfuse::moe_workspace_bytes(p);
}

namespace {

// moe_experts / moe_gate_experts: validation of x, the experts, out and the workspace, then the launch.
// gate null: ids / weights are inputs (checked by the caller); else the fused router's outputs.
void run_experts(const char* op, const TensorArg& x, const TensorArg& ids, const TensorArg& weights, int64_t k,
                 const TensorArg& w1, const TensorArg& w1_scale, const TensorArg& w3, const TensorArg& w3_scale,
                 const TensorArg& w2, const TensorArg& w2_scale, const TensorArg& out, const TensorArg& workspace,
                 double limit, const TensorArg& shared_w1, const TensorArg& shared_w1_scale,
                 const TensorArg& shared_w3, const TensorArg& shared_w3_scale, const TensorArg& shared_w2,
                 const TensorArg& shared_w2_scale, int64_t stream_max_t, int64_t prefill_min_t,
                 int64_t stream_balance_max_t, const MoeGate* gate, std::initializer_list<Named> more) {
  if (stream_max_t < 0) arg_error(op, "stream_max_t", "must be >= 0 (got " + std::to_string(stream_max_t) + ")");
  if (prefill_min_t < 0) arg_error(op, "prefill_min_t", "must be >= 0 (got " + std::to_string(prefill_min_t) + ")");
  const int64_t T = x.size(0), d = x.size(1);
  Check(op, "w1", w1).dtype({DType::kF8E4M3, DType::kU8, DType::kF4x2}).dim(3);
  const WeightFmt fmt = w1.dtype == DType::kF8E4M3 ? WeightFmt::kFp8 : WeightFmt::kMxfp4;
  const int64_t E = w1.size(0), inter = w1.size(1);
  if (inter % 32 || inter > kMaxDim)
    Check(op, "w1", w1).fail("must have inter % 32 == 0 and inter <= 8192 (the kernels' limits)");
  if (fmt == WeightFmt::kMxfp4 && (d % 128 || inter % 128))
    Check(op, "w1", w1).fail("(mxfp4) needs d and inter multiples of 128 (d = " + std::to_string(d) + ")");
  const bool shared = shared_w1.defined();
  if (E < 1 || E + shared > kMaxExperts) Check(op, "w1", w1).fail("must have 1 .. 2046 experts (shared included)");
  MoeProblem p;
  p.T = static_cast<int>(T), p.d = static_cast<int>(d), p.inter = static_cast<int>(inter);
  p.E = static_cast<int>(E), p.k = static_cast<int>(k), p.fmt = fmt, p.limit = static_cast<float>(limit);
  p.stream_max_t = static_cast<int>(std::min<int64_t>(stream_max_t, 256));
  p.stream_balance_max_t = static_cast<int>(std::clamp<int64_t>(stream_balance_max_t, 0, 256));
  p.prefill_min_t = static_cast<int>(std::min<int64_t>(prefill_min_t, 1LL << 30));
  p.w1 = expert_weight(op, "w1", w1, "w1_scale", w1_scale, fmt, E, inter, d);
  p.w3 = expert_weight(op, "w3", w3, "w3_scale", w3_scale, fmt, E, inter, d);
  p.w2 = expert_weight(op, "w2", w2, "w2_scale", w2_scale, fmt, E, d, inter);
  if (shared) {
    p.has_shared = true;
    p.sw1 = expert_weight(op, "shared_w1", shared_w1, "shared_w1_scale", shared_w1_scale, WeightFmt::kFp8, -1,
                          inter, d);
    p.sw3 = expert_weight(op, "shared_w3", shared_w3, "shared_w3_scale", shared_w3_scale, WeightFmt::kFp8, -1,
                          inter, d);
    p.sw2 = expert_weight(op, "shared_w2", shared_w2, "shared_w2_scale", shared_w2_scale, WeightFmt::kFp8, -1, d,
                          inter);
  } else {
    for (const Named& n : {Named{"shared_w1_scale", shared_w1_scale}, Named{"shared_w3", shared_w3},
                           Named{"shared_w3_scale", shared_w3_scale}, Named{"shared_w2", shared_w2},
                           Named{"shared_w2_scale", shared_w2_scale}})
      if (n.t.defined()) Check(op, n.name, n.t).fail("must be None without shared_w1");
  }
  Check(op, "out", out).dtype(x.dtype).shape({T, d}).contiguous();
  Check(op, "workspace", workspace).dtype(DType::kU8).dim(1).contiguous().aligned(16);
  const int64_t need = deepfuse::moe_workspace_bytes(p);
  if (workspace.numel() < need)
    Check(op, "workspace", workspace)
        .fail("must hold at least " + std::to_string(need) + " bytes (moe_workspace_bytes)");
  const int dev = check_same_cuda_device(
      op, {{"x", x}, {"ids", ids}, {"weights", weights}, {"w1", w1}, {"w1_scale", w1_scale}, {"w3", w3},
           {"w3_scale", w3_scale}, {"w2", w2}, {"w2_scale", w2_scale}, {"shared_w1", shared_w1},
           {"shared_w1_scale", shared_w1_scale}, {"shared_w3", shared_w3}, {"shared_w3_scale", shared_w3_scale},
           {"shared_w2", shared_w2}, {"shared_w2_scale", shared_w2_scale}, {"out", out}, {"workspace", workspace}});
  for (const Named& n : more)
    if (n.t.defined()) Check(op, n.name, n.t).cuda(dev);
  if (T == 0) return;
  DeviceScope scope(op, "x", x);
  deepfuse::moe_experts(p, x.data, x.dtype == DType::kBF16, ids.data, ids.dtype == DType::kI64,
                        weights.ptr<const float>(), out.data, workspace.data, as_cuda_stream(scope), gate);
}

}  // namespace

// x [T, d] bf16 / fp32; ids int32 / int64 [T, k]; weights fp32 [T, k]; experts w1, w3 [E, inter, d],
// w2 [E, d, inter] (fp8 or mxfp4, the format from w1's dtype) with their scales; an optional fp8
// shared expert shared_w1, shared_w3 [inter, d], shared_w2 [d, inter] (all six or none)
// -> out [T, d] of x's dtype. workspace: uint8, at least moe_workspace_bytes.
void moe_experts(const TensorArg& x, const TensorArg& ids, const TensorArg& weights, const TensorArg& w1,
                 const TensorArg& w1_scale, const TensorArg& w3, const TensorArg& w3_scale, const TensorArg& w2,
                 const TensorArg& w2_scale, const TensorArg& out, const TensorArg& workspace, double limit,
                 const TensorArg& shared_w1, const TensorArg& shared_w1_scale, const TensorArg& shared_w3,
                 const TensorArg& shared_w3_scale, const TensorArg& shared_w2, const TensorArg& shared_w2_scale,
                 int64_t stream_max_t, int64_t prefill_min_t, int64_t stream_balance_max_t) {
  const char* op = "moe_experts";
  Check(op, "x", x).dtype({DType::kBF16, DType::kF32}).dim(2).contiguous().aligned(16);
  const int64_t T = x.size(0), d = x.size(1);
  if (d % 32 || d > kMaxDim) Check(op, "x", x).fail("must have d % 32 == 0 and d <= 8192 (the kernels' limits)");
  Check(op, "ids", ids).dtype({DType::kI32, DType::kI64}).dim(2).size(0, T).contiguous();
  const int64_t k = ids.size(1);
  if (k < 1) Check(op, "ids", ids).fail("must have at least one column");
  Check(op, "weights", weights).dtype(DType::kF32).shape({T, k}).contiguous();
  run_experts(op, x, ids, weights, k, w1, w1_scale, w3, w3_scale, w2, w2_scale, out, workspace, limit, shared_w1,
              shared_w1_scale, shared_w3, shared_w3_scale, shared_w2, shared_w2_scale, stream_max_t, prefill_min_t,
              stream_balance_max_t, nullptr, {});
}

// The router fused in (T <= 256): gate_weight fp32 [E, d] (E = the experts' count, <= 1024), gate_bias fp32 [E]
// | None, hash_ids int32 / int64 [T, k] | None; x, the experts, out, workspace as moe_experts
// -> ids int64 [T, k], weights fp32 [T, k] (moe_route's semantics on x gate_weight^T in fp32) and out.
void moe_gate_experts(const TensorArg& x, const TensorArg& gate_weight, const TensorArg& gate_bias,
                      const TensorArg& hash_ids, double route_scale, const std::string& score_func,
                      const TensorArg& ids, const TensorArg& weights, const TensorArg& w1,
                      const TensorArg& w1_scale, const TensorArg& w3, const TensorArg& w3_scale, const TensorArg& w2,
                      const TensorArg& w2_scale, const TensorArg& out, const TensorArg& workspace, double limit,
                      const TensorArg& shared_w1, const TensorArg& shared_w1_scale, const TensorArg& shared_w3,
                      const TensorArg& shared_w3_scale, const TensorArg& shared_w2,
                      const TensorArg& shared_w2_scale, int64_t stream_max_t, int64_t prefill_min_t,
                      int64_t stream_balance_max_t) {
  const char* op = "moe_gate_experts";
  const ScoreFunc score = score_func_of(op, score_func);
  Check(op, "x", x).dtype({DType::kBF16, DType::kF32}).dim(2).contiguous().aligned(16);
  const int64_t T = x.size(0), d = x.size(1);
  if (d % 32 || d > kMaxDim) Check(op, "x", x).fail("must have d % 32 == 0 and d <= 8192 (the kernels' limits)");
  if (T > kGateMaxT) Check(op, "x", x).fail("must have at most 256 rows (the fused gate's limit)");
  Check(op, "w1", w1).dim(3);
  const int64_t E = w1.size(0);
  if (E > kRouteMaxE) Check(op, "w1", w1).fail("must have at most 1024 experts (the fused gate's limit)");
  Check(op, "gate_weight", gate_weight).dtype(DType::kF32).shape({E, d}).contiguous().aligned(16);
  Check(op, "weights", weights).dtype(DType::kF32).dim(2).size(0, T).contiguous();
  const int64_t k = weights.size(1);
  if (k < 1 || k > kRouteMaxK || k > E)
    Check(op, "weights", weights).fail("must have k in [1, min(32, E)] columns (E = " + std::to_string(E) + ")");
  Check(op, "ids", ids).dtype(DType::kI64).shape({T, k}).contiguous();
  Check(op, "gate_bias", gate_bias).optional().dtype(DType::kF32).shape({E}).contiguous();
  Check(op, "hash_ids", hash_ids).optional().dtype({DType::kI32, DType::kI64}).shape({T, k}).contiguous();
  MoeGate g;
  g.w = gate_weight.ptr<const float>(), g.bias = gate_bias.ptr<const float>();
  g.hash_ids = hash_ids.data, g.hash_is64 = hash_ids.dtype == DType::kI64;
  g.score = score, g.route_scale = static_cast<float>(route_scale);
  run_experts(op, x, ids, weights, k, w1, w1_scale, w3, w3_scale, w2, w2_scale, out, workspace, limit, shared_w1,
              shared_w1_scale, shared_w3, shared_w3_scale, shared_w2, shared_w2_scale, stream_max_t, prefill_min_t,
              stream_balance_max_t, &g, {Named{"gate_weight", gate_weight}, Named{"gate_bias", gate_bias}, Named{"hash_ids", hash_ids}});
}

// Dense FP8 linears at large M through the prefill kernel (csrc/moe/moe_prefill.cu): x [M, K] bf16 / fp32
// times w e4m3 [N, K] (block scales [ceil(N/128), ceil(K/128)] fp32 / UE8M0) -> out [M, N], or x [M, G, Kg]
// times block-diagonal w [G R, Kg] -> out [M, G, R]; out of x's dtype. workspace: uint8, at least
// fp8_linear_prefill_workspace_bytes(M, G Kg). bn: 128 / 256 forces the tile width (0: by the tile count);
// cluster: 1 / 0 2-CTA clusters sharing the weight tile on / off (-1: the kernel's default).
bool linear_prefill_shape(const char* op, const TensorArg& x, const TensorArg& w, int64_t& M, int64_t& G,
                          int64_t& Kg, int64_t& R) {
  Check(op, "x", x).dtype({DType::kBF16, DType::kF32}).contiguous().aligned(16);
  if (x.ndim != 2 && x.ndim != 3) Check(op, "x", x).fail("must have 2 dims ([M, K]) or 3 ([M, groups, K])");
  M = x.size(0), G = x.ndim == 3 ? x.size(1) : 1, Kg = x.size(-1);
  if (G < 1) Check(op, "x", x).fail("must have at least one group");
  Check(op, "w", w).dtype(DType::kF8E4M3).dim(2).contiguous().aligned(16);
  if (w.size(0) % G) Check(op, "w", w).fail("must have a multiple of the " + std::to_string(G) + " groups of x as rows");
  R = w.size(0) / G;
  Check(op, "w", w).shape({G * R, Kg});
  return deepfuse::linear_prefill_supported(M, G, Kg, R);
}

int64_t fp8_linear_prefill_workspace_bytes(int64_t M, int64_t K) {
  const char* op = "fp8_linear_prefill_workspace_bytes";
  if (M < 0) arg_error(op, "M", "must be >= 0");
  if (K < 1) arg_error(op, "K", "must be >= 1");
  return deepfuse::linear_prefill_workspace_bytes(M, K);
}

void fp8_linear_prefill(const TensorArg& x, const TensorArg& w, const TensorArg& w_scale, const TensorArg& out,
                        const TensorArg& workspace, int64_t bn, int64_t cluster) {
  const char* op = "fp8_linear_prefill";
  int64_t M, G, Kg, R;
  const bool ok = linear_prefill_shape(op, x, w, M, G, Kg, R);
  Check(op, "w_scale", w_scale).dtype({DType::kF32, DType::kU8}).shape({(G * R + 127) / 128, (Kg + 127) / 128})
      .contiguous();
  Check co(op, "out", out);
  co.dtype(x.dtype);
  if (x.ndim == 3) co.shape({M, G, R});
  else co.shape({M, R});
  co.contiguous();
  if (bn != 0 && bn != 128 && bn != 256) arg_error(op, "bn", "must be 0, 128 or 256 (got " + std::to_string(bn) + ")");
  Check(op, "workspace", workspace).dtype(DType::kU8).dim(1).contiguous().aligned(16);
  check_same_cuda_device(op, {{"x", x}, {"w", w}, {"w_scale", w_scale}, {"out", out}, {"workspace", workspace}});
  if (M == 0) return;
  if (!ok)
    Check(op, "x", x).fail("is outside the kernel (K % 16 == 0, K <= 8192 per group, even N; grouped: K and N "
                           "multiples of 128 per group)");
  const int64_t need = deepfuse::linear_prefill_workspace_bytes(M, G * Kg);
  if (workspace.numel() < need)
    Check(op, "workspace", workspace)
        .fail("must hold at least " + std::to_string(need) + " bytes (fp8_linear_prefill_workspace_bytes)");
  DeviceScope scope(op, "x", x);
  const int mc = cluster < 0 ? -1 : cluster > 0 ? 1 : 0;
  if (!deepfuse::linear_prefill(x.data, x.dtype == DType::kBF16, M, G, Kg, static_cast<const uint8_t*>(w.data),
                                w_scale.data, w_scale.dtype == DType::kU8, R, out.data, x.dtype == DType::kF32,
                                workspace.data, static_cast<int>(bn), mc, as_cuda_stream(scope)))
    Check(op, "x", x).fail("could not be served (the driver refused a tensor map)");
}

}  // namespace api

void register_moe(py::module_& m) {
  m.def("moe_route", &api::moe_route, py::kw_only(), py::arg("logits"), py::arg("bias"), py::arg("hash_ids"),
        py::arg("weights"), py::arg("ids"), py::arg("route_scale"), py::arg("score_func"),
        "router: logits fp32 [T, E] -> weights fp32 [T, k], ids int64 [T, k] (k from weights)");
  m.def("moe_workspace_bytes", &api::moe_workspace_bytes, py::kw_only(), py::arg("T"), py::arg("d"),
        py::arg("inter"), py::arg("E"), py::arg("k"), py::arg("shared") = false,
        "workspace bytes moe_experts needs for these sizes");
  m.def("moe_experts", &api::moe_experts, py::kw_only(), py::arg("x"), py::arg("ids"), py::arg("weights"),
        py::arg("w1"), py::arg("w1_scale"), py::arg("w3"), py::arg("w3_scale"), py::arg("w2"), py::arg("w2_scale"),
        py::arg("out"), py::arg("workspace"), py::arg("limit"), py::arg("shared_w1") = py::none(),
        py::arg("shared_w1_scale") = py::none(), py::arg("shared_w3") = py::none(),
        py::arg("shared_w3_scale") = py::none(), py::arg("shared_w2") = py::none(),
        py::arg("shared_w2_scale") = py::none(), py::arg("stream_max_t") = 0, py::arg("prefill_min_t") = 0,
        py::arg("stream_balance_max_t") = 0,
        "routed fp8 / mxfp4 experts (+ an fp8 shared expert) of x [T, d] -> out [T, d]; T <= stream_max_t "
        "(<= 256): the streaming decode kernels (0: the grouped kernels); T > 256 and T >= prefill_min_t (> 0): "
        "the prefill kernels (fp8 and mxfp4)");
  m.def("moe_gate_experts", &api::moe_gate_experts, py::kw_only(), py::arg("x"), py::arg("gate_weight"),
        py::arg("gate_bias"), py::arg("hash_ids"), py::arg("route_scale"), py::arg("score_func"), py::arg("ids"),
        py::arg("weights"), py::arg("w1"), py::arg("w1_scale"), py::arg("w3"), py::arg("w3_scale"), py::arg("w2"),
        py::arg("w2_scale"), py::arg("out"), py::arg("workspace"), py::arg("limit"),
        py::arg("shared_w1") = py::none(), py::arg("shared_w1_scale") = py::none(),
        py::arg("shared_w3") = py::none(), py::arg("shared_w3_scale") = py::none(),
        py::arg("shared_w2") = py::none(), py::arg("shared_w2_scale") = py::none(), py::arg("stream_max_t") = 0,
        py::arg("prefill_min_t") = 0, py::arg("stream_balance_max_t") = 0,
        "moe_experts with the router fused in (T <= 256): logits x gate_weight^T (fp32), route (moe_route's "
        "semantics) and plan in two launches -> ids int64 [T, k], weights fp32 [T, k] and out [T, d]");
  m.def("fp8_linear_prefill_workspace_bytes", &api::fp8_linear_prefill_workspace_bytes, py::kw_only(), py::arg("M"),
        py::arg("K"), "workspace bytes fp8_linear_prefill needs for x [M, K] (K: every group's columns)");
  m.def("fp8_linear_prefill", &api::fp8_linear_prefill, py::kw_only(), py::arg("x"), py::arg("w"), py::arg("w_scale"),
        py::arg("out"), py::arg("workspace"), py::arg("bn") = 0, py::arg("cluster") = -1,
        "dense fp8 linear through the MoE prefill kernel: x [M, K] or [M, G, Kg] bf16 / fp32 times fp8 w "
        "-> out [M, N] or [M, G, R] of x's dtype");
}

}  // namespace deepfuse
