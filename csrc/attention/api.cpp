// deepfuse._C launchers of the attention family (untyped form, being converted to TensorArg).
#include "common/api.h"
#include "common/legacy_launch.h"
#include "attention/sparse_attention.h"

namespace deepfuse {

using namespace legacy;

void register_attention(py::module_& m) {
  m.def(
      "sparse_attention_paged",
      [](ptr_t q, int64_t q_ld_t, int64_t q_ld_h, int T, int H, py::tuple s0, py::tuple s1, ptr_t sink,
         float scale_log2, ptr_t cos, ptr_t sin, int rope_pairs, bool mxfp8, ptr_t out, ptr_t out_scale,
         ptr_t lse, int G, int splits, ptr_t ws_o, ptr_t ws_ml, ptr_t stream, int device) {
        DeviceGuard guard(device);
        // source = (base, num_slots, page_bytes, page_size, fp8, idx, idx64, K, len, len64)
        auto src = [](const py::tuple& t) {
          if (t.size() != 10) throw std::invalid_argument("deepfuse: sparse_attention_paged: source needs 10 fields");
          deepfuse::AttnSource s;
          s.base = P<const uint8_t>(t[0].cast<ptr_t>());
          s.num_slots = t[1].cast<int64_t>();
          s.page_bytes = t[2].cast<int64_t>();
          s.page_size = t[3].cast<int>();
          s.fp8 = t[4].cast<int>();
          s.idx = P<const void>(t[5].cast<ptr_t>());
          s.idx64 = t[6].cast<int>();
          s.K = t[7].cast<int>();
          s.len = P<const void>(t[8].cast<ptr_t>());
          s.len64 = t[9].cast<int>();
          return s;
        };
        deepfuse::AttnParams p;
        p.q = P<const void>(q);
        p.q_ld_t = q_ld_t;
        p.q_ld_h = q_ld_h;
        p.T = T;
        p.H = H;
        p.src[0] = src(s0);
        p.src[1] = src(s1);
        p.sink = P<const float>(sink);
        p.scale_log2 = scale_log2;
        p.cos = P<const float>(cos);
        p.sin = P<const float>(sin);
        p.rope_pairs = rope_pairs;
        p.mxfp8 = mxfp8 ? 1 : 0;
        p.out = P(out);
        p.out_scale = P<uint8_t>(out_scale);
        p.lse = P<float>(lse);
        p.G = G;
        p.splits = splits;
        p.ws_o = P<float>(ws_o);
        p.ws_ml = P<float>(ws_ml);
        deepfuse::sparse_attention_paged(p, deepfuse::as_stream(stream));
      },
      py::arg("q"), py::arg("q_ld_t"), py::arg("q_ld_h"), py::arg("T"), py::arg("H"), py::arg("src0"),
      py::arg("src1"), py::arg("sink"), py::arg("scale_log2"), py::arg("cos"), py::arg("sin"),
      py::arg("rope_pairs"), py::arg("mxfp8"), py::arg("out"), py::arg("out_scale"), py::arg("lse"),
      py::arg("G"), py::arg("splits"), py::arg("ws_o"), py::arg("ws_ml"), py::arg("stream"), py::arg("device") = -1);
  m.def(
      "sparse_attention_plan",
      [](int T, int H, int K_total, int G, int device) {
        DeviceGuard guard(device);
        const auto p = deepfuse::sparse_attention_plan(T, H, K_total, G);
        return py::make_tuple(p.G, p.splits, p.ctas, p.blocks);
      },
      py::arg("T"), py::arg("H"), py::arg("K_total"), py::arg("G"), py::arg("device") = -1,
      "sparse attention launch plan: (G, splits, CTAs, key blocks of 32)");

}

}  // namespace deepfuse
