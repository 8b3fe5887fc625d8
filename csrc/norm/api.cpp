// deepfuse._C launchers of the norm family: RMSNorm / RoPE / their fusion over rows, and the
// fused store of the rows into a cache.
#include <string>

#include "common/api.h"
#include "norm/rows.h"
#include "norm/store_arg.h"

namespace deepfuse {

namespace api {

// Whether t's dims [0, n) equal x's dims [0, n).
static bool same_lead(const TensorArg& t, const TensorArg& x, int n) {
  for (int i = 0; i < n; ++i)
    if (t.shape[i] != x.shape[i]) return false;
  return true;
}

// x [*L, D] or [*L, H, D] bf16 (rows of D values; a 2-D x may have strided rows) -> y (x's
// shape, contiguous) and / or the pages of `store`. cos / sin fp32 [*L, half] (None: no RoPE);
// H = x.size(-2) when cos has one dim less than x, else 1. norm: RMSNorm with weight fp32 [D]
// (None: no weight) first.
void norm_rope(const TensorArg& x, const TensorArg& y, bool norm, const TensorArg& weight, float eps,
               const TensorArg& cos, const TensorArg& sin, bool inverse, const std::string& store,
               const TensorArg& pages, const TensorArg& slots) {
  const char* op = "norm_rope";
  Check cx(op, "x", x);
  cx.dtype(DType::kBF16).inner_contiguous().aligned(16);
  if (x.ndim < 1) cx.fail("must have at least one dim");
  const int64_t D = x.size(-1);
  if (!norm_rope_fits(static_cast<int>(D))) cx.fail("must have rows of D values, D % 8 == 0 and 0 < D <= 16384");
  int64_t x_ld = D;
  if (x.ndim == 2) {
    cx.stride_aligned(0, 16);
    x_ld = x.strides(0);
  } else {
    cx.contiguous();
  }
  const int64_t rows = x.numel() / D;
  int64_t H = 1, half = 0;
  Check(op, "cos", cos).optional().dtype(DType::kF32).contiguous();
  if (cos.defined()) {
    if (cos.ndim == x.ndim - 1 && x.ndim >= 2 && same_lead(cos, x, x.ndim - 2)) {
      H = x.size(-2);
    } else if (!(cos.ndim == x.ndim && same_lead(cos, x, x.ndim - 1))) {
      Check(op, "cos", cos).fail("must be [*L, half] for x [*L, D] or [*L, H, D]");
    }
    half = cos.size(-1);
    if (2 * half > D) Check(op, "cos", cos).fail("must have at most D / 2 = " + std::to_string(D / 2) + " columns");
    Check cs(op, "sin", sin);
    cs.dtype(DType::kF32).dim(cos.ndim).contiguous();
    if (!same_lead(sin, cos, cos.ndim)) cs.fail("must have cos's shape");
  } else if (sin.defined()) {
    Check(op, "sin", sin).fail("must be None when cos is");
  }
  Check(op, "weight", weight).optional().dtype(DType::kF32).shape({D}).contiguous().aligned(16);
  if (norm && !(eps > 0)) arg_error(op, "eps", "must be > 0");
  Check cy(op, "y", y);
  cy.optional().dtype(DType::kBF16).dim(x.ndim).contiguous().aligned(16);
  if (y.defined() && !same_lead(y, x, x.ndim)) cy.fail("must have x's shape");
  const RowStoreArgs s = row_store(op, store, pages, slots, D, rows / H);
  if (s.kind != RowStore::kNone && H != 1)
    cx.fail("must be [N, D] rows with cos [N, half] for a store (one row per slot)");
  check_same_cuda_device(op, {{"x", x}, {"y", y}, {"weight", weight}, {"cos", cos}, {"sin", sin}, {"pages", pages},
                              {"slots", slots}});
  if (rows == 0) return;
  DeviceScope scope(op, "x", x);
  deepfuse::norm_rope(x.data, x_ld, rows, static_cast<int>(H), static_cast<int>(D), y.data, norm, weight.ptr<float>(),
                      eps, cos.ptr<float>(), sin.ptr<float>(), static_cast<int>(half), inverse, s,
                      as_cuda_stream(scope));
}

}  // namespace api

void register_norm(py::module_& m) {
  m.def("norm_rope_fits", &deepfuse::norm_rope_fits, py::arg("D"), "whether the row kernel takes rows of D values");
  m.def("norm_rope", &api::norm_rope, py::arg("x"), py::arg("y"), py::arg("norm"), py::arg("weight") = py::none(),
        py::arg("eps") = 1e-6f, py::arg("cos") = py::none(), py::arg("sin") = py::none(), py::arg("inverse") = false,
        py::arg("store") = "none", py::arg("pages") = py::none(), py::arg("slots") = py::none(),
        "rows of x [*L, D] / [*L, H, D] bf16: RMSNorm (norm), RoPE (cos / sin [*L, half]) -> y and / or the pages "
        "of store (kv_fp8, idx_fp8, idx_fp8_ue8m0, dense) at slots");
}

}  // namespace deepfuse
