// deepfuse._C launchers of the mhc family (untyped form, being converted to TensorArg).
#include "common/api.h"
#include "common/legacy_launch.h"
#include "mhc/mhc.h"

namespace deepfuse {

using namespace legacy;

void register_mhc(py::module_& m) {
  m.def("hc_mix_splits", &deepfuse::hc_mix_splits, py::arg("T"), py::arg("d"));
  m.def(
      "hc_mix",
      [](ptr_t x, bool x_bf16, ptr_t fn, ptr_t scale, ptr_t base, ptr_t y, ptr_t post, ptr_t comb, ptr_t part,
         int64_t T, int d, bool head, float norm_eps, float hc_eps, int iters, ptr_t stream, int device) {
        DeviceGuard guard(device);
        deepfuse::hc_mix(P<const void>(x), x_bf16, P<const float>(fn), P<const float>(scale), P<const float>(base),
                         P(y), P<float>(post), P<float>(comb), P<float>(part), T, d, head, norm_eps, hc_eps, iters,
                         deepfuse::as_stream(stream));
      },
      py::arg("x"), py::arg("x_bf16"), py::arg("fn"), py::arg("scale"), py::arg("base"), py::arg("y"),
      py::arg("post"), py::arg("comb"), py::arg("part"), py::arg("T"), py::arg("d"), py::arg("head"),
      py::arg("norm_eps"), py::arg("hc_eps"), py::arg("iters"), py::arg("stream"), py::arg("device") = -1);
  m.def(
      "hc_post",
      [](ptr_t f, ptr_t x, bool bf16, ptr_t post, ptr_t comb, ptr_t out, int64_t T, int d, ptr_t stream,
         int device) {
        DeviceGuard guard(device);
        deepfuse::hc_post(P<const void>(f), P<const void>(x), bf16, P<const float>(post), P<const float>(comb),
                          P(out), T, d, deepfuse::as_stream(stream));
      },
      py::arg("f"), py::arg("x"), py::arg("bf16"), py::arg("post"), py::arg("comb"), py::arg("out"), py::arg("T"),
      py::arg("d"), py::arg("stream"), py::arg("device") = -1);
}

}  // namespace deepfuse
