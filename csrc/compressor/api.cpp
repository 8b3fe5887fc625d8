// deepfuse._C launchers of the compressor family: the compressor's step (pooled rows, their
// epilogue and store) and the state ring store.
#include <string>

#include "common/api.h"
#include "norm/rows.h"
#include "norm/store_arg.h"

namespace deepfuse {

namespace api {

// Rows a [N, w] and b [N, w] bf16 read with one row stride (16-byte aligned, unit stride in w).
static void check_row_pair(const char* op, const char* an, const TensorArg& a, const char* bn, const TensorArg& b,
                           int64_t N, int64_t w) {
  Check(op, an, a).dtype(DType::kBF16).shape({N, w}).inner_contiguous().aligned(16).stride_aligned(0, 16);
  Check cb(op, bn, b);
  cb.dtype(DType::kBF16).shape({N, w}).inner_contiguous().aligned(16);
  if (N > 1 && b.strides(0) != a.strides(0))
    cb.fail(std::string("must have the row stride of '") + an + "' (" + std::to_string(a.strides(0)) + ")");
}

// The compressor's step (norm/rows.h CompressArgs): kv / score bf16 [N, w], state rings
// state_kv / state_score bf16 [S, w], ape fp32 [r, w]; src_fresh / src_state / src_ape int64
// and src_is_fresh / src_valid bool [nb, L] (L = 2r if overlap else r); D = w / 2 if overlap
// else w. Pooled rows are RMS-normalised (norm_weight fp32 [D] or None), RoPE'd (cos / sin
// fp32 [nb, half] or None), written to y bf16 [nb, D] (or None) and stored (store, pages, slots).
void compress_store(const TensorArg& kv, const TensorArg& score, const TensorArg& state_kv,
                    const TensorArg& state_score, const TensorArg& ape, const TensorArg& src_fresh,
                    const TensorArg& src_state, const TensorArg& src_ape, const TensorArg& src_is_fresh,
                    const TensorArg& src_valid, bool overlap, const TensorArg& norm_weight, float eps,
                    const TensorArg& cos, const TensorArg& sin, const TensorArg& y, const std::string& store,
                    const TensorArg& pages, const TensorArg& slots) {
  const char* op = "compress_store";
  Check(op, "kv", kv).dtype(DType::kBF16).dim(2);
  const int64_t N = kv.size(0), w = kv.size(1);
  check_row_pair(op, "kv", kv, "score", score, N, w);
  Check(op, "state_kv", state_kv).dtype(DType::kBF16).dim(2);
  check_row_pair(op, "state_kv", state_kv, "state_score", state_score, state_kv.size(0), w);
  if (overlap && w % 2) Check(op, "kv", kv).fail("must have an even row width when overlap");
  const int64_t D = overlap ? w / 2 : w;
  if (!compress_fits(static_cast<int>(D)))
    Check(op, "kv", kv).fail("must give pooled rows of D values, D % 8 == 0 and 0 < D <= 512");
  Check(op, "ape", ape).dtype(DType::kF32).shape({-1, w}).contiguous().aligned(16);
  const int64_t r = ape.size(0), L = overlap ? 2 * r : r;
  Check(op, "src_fresh", src_fresh).dtype(DType::kI64).shape({-1, L}).contiguous();
  const int64_t nb = src_fresh.size(0);
  Check(op, "src_state", src_state).dtype(DType::kI64).shape({nb, L}).contiguous();
  Check(op, "src_ape", src_ape).dtype(DType::kI64).shape({nb, L}).contiguous();
  Check(op, "src_is_fresh", src_is_fresh).dtype(DType::kBool).shape({nb, L}).contiguous();
  Check(op, "src_valid", src_valid).dtype(DType::kBool).shape({nb, L}).contiguous();
  Check(op, "norm_weight", norm_weight).optional().dtype(DType::kF32).shape({D}).contiguous().aligned(16);
  if (!(eps > 0)) arg_error(op, "eps", "must be > 0");
  Check(op, "cos", cos).optional().dtype(DType::kF32).shape({nb, -1}).contiguous();
  const int64_t half = cos.defined() ? cos.size(1) : 0;
  if (2 * half > D) Check(op, "cos", cos).fail("must have at most D / 2 = " + std::to_string(D / 2) + " columns");
  if (cos.defined()) Check(op, "sin", sin).dtype(DType::kF32).shape({nb, half}).contiguous();
  else if (sin.defined()) Check(op, "sin", sin).fail("must be None when cos is");
  Check(op, "y", y).optional().dtype(DType::kBF16).shape({nb, D}).contiguous().aligned(16);
  const RowStoreArgs s = row_store(op, store, pages, slots, D, nb);
  check_same_cuda_device(op, {{"kv", kv}, {"score", score}, {"state_kv", state_kv}, {"state_score", state_score},
                              {"ape", ape}, {"src_fresh", src_fresh}, {"src_state", src_state}, {"src_ape", src_ape},
                              {"src_is_fresh", src_is_fresh}, {"src_valid", src_valid},
                              {"norm_weight", norm_weight}, {"cos", cos}, {"sin", sin}, {"y", y}, {"pages", pages},
                              {"slots", slots}});
  if (nb == 0) return;
  DeviceScope scope(op, "kv", kv);
  CompressArgs a{};
  a.kv = kv.data;
  a.score = score.data;
  a.ld = kv.strides(0);
  a.state_kv = state_kv.data;
  a.state_score = state_score.data;
  a.state_ld = state_kv.strides(0);
  a.ape = ape.ptr<const float>();
  a.src_fresh = src_fresh.ptr<const int64_t>();
  a.src_state = src_state.ptr<const int64_t>();
  a.src_ape = src_ape.ptr<const int64_t>();
  a.src_is_fresh = src_is_fresh.ptr<const bool>();
  a.src_valid = src_valid.ptr<const bool>();
  a.nb = nb;
  a.L = static_cast<int>(L);
  a.r = static_cast<int>(r);
  a.D = static_cast<int>(D);
  a.overlap = overlap;
  a.norm_weight = norm_weight.ptr<const float>();
  a.eps = eps;
  a.cos = cos.ptr<const float>();
  a.sin = sin.ptr<const float>();
  a.half = static_cast<int>(half);
  a.y = y.data;
  deepfuse::compress_store(a, s, as_cuda_stream(scope));
}

// State rings: row slots[t] (>= 0) of state_kv / state_score bf16 [S, w] gets kv[t] / score[t]
// (bf16 [N, w]); w % 8 == 0.
void state_store(const TensorArg& kv, const TensorArg& score, const TensorArg& state_kv, const TensorArg& state_score,
                 const TensorArg& slots) {
  const char* op = "state_store";
  Check(op, "kv", kv).dtype(DType::kBF16).dim(2);
  const int64_t N = kv.size(0), w = kv.size(1);
  if (w % 8 || w == 0) Check(op, "kv", kv).fail("must have rows of a positive multiple of 8 values");
  check_row_pair(op, "kv", kv, "score", score, N, w);
  Check(op, "state_kv", state_kv).dtype(DType::kBF16).dim(2);
  check_row_pair(op, "state_kv", state_kv, "state_score", state_score, state_kv.size(0), w);
  Check(op, "slots", slots).dtype(DType::kI64).shape({N}).contiguous();
  check_same_cuda_device(op, {{"kv", kv}, {"score", score}, {"state_kv", state_kv}, {"state_score", state_score},
                              {"slots", slots}});
  if (N == 0) return;
  DeviceScope scope(op, "kv", kv);
  deepfuse::state_store(kv.data, score.data, kv.strides(0), N, static_cast<int>(w), state_kv.data, state_score.data,
                        state_kv.strides(0), slots.ptr<const int64_t>(), as_cuda_stream(scope));
}

}  // namespace api

void register_compressor(py::module_& m) {
  m.def("compress_fits", &deepfuse::compress_fits, py::arg("D"), "whether the compressor kernel takes D-wide rows");
  m.def("compress_store", &api::compress_store, py::arg("kv"), py::arg("score"), py::arg("state_kv"),
        py::arg("state_score"), py::arg("ape"), py::arg("src_fresh"), py::arg("src_state"), py::arg("src_ape"),
        py::arg("src_is_fresh"), py::arg("src_valid"), py::arg("overlap"), py::arg("norm_weight"), py::arg("eps"),
        py::arg("cos"), py::arg("sin"), py::arg("y"), py::arg("store") = "none", py::arg("pages") = py::none(),
        py::arg("slots") = py::none(),
        "the compressor's step: pool the sources of each new row, RMSNorm, RoPE, write y and store at slots");
  m.def("state_store", &api::state_store, py::arg("kv"), py::arg("score"), py::arg("state_kv"),
        py::arg("state_score"), py::arg("slots"), "state rings: row slots[t] (>= 0) gets kv[t] / score[t]");
}

}  // namespace deepfuse
