// deepfuse._C launchers of the kvcache family (untyped form, being converted to TensorArg).
#include "common/api.h"
#include "common/legacy_launch.h"
#include "kvcache/kvcache.h"

namespace deepfuse {

using namespace legacy;

void register_kvcache(py::module_& m) {
  m.def(
      "kv_store",
      [](ptr_t kv, int64_t kv_layer_ld, int64_t kv_row_ld, int64_t L, int64_t T, ptr_t cache,
         int64_t cache_layer_ld, int64_t num_pages, int64_t page_bytes, int page_size, bool fp8,
         ptr_t index, bool index64, int64_t index_layer_ld, ptr_t positions, bool positions64,
         int window, ptr_t stream, int device) {
        DeviceGuard guard(device);
        deepfuse::kv_store(P(kv), kv_layer_ld, kv_row_ld, L, T, P(cache), cache_layer_ld,
                           num_pages, page_bytes, page_size, fp8, P(index), index64,
                           index_layer_ld, P(positions), positions64, window,
                           deepfuse::as_stream(stream));
      },
      py::arg("kv"), py::arg("kv_layer_ld"), py::arg("kv_row_ld"), py::arg("L"), py::arg("T"),
      py::arg("cache"), py::arg("cache_layer_ld"), py::arg("num_pages"), py::arg("page_bytes"),
      py::arg("page_size"), py::arg("fp8"), py::arg("index"), py::arg("index64"),
      py::arg("index_layer_ld"), py::arg("positions"), py::arg("positions64"), py::arg("window"),
      py::arg("stream"), py::arg("device") = -1);
  m.def(
      "indexer_key_store",
      [](ptr_t k, int64_t k_layer_ld, int64_t k_row_ld, int64_t L, int64_t T, ptr_t cache,
         int64_t cache_layer_ld, int64_t num_pages, int64_t page_bytes, int page_size, int kind,
         ptr_t slots, bool slots64, int64_t slots_layer_ld, ptr_t stream, int device) {
        DeviceGuard guard(device);
        deepfuse::indexer_key_store(P(k), k_layer_ld, k_row_ld, L, T, P(cache), cache_layer_ld,
                                    num_pages, page_bytes, page_size, kind, P(slots), slots64,
                                    slots_layer_ld, deepfuse::as_stream(stream));
      },
      py::arg("k"), py::arg("k_layer_ld"), py::arg("k_row_ld"), py::arg("L"), py::arg("T"),
      py::arg("cache"), py::arg("cache_layer_ld"), py::arg("num_pages"), py::arg("page_bytes"),
      py::arg("page_size"), py::arg("kind"), py::arg("slots"), py::arg("slots64"),
      py::arg("slots_layer_ld"), py::arg("stream"), py::arg("device") = -1);
  m.def(
      "kv_window_copy",
      [](py::tuple src, py::tuple dst, ptr_t lengths, bool lengths64, int64_t L, int64_t B,
         int window, int rows, int kind, bool fill_missing, ptr_t stream, int device) {
        DeviceGuard guard(device);
        // side = (base, layer_ld, num_pages, page_bytes, page_size, mode, index, index64,
        //         index_ld, index_cols)
        auto side = [](const py::tuple& t) {
          if (t.size() != 10) throw std::invalid_argument("deepfuse: kv_window_copy: side needs 10 fields");
          return deepfuse::KvSide{P(t[0].cast<ptr_t>()), t[1].cast<int64_t>(), t[2].cast<int64_t>(),
                                  t[3].cast<int64_t>(), t[4].cast<int>(), t[5].cast<int>(),
                                  P(t[6].cast<ptr_t>()), t[7].cast<bool>(), t[8].cast<int64_t>(),
                                  t[9].cast<int64_t>()};
        };
        deepfuse::kv_window_copy(side(src), side(dst), P(lengths), lengths64, L, B, window, rows,
                                 static_cast<deepfuse::KvCopyKind>(kind), fill_missing,
                                 deepfuse::as_stream(stream));
      },
      py::arg("src"), py::arg("dst"), py::arg("lengths"), py::arg("lengths64"), py::arg("L"),
      py::arg("B"), py::arg("window"), py::arg("rows"), py::arg("kind"), py::arg("fill_missing"),
      py::arg("stream"), py::arg("device") = -1);

}

}  // namespace deepfuse
