// deepfuse._C launchers of the norm family (untyped form, being converted to TensorArg).
#include "common/api.h"
#include "common/legacy_launch.h"
#include "norm/rows.h"

namespace deepfuse {

using namespace legacy;

void register_norm(py::module_& m) {
  m.def("norm_rope_fits", &deepfuse::norm_rope_fits, py::arg("D"));
  m.def(
      "norm_rope",
      [](ptr_t x, int64_t x_ld, int64_t rows, int H, int D, ptr_t y, bool norm, ptr_t weight, float eps, ptr_t cos,
         ptr_t sin, int half, bool inverse, int store, ptr_t pages, int64_t page_bytes, int64_t num_pages,
         int page_size, ptr_t slots, ptr_t stream, int device) {
        DeviceGuard guard(device);
        const deepfuse::RowStoreArgs s{static_cast<deepfuse::RowStore>(store), P<uint8_t>(pages), page_bytes,
                                       num_pages, page_size, P<const int64_t>(slots)};
        deepfuse::norm_rope(P<const void>(x), x_ld, rows, H, D, P(y), norm, P<const float>(weight), eps,
                            P<const float>(cos), P<const float>(sin), half, inverse, s, deepfuse::as_stream(stream));
      },
      py::arg("x"), py::arg("x_ld"), py::arg("rows"), py::arg("H"), py::arg("D"), py::arg("y"), py::arg("norm"),
      py::arg("weight"), py::arg("eps"), py::arg("cos"), py::arg("sin"), py::arg("half"), py::arg("inverse"),
      py::arg("store"), py::arg("pages"), py::arg("page_bytes"), py::arg("num_pages"), py::arg("page_size"),
      py::arg("slots"), py::arg("stream"), py::arg("device") = -1);
}

}  // namespace deepfuse
