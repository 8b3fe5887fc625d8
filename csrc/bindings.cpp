// deepfuse._C: raw launchers. Each takes device pointers (as integers), sizes and a
// stream; none allocates or synchronises. Python (deepfuse.ops) validates all inputs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cast/block_cast.h"
#include "cast/cast.h"
#include "common/cuda_utils.h"
#include "topk/topk.h"

namespace py = pybind11;
using ptr_t = std::uintptr_t;

namespace {

template <typename T = void>
T* P(ptr_t p) { return reinterpret_cast<T*>(p); }

std::vector<std::string> built_archs() {
  std::vector<std::string> out;
  std::string s = DEEPFUSE_ARCHS_STR;
  size_t a = 0;
  while (a <= s.size()) {
    size_t b = s.find(',', a);
    if (b == std::string::npos) b = s.size();
    if (b > a) out.push_back(s.substr(a, b - a));
    a = b + 1;
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "deepfuse CUDA launchers (raw pointers + stream; validation lives in deepfuse.ops)";
  m.def("built_archs", &built_archs, "CUDA archs this module carries machine code for");
  m.def("num_sms", &deepfuse::num_sms);

  m.def(
      "fp8_group_cast",
      [](ptr_t x, bool x_is_bf16, ptr_t q, ptr_t scale, int kind, int64_t M, int64_t K,
         int64_t x_ld, int group, int64_t scale_ld, ptr_t stream) {
        deepfuse::fp8_group_cast(P(x), x_is_bf16, P(q), P(scale),
                                 static_cast<deepfuse::ScaleKind>(kind), M, K, x_ld, group,
                                 scale_ld, deepfuse::as_stream(stream));
      },
      py::arg("x"), py::arg("x_is_bf16"), py::arg("q"), py::arg("scale"), py::arg("kind"),
      py::arg("M"), py::arg("K"), py::arg("x_ld"), py::arg("group"), py::arg("scale_ld"),
      py::arg("stream"));
  m.def(
      "fp8_block_cast",
      [](ptr_t w, bool w_is_bf16, ptr_t q, ptr_t scale, bool ue8m0, int64_t N, int64_t K,
         ptr_t stream) {
        deepfuse::fp8_block_cast(P(w), w_is_bf16, P(q), P(scale), ue8m0, N, K,
                                 deepfuse::as_stream(stream));
      },
      py::arg("w"), py::arg("w_is_bf16"), py::arg("q"), py::arg("scale"), py::arg("ue8m0"),
      py::arg("N"), py::arg("K"), py::arg("stream"),
      "weight block cast (TileLang kernel; raises in builds without TileLang kernels)");
  m.def(
      "topk",
      [](ptr_t x, int dtype, int64_t B, int64_t N, int64_t ld, int k, ptr_t lengths,
         ptr_t values, ptr_t indices, bool idx64, bool sorted, ptr_t stream) {
        deepfuse::topk(P(x), static_cast<deepfuse::TopkDtype>(dtype), B, N, ld, k,
                       P<const int32_t>(lengths), P(values), P(indices), idx64, sorted,
                       deepfuse::as_stream(stream));
      },
      py::arg("x"), py::arg("dtype"), py::arg("B"), py::arg("N"), py::arg("ld"), py::arg("k"),
      py::arg("lengths"), py::arg("values"), py::arg("indices"), py::arg("idx64"),
      py::arg("sorted"), py::arg("stream"));
  m.def(
      "topk_plan",
      [](int dtype, int64_t B, int64_t N, bool sorted) {
        const auto p = deepfuse::topk_plan(static_cast<deepfuse::TopkDtype>(dtype), B, N, sorted);
        return py::make_tuple(p.ctas_per_row, p.staged, p.smem_bytes);
      },
      "topk launch plan: (CTAs per row, row part staged in shared memory, smem bytes per CTA)");
}
