// deepfuse._C launchers of the mhc family: the hyper-connection mixes (pre / head) and post.
#include <string>
#include <vector>

#include "common/api.h"
#include "mhc/mhc.h"

namespace deepfuse {

namespace api {

// x [*L, 4, d] bf16 / fp32, contiguous, d % 4 == 0 -> d.
static int64_t check_streams(const char* op, const TensorArg& x) {
  Check c(op, "x", x);
  c.dtype({DType::kBF16, DType::kF32}).contiguous().aligned(16);
  if (x.ndim < 2 || x.size(-2) != 4) c.fail("must be [*L, 4, d] (4 streams)");
  if (x.size(-1) <= 0 || x.size(-1) % 4) c.fail("must have rows of d values, d % 4 == 0");
  return x.size(-1);
}

// t is contiguous, of `dtype` and of shape x.shape[:-2] + tail.
static void check_like(const char* op, const char* name, const TensorArg& t, DType dtype, const TensorArg& x,
                       std::initializer_list<int64_t> tail) {
  Check c(op, name, t);
  c.dtype(dtype);
  std::vector<int64_t> want(x.shape, x.shape + x.ndim - 2);
  want.insert(want.end(), tail);
  bool ok = t.ndim == static_cast<int>(want.size());
  for (int i = 0; ok && i < t.ndim; ++i) ok = t.shape[i] == want[i];
  if (!ok) {
    std::string s = "must have shape [";
    for (size_t i = 0; i < want.size(); ++i) {
      if (i) s += ", ";
      s += std::to_string(want[i]);
    }
    c.fail(s + "]");
  }
  c.contiguous().aligned(16);
}

// x [*L, 4, d]; fn fp32 [mixes, 4 d] with mixes 24 (pre) or 4 (head); scale fp32 [3] (head:
// at least one value); base fp32 [mixes]. -> y [*L, d] (x's dtype); pre also post fp32 [*L, 4] and
// comb fp32 [*L, 4, 4] (head: None). part: fp32 workspace of at least
// T * hc_mix_splits(T, d) * (mixes + 1) values (T = the tokens of x).
void hc_mix(const TensorArg& x, const TensorArg& fn, const TensorArg& scale, const TensorArg& base,
            const TensorArg& y, const TensorArg& post, const TensorArg& comb, const TensorArg& part, float norm_eps,
            float hc_eps, int iters) {
  const char* op = "hc_mix";
  const int64_t d = check_streams(op, x);
  Check cf(op, "fn", fn);
  cf.dtype(DType::kF32).dim(2).contiguous().aligned(16);
  const int64_t mixes = fn.size(0);
  if (mixes != 24 && mixes != 4) cf.fail("must have 24 (pre) or 4 (head) rows");
  const bool head = mixes == 4;
  cf.size(1, 4 * d);
  if (head) Check(op, "scale", scale).dtype(DType::kF32).contiguous();
  else Check(op, "scale", scale).dtype(DType::kF32).shape({3}).contiguous();
  if (scale.numel() < 1) Check(op, "scale", scale).fail("must have at least one value");
  Check(op, "base", base).dtype(DType::kF32).shape({mixes}).contiguous();
  check_like(op, "y", y, x.dtype, x, {d});
  if (!head) {
    check_like(op, "post", post, DType::kF32, x, {4});
    check_like(op, "comb", comb, DType::kF32, x, {4, 4});
    if (iters < 1) arg_error(op, "iters", "must be >= 1");
  }
  Check(op, "part", part).dtype(DType::kF32).dim(1).contiguous().aligned(16);
  check_same_cuda_device(op, {{"x", x}, {"fn", fn}, {"scale", scale}, {"base", base}, {"y", y}, {"post", post},
                              {"comb", comb}, {"part", part}});
  const int64_t T = x.numel() / (4 * d);
  if (T == 0) return;
  DeviceScope scope(op, "x", x);
  const int64_t need = T * hc_mix_splits(T, static_cast<int>(d)) * (mixes + 1);
  if (part.numel() < need)
    Check(op, "part", part).fail("must hold T * hc_mix_splits(T, d) * (mixes + 1) = " + std::to_string(need) +
                                 " values");
  deepfuse::hc_mix(x.data, x.dtype == DType::kBF16, fn.ptr<const float>(), scale.ptr<const float>(),
                   base.ptr<const float>(), y.data, head ? nullptr : post.ptr<float>(),
                   head ? nullptr : comb.ptr<float>(), part.ptr<float>(), T, static_cast<int>(d), head, norm_eps,
                   hc_eps, iters, as_cuda_stream(scope));
}

// f [*L, d], x [*L, 4, d] (one dtype, bf16 or fp32), post fp32 [*L, 4], comb fp32 [*L, 4, 4]
// -> out (x's shape and dtype).
void hc_post(const TensorArg& f, const TensorArg& x, const TensorArg& post, const TensorArg& comb,
             const TensorArg& out) {
  const char* op = "hc_post";
  const int64_t d = check_streams(op, x);
  check_like(op, "f", f, x.dtype, x, {d});
  check_like(op, "post", post, DType::kF32, x, {4});
  check_like(op, "comb", comb, DType::kF32, x, {4, 4});
  check_like(op, "out", out, x.dtype, x, {4, d});
  check_same_cuda_device(op, {{"f", f}, {"x", x}, {"post", post}, {"comb", comb}, {"out", out}});
  const int64_t T = x.numel() / (4 * d);
  if (T == 0) return;
  DeviceScope scope(op, "x", x);
  deepfuse::hc_post(f.data, x.data, x.dtype == DType::kBF16, post.ptr<const float>(), comb.ptr<const float>(),
                    out.data, T, static_cast<int>(d), as_cuda_stream(scope));
}

}  // namespace api

void register_mhc(py::module_& m) {
  m.def("hc_mix_splits", &deepfuse::hc_mix_splits, py::arg("T"), py::arg("d"),
        "the slices hc_mix splits each token's streams into on the current device (its workspace size)");
  m.def("hc_mix", &api::hc_mix, py::arg("x"), py::arg("fn"), py::arg("scale"), py::arg("base"), py::arg("y"),
        py::arg("post"), py::arg("comb"), py::arg("part"), py::arg("norm_eps"), py::arg("hc_eps"), py::arg("iters"),
        "mHC pre (fn [24, 4 d]: y, post, comb) or head (fn [4, 4 d]: y) of streams x [*L, 4, d]");
  m.def("hc_post", &api::hc_post, py::arg("f"), py::arg("x"), py::arg("post"), py::arg("comb"), py::arg("out"),
        "mHC post: out [*L, 4, d] = post f + comb^T x");
}

}  // namespace deepfuse
