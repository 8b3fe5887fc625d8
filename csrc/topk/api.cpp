// deepfuse._C launchers of the topk family (untyped form, being converted to TensorArg).
#include "common/api.h"
#include "common/legacy_launch.h"
#include "topk/topk.h"

namespace deepfuse {

using namespace legacy;

void register_topk(py::module_& m) {
  m.def(
      "topk",
      [](ptr_t x, int dtype, int64_t B, int64_t N, int64_t ld, int k, ptr_t lengths,
         ptr_t values, ptr_t indices, bool idx64, bool sorted, ptr_t stream, ptr_t slot_map, int64_t map_ld,
         ptr_t map_rows, int device) {
        DeviceGuard guard(device);
        deepfuse::topk(P(x), static_cast<deepfuse::TopkDtype>(dtype), B, N, ld, k,
                       P<const int32_t>(lengths), P(values), P(indices), idx64, sorted,
                       deepfuse::as_stream(stream), P<const int64_t>(slot_map), map_ld, P<const int64_t>(map_rows));
      },
      py::arg("x"), py::arg("dtype"), py::arg("B"), py::arg("N"), py::arg("ld"), py::arg("k"),
      py::arg("lengths"), py::arg("values"), py::arg("indices"), py::arg("idx64"),
      py::arg("sorted"), py::arg("stream"), py::arg("slot_map") = 0, py::arg("map_ld") = 0, py::arg("map_rows") = 0,
      py::arg("device") = -1);
  m.def(
      "topk_plan",
      [](int dtype, int64_t B, int64_t N, int k, bool sorted, int device) {
        DeviceGuard guard(device);
        const auto p = deepfuse::topk_plan(static_cast<deepfuse::TopkDtype>(dtype), B, N, k, sorted);
        return py::make_tuple(p.ctas_per_row, p.threads, p.smem_bytes, p.kernel);
      },
      py::arg("dtype"), py::arg("B"), py::arg("N"), py::arg("k"), py::arg("sorted"), py::arg("device") = -1,
      "topk launch plan: (CTAs per row, threads per CTA, smem bytes per CTA, kernel: 0 general, 1 short rows)");
  m.def("topk_set_margin", &deepfuse::topk_set_margin, py::arg("z"),
        "testing hook: the general top-k kernel's threshold margin z for later calls (NaN: the policy)");

}

}  // namespace deepfuse
