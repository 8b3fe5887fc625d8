// The RowStoreArgs of a launcher's (store, pages, slots) arguments, checked: where the norm and
// compressor launchers store their finished rows (python/deepfuse/ops/kvcache.py RowTarget).
#pragma once
#include <string>

#include "common/tensor.h"
#include "norm/rows.h"

namespace deepfuse::api {

// store: "none" (pages and slots None), "kv_fp8" (uint8 [P, page_size * 584], D 512),
// "idx_fp8" / "idx_fp8_ue8m0" (uint8 [P, page_size * 132], D 128) or "dense" (bf16
// [P, page_size, D], D <= 512); slots: int64 [rows], one per stored row.
inline RowStoreArgs row_store(const char* op, const std::string& store, const TensorArg& pages,
                              const TensorArg& slots, int64_t D, int64_t rows) {
  RowStoreArgs s;
  if (store == "none") {
    if (pages.defined()) Check(op, "pages", pages).fail("must be None when store is none");
    return s;
  }
  int64_t row_bytes = 0, want_D = 0;
  if (store == "kv_fp8") {
    s.kind = RowStore::kKvFp8, row_bytes = 584, want_D = 512;
  } else if (store == "idx_fp8" || store == "idx_fp8_ue8m0") {
    s.kind = store == "idx_fp8" ? RowStore::kIdxFp8 : RowStore::kIdxFp8Ue8m0, row_bytes = 132, want_D = 128;
  } else if (store == "dense") {
    s.kind = RowStore::kDense;
  } else {
    arg_error(op, "store", "must be none, kv_fp8, idx_fp8, idx_fp8_ue8m0 or dense (got " + store + ")");
  }
  if ((want_D && D != want_D) || (!want_D && D > 512))
    arg_error(op, "store", store + " takes rows of " + (want_D ? std::to_string(want_D) : std::string("<= 512")) +
                               " values (got " + std::to_string(D) + ")");
  Check c(op, "pages", pages);
  if (s.kind == RowStore::kDense) {
    c.dtype(DType::kBF16).shape({-1, -1, D}).contiguous().aligned(16);
    s.page_size = static_cast<int>(pages.size(1));
    s.page_bytes = pages.size(1) * D * 2;
  } else {
    c.dtype(DType::kU8).dim(2).contiguous().aligned(16);
    if (pages.size(1) % row_bytes) c.fail("must hold whole " + std::to_string(row_bytes) + "-byte rows per page");
    s.page_size = static_cast<int>(pages.size(1) / row_bytes);
    s.page_bytes = pages.size(1);
    if (s.page_bytes % 16) c.fail("must have pages of a multiple of 16 bytes");
  }
  if (s.page_size <= 0) c.fail("must hold at least one row per page");
  s.pages = pages.ptr<uint8_t>();
  s.num_pages = pages.size(0);
  Check(op, "slots", slots).dtype(DType::kI64).shape({rows}).contiguous();
  s.slots = slots.ptr<const int64_t>();
  return s;
}

}  // namespace deepfuse::api
