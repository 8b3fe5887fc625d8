// deepfuse._C launchers of the indexer family (untyped form, being converted to TensorArg).
#include "common/api.h"
#include "common/legacy_launch.h"
#include "indexer/indexer.h"

namespace deepfuse {

using namespace legacy;

void register_indexer(py::module_& m) {
  m.def(
      "indexer_logits_paged",
      [](ptr_t q, ptr_t weights, ptr_t pages, int64_t page_bytes, int64_t num_pages, int page_size, ptr_t slots,
         int64_t slots_ld, ptr_t token_req, ptr_t n_vis, int64_t N, int C, float scale, ptr_t out, ptr_t stream,
         int device) {
        DeviceGuard guard(device);
        deepfuse::indexer_logits_paged(P<const void>(q), P<const float>(weights), P<const uint8_t>(pages),
                                       page_bytes, num_pages, page_size, P<const int64_t>(slots), slots_ld,
                                       P<const int64_t>(token_req), P<const int32_t>(n_vis), N, C, scale,
                                       P<float>(out), deepfuse::as_stream(stream));
      },
      py::arg("q"), py::arg("weights"), py::arg("pages"), py::arg("page_bytes"), py::arg("num_pages"),
      py::arg("page_size"), py::arg("slots"), py::arg("slots_ld"), py::arg("token_req"), py::arg("n_vis"),
      py::arg("N"), py::arg("C"), py::arg("scale"), py::arg("out"), py::arg("stream"), py::arg("device") = -1);
}

}  // namespace deepfuse
