// deepfuse._C: raw launchers. Each takes device pointers (as integers), sizes and a
// stream; none allocates or synchronises. Python (deepfuse.ops) validates all inputs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cast/cast.h"
#include "common/cuda_utils.h"

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
}
