// deepfuse._C: raw launchers. Each takes device pointers (as integers), sizes and a
// stream; none allocates or synchronises. Python (deepfuse.ops) validates all inputs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "attention/sparse_attention.h"
#include "cast/block_cast.h"
#include "cast/cast.h"
#include "common/cuda_utils.h"
#include "gemm/fp8_linear.h"
#include "kvcache/kvcache.h"
#include "indexer/indexer.h"
#include "mhc/mhc.h"
#include "norm/rows.h"
#include "moe/moe.h"
#include "topk/topk.h"

namespace py = pybind11;
using ptr_t = std::uintptr_t;

namespace {

template <typename T = void>
T* P(ptr_t p) { return reinterpret_cast<T*>(p); }

// Every launcher runs on the device its tensors live on: `device` (>= 0) is made current for
// the call and the caller's current device restored after it (-1: the current device, as
// before). deepfuse._ext.ext(device) passes it, so two GPUs in one process work too.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (device < 0) return;
    deepfuse::check_cuda(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ == device) {
      prev_ = -1;
      return;
    }
    deepfuse::check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);  // no throw from a destructor
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

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

// linear problem = (M, K, N, mxfp4, w, scale, scale_u8, groups)
deepfuse::LinearProblem linear_problem(const py::tuple& t) {
  if (t.size() != 8) throw std::invalid_argument("deepfuse: fp8_linear: problem needs 8 fields");
  deepfuse::LinearProblem p;
  p.M = t[0].cast<int64_t>();
  p.K = t[1].cast<int>();
  p.N = t[2].cast<int>();
  p.mxfp4 = t[3].cast<bool>();
  p.w = P<const void>(t[4].cast<ptr_t>());
  p.scale = P<const void>(t[5].cast<ptr_t>());
  p.scale_u8 = t[6].cast<bool>();
  p.groups = t[7].cast<int>();
  return p;
}

// problem = (T, d, inter, E, k, fmt, limit, (w1, s1, u8), (w3, s3, u8), (w2, s2, u8), shared),
// shared = None or ((w1, s1, u8), (w3, s3, u8), (w2, s2, u8)) of an fp8 shared expert.
deepfuse::MoeProblem moe_problem(const py::tuple& t) {
  if (t.size() != 11) throw std::invalid_argument("deepfuse: moe: problem needs 11 fields");
  auto wt = [](const py::handle& h) {
    const py::tuple x = h.cast<py::tuple>();
    deepfuse::ExpertWeight w;
    w.w = P<const void>(x[0].cast<ptr_t>());
    w.scale = P<const void>(x[1].cast<ptr_t>());
    w.scale_u8 = x[2].cast<bool>();
    return w;
  };
  deepfuse::MoeProblem p;
  p.T = t[0].cast<int>();
  p.d = t[1].cast<int>();
  p.inter = t[2].cast<int>();
  p.E = t[3].cast<int>();
  p.k = t[4].cast<int>();
  p.fmt = static_cast<deepfuse::WeightFmt>(t[5].cast<int>());
  p.limit = t[6].cast<float>();
  p.w1 = wt(t[7]);
  p.w3 = wt(t[8]);
  p.w2 = wt(t[9]);
  if (!t[10].is_none()) {
    const py::tuple s = t[10].cast<py::tuple>();
    p.has_shared = true;
    p.sw1 = wt(s[0]);
    p.sw3 = wt(s[1]);
    p.sw2 = wt(s[2]);
  }
  return p;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "deepfuse CUDA launchers (raw pointers + stream; validation lives in deepfuse.ops)";
  m.def("built_archs", &built_archs, "CUDA archs this module carries machine code for");
  m.def(
      "num_sms",
      [](int device) {
        DeviceGuard guard(device);
        return deepfuse::num_sms();
      },
      py::arg("device") = -1);

  m.def(
      "fp8_group_cast",
      [](ptr_t x, bool x_is_bf16, ptr_t q, ptr_t scale, int kind, int64_t M, int64_t K,
         int64_t x_ld, int group, int64_t scale_ld, ptr_t stream, int device) {
        DeviceGuard guard(device);
        deepfuse::fp8_group_cast(P(x), x_is_bf16, P(q), P(scale),
                                 static_cast<deepfuse::ScaleKind>(kind), M, K, x_ld, group,
                                 scale_ld, deepfuse::as_stream(stream));
      },
      py::arg("x"), py::arg("x_is_bf16"), py::arg("q"), py::arg("scale"), py::arg("kind"),
      py::arg("M"), py::arg("K"), py::arg("x_ld"), py::arg("group"), py::arg("scale_ld"),
      py::arg("stream"), py::arg("device") = -1);
  m.def(
      "fp8_block_cast",
      [](ptr_t w, bool w_is_bf16, ptr_t q, ptr_t scale, bool ue8m0, int64_t N, int64_t K,
         ptr_t stream, int device) {
        DeviceGuard guard(device);
        deepfuse::fp8_block_cast(P(w), w_is_bf16, P(q), P(scale), ue8m0, N, K,
                                 deepfuse::as_stream(stream));
      },
      py::arg("w"), py::arg("w_is_bf16"), py::arg("q"), py::arg("scale"), py::arg("ue8m0"),
      py::arg("N"), py::arg("K"), py::arg("stream"), py::arg("device") = -1,
      "weight block cast (TileLang kernel; raises in builds without TileLang kernels)");
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

  // ---- kvcache (formats: deepfuse/engine/kv_format.py)
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

  // ---- sparse attention over paged KV (semantics: deepfuse/ops/attention.py)
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

  // ---- fused MoE (semantics: deepfuse/ops/moe.py)
  m.def(
      "moe_route",
      [](ptr_t logits, ptr_t bias, ptr_t hash_ids, bool hash_is64, ptr_t weights, ptr_t ids, int T, int E, int k,
         float route_scale, int score, ptr_t stream, int device) {
        DeviceGuard guard(device);
        deepfuse::moe_route(P<const float>(logits), P<const float>(bias), P<const void>(hash_ids), hash_is64,
                            P<float>(weights), P<int64_t>(ids), T, E, k, route_scale,
                            static_cast<deepfuse::ScoreFunc>(score), deepfuse::as_stream(stream));
      },
      py::arg("logits"), py::arg("bias"), py::arg("hash_ids"), py::arg("hash_is64"), py::arg("weights"),
      py::arg("ids"), py::arg("T"), py::arg("E"), py::arg("k"), py::arg("route_scale"), py::arg("score"),
      py::arg("stream"), py::arg("device") = -1);
  m.def(
      "moe_workspace_bytes", [](py::tuple problem) { return deepfuse::moe_workspace_bytes(moe_problem(problem)); },
      py::arg("problem"), "workspace bytes moe_experts needs for a problem");
  m.def(
      "moe_experts",
      [](py::tuple problem, ptr_t x, bool x_bf16, ptr_t ids, bool ids_is64, ptr_t weights, ptr_t out,
         ptr_t workspace, ptr_t stream, int device) {
        DeviceGuard guard(device);
        deepfuse::moe_experts(moe_problem(problem), P<const void>(x), x_bf16, P<const void>(ids), ids_is64,
                              P<const float>(weights), P(out), P(workspace), deepfuse::as_stream(stream));
      },
      py::arg("problem"), py::arg("x"), py::arg("x_bf16"), py::arg("ids"), py::arg("ids_is64"), py::arg("weights"),
      py::arg("out"), py::arg("workspace"), py::arg("stream"), py::arg("device") = -1);
  m.def(
      "fp8_linear_workspace_bytes",
      [](py::tuple problem) { return deepfuse::fp8_linear_workspace_bytes(linear_problem(problem)); },
      py::arg("problem"));
  m.def(
      "fp8_linear",
      [](py::tuple problem, ptr_t x, bool x_bf16, ptr_t out, bool out_bf16, ptr_t workspace, ptr_t stream,
         int device) {
        DeviceGuard guard(device);
        deepfuse::fp8_linear(linear_problem(problem), P<const void>(x), x_bf16, P(out), out_bf16, P(workspace),
                             deepfuse::as_stream(stream));
      },
      py::arg("problem"), py::arg("x"), py::arg("x_bf16"), py::arg("out"), py::arg("out_bf16"), py::arg("workspace"),
      py::arg("stream"), py::arg("device") = -1);
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
