// deepfuse._C launchers of the compressor family (untyped form, being converted to TensorArg).
#include "common/api.h"
#include "common/legacy_launch.h"
#include "norm/rows.h"

namespace deepfuse {

using namespace legacy;

void register_compressor(py::module_& m) {
  m.def("compress_fits", &deepfuse::compress_fits, py::arg("D"));
  m.def(
      "compress_store",
      [](ptr_t kv, ptr_t score, int64_t ld, ptr_t state_kv, ptr_t state_score, int64_t state_ld, ptr_t ape,
         ptr_t src_fresh, ptr_t src_state, ptr_t src_ape, ptr_t src_is_fresh, ptr_t src_valid, int64_t nb, int L,
         int r, int D, bool overlap, ptr_t norm_weight, float eps, ptr_t cos, ptr_t sin, int half, ptr_t y,
         int store, ptr_t pages, int64_t page_bytes, int64_t num_pages, int page_size, ptr_t slots, ptr_t stream,
         int device) {
        DeviceGuard guard(device);
        const deepfuse::CompressArgs a{P<const void>(kv), P<const void>(score), ld, P<const void>(state_kv),
                                       P<const void>(state_score), state_ld, P<const float>(ape),
                                       P<const int64_t>(src_fresh), P<const int64_t>(src_state),
                                       P<const int64_t>(src_ape), P<const bool>(src_is_fresh),
                                       P<const bool>(src_valid), nb, L, r, D, overlap, P<const float>(norm_weight),
                                       eps, P<const float>(cos), P<const float>(sin), half, P(y)};
        const deepfuse::RowStoreArgs s{static_cast<deepfuse::RowStore>(store), P<uint8_t>(pages), page_bytes,
                                       num_pages, page_size, P<const int64_t>(slots)};
        deepfuse::compress_store(a, s, deepfuse::as_stream(stream));
      },
      py::arg("kv"), py::arg("score"), py::arg("ld"), py::arg("state_kv"), py::arg("state_score"),
      py::arg("state_ld"), py::arg("ape"), py::arg("src_fresh"), py::arg("src_state"), py::arg("src_ape"),
      py::arg("src_is_fresh"), py::arg("src_valid"), py::arg("nb"), py::arg("L"), py::arg("r"), py::arg("D"),
      py::arg("overlap"), py::arg("norm_weight"), py::arg("eps"), py::arg("cos"), py::arg("sin"), py::arg("half"),
      py::arg("y"), py::arg("store"), py::arg("pages"), py::arg("page_bytes"), py::arg("num_pages"),
      py::arg("page_size"), py::arg("slots"), py::arg("stream"), py::arg("device") = -1);
  m.def(
      "state_store",
      [](ptr_t kv, ptr_t score, int64_t ld, int64_t N, int w, ptr_t state_kv, ptr_t state_score, int64_t state_ld,
         ptr_t slots, ptr_t stream, int device) {
        DeviceGuard guard(device);
        deepfuse::state_store(P<const void>(kv), P<const void>(score), ld, N, w, P(state_kv), P(state_score),
                              state_ld, P<const int64_t>(slots), deepfuse::as_stream(stream));
      },
      py::arg("kv"), py::arg("score"), py::arg("ld"), py::arg("N"), py::arg("w"), py::arg("state_kv"),
      py::arg("state_score"), py::arg("state_ld"), py::arg("slots"), py::arg("stream"), py::arg("device") = -1);
}

}  // namespace deepfuse
