// deepfuse._C launchers of the indexer family: lightning-indexer logits over paged FP8 keys.
#include <cstdint>
#include <string>

#include "common/api.h"
#include "indexer/indexer.h"

namespace deepfuse {

namespace api {

namespace {
constexpr int64_t kRowBytes = kIndexerDim + 4;  // 128 e4m3 codes + fp32 scale (kv_format.IDX_ROW_BYTES)
}  // namespace

// out fp32 [N, C] = scores of q bf16 [N, H, 128] (H 32 or 64; head weights fp32 [N, H]) against key e of
// token t's request: the key at slot entry_slots[token_req[t], e] in `pages` (uint8
// [P, page_size * 132]: page_size rows of 128 e4m3 codes, then their fp32 scales; page size read
// from the tensor), -inf for e >= n_vis[t]; q_fp8: q rounded to e4m3 per (token, head) scale, else
// kept to ~8 significant bits (two e4m3 terms) (indexer.h).
void indexer_logits_paged(const TensorArg& q, const TensorArg& weights, const TensorArg& pages,
                          const TensorArg& entry_slots, const TensorArg& token_req, const TensorArg& n_vis,
                          double scale, bool q_fp8, const TensorArg& out) {
  const char* op = "indexer_logits_paged";
  Check(op, "q", q).dtype(DType::kBF16).dim(3);
  const int64_t H = q.size(1);
  if (H != 32 && H != kIndexerHeads) Check(op, "q", q).fail("must have 32 or 64 heads");
  Check(op, "q", q).shape({-1, H, kIndexerDim}).contiguous().aligned(16);
  const int64_t N = q.size(0);
  if (N > 0x7fffffff) Check(op, "q", q).fail("must have < 2^31 rows");
  Check(op, "weights", weights).dtype(DType::kF32).shape({N, H}).contiguous();
  Check(op, "pages", pages).dtype(DType::kU8).dim(2);
  if (pages.size(1) % kRowBytes != 0 || pages.size(1) == 0)
    Check(op, "pages", pages).fail("must be FP8 key pages [num_pages, page_size * 132]");
  const int64_t page_size = pages.size(1) / kRowBytes;
  if (page_size > 0x7fffffff) Check(op, "pages", pages).fail("must have a page size < 2^31");
  Check(op, "pages", pages).contiguous().aligned(16).stride_aligned(0, 16);
  Check(op, "entry_slots", entry_slots).dtype(DType::kI64).dim(2).inner_contiguous();
  const int64_t C = entry_slots.size(1);
  if (C > 0x7fffffff) Check(op, "entry_slots", entry_slots).fail("must have < 2^31 columns");
  Check(op, "token_req", token_req).dtype(DType::kI64).shape({N}).contiguous();
  Check(op, "n_vis", n_vis).dtype(DType::kI32).shape({N}).contiguous();
  Check(op, "out", out).dtype(DType::kF32).shape({N, C}).contiguous();
  check_same_cuda_device(op, {{"q", q}, {"weights", weights}, {"pages", pages}, {"entry_slots", entry_slots},
                              {"token_req", token_req}, {"n_vis", n_vis}, {"out", out}});
  if (N == 0 || C == 0) return;
  DeviceScope scope(op, "q", q);
  const int64_t page_bytes = pages.size(1), num_pages = pages.size(0), slots_ld = entry_slots.strides(0);
  deepfuse::indexer_logits_paged(q.data, static_cast<int>(H), q_fp8 ? 1 : 2, weights.ptr<const float>(), pages.ptr<const uint8_t>(), page_bytes,
                                 num_pages, static_cast<int>(page_size), entry_slots.ptr<const int64_t>(), slots_ld,
                                 entry_slots.size(0), token_req.ptr<const int64_t>(), n_vis.ptr<const int32_t>(), N,
                                 static_cast<int>(C), static_cast<float>(scale), out.ptr<float>(),
                                 as_cuda_stream(scope));
}

}  // namespace api

void register_indexer(py::module_& m) {
  m.def("indexer_logits_paged", &api::indexer_logits_paged, py::kw_only(), py::arg("q"), py::arg("weights"),
        py::arg("pages"), py::arg("entry_slots"), py::arg("token_req"), py::arg("n_vis"), py::arg("scale"),
        py::arg("q_fp8") = false, py::arg("out"),
        "indexer scores out fp32 [N, C] of q bf16 [N, H, 128] (H 32 / 64) against their requests' FP8 key pages "
        "(entry_slots [B, C], token_req [N], n_vis [N])");
}

}  // namespace deepfuse
