// deepfuse._C launchers of the kvcache family: quantise-and-store of KV rows and indexer keys
// into paged caches / rings, and window row copies between pages, rings and dense buffers.
// Page formats: python/deepfuse/kv_format.py.
#include <string>

#include "common/api.h"
#include "kvcache/kvcache.h"

namespace deepfuse {

namespace api {

constexpr int64_t kKvDim = 512, kKvRowBytes = 584, kIdxDim = 128, kIdxRowBytes = 132;

// One layer-major page tensor: uint8 [L, P, page_size * fp8_row_bytes] (fp8 rows) or bf16
// [L, P, page_size, dim]; the pages of a layer dense, 16-byte aligned.
struct Pages {
  bool fp8;
  int page_size;
  int64_t layer_ld;    // bytes
  int64_t num_pages;
  int64_t page_bytes;
};

static Pages pages_of(const char* op, const char* name, const TensorArg& t, int64_t dim, int64_t fp8_row_bytes) {
  Check c(op, name, t);
  c.dtype({DType::kU8, DType::kBF16});
  Pages p{};
  p.fp8 = t.dtype == DType::kU8;
  int64_t page_elems;
  if (p.fp8) {
    c.dim(3);
    if (t.size(2) % fp8_row_bytes) c.fail("must hold whole " + std::to_string(fp8_row_bytes) + "-byte rows per page");
    p.page_size = static_cast<int>(t.size(2) / fp8_row_bytes);
    page_elems = t.size(2);
    c.inner_contiguous();
  } else {
    c.shape({-1, -1, -1, dim});
    p.page_size = static_cast<int>(t.size(2));
    page_elems = t.size(2) * dim;
    if ((dim > 1 && t.strides(3) != 1) || (t.size(2) > 1 && t.strides(2) != dim)) c.fail("must have dense pages");
  }
  if (p.page_size <= 0) c.fail("must hold at least one row per page");
  if (t.size(1) > 1 && t.strides(1) != page_elems) c.fail("must have dense pages (the pages of a layer contiguous)");
  const int64_t esize = dtype_bytes(t.dtype);
  p.page_bytes = page_elems * esize;
  if (p.page_bytes % 16) c.fail("must have pages of a multiple of 16 bytes");
  c.aligned(16).stride_aligned(0, 16);
  p.layer_ld = t.strides(0) * esize;
  p.num_pages = t.size(1);
  return p;
}

static void check_layers(const char* op, const char* name, const TensorArg& t, int64_t L, const char* of) {
  if (t.size(0) != L)
    Check(op, name, t).fail("must have " + std::to_string(L) + " layers (those of '" + of + "')");
}

// Rows x bf16 [L, T, dim], unit stride in dim, rows 16-byte aligned.
static void check_rows(const char* op, const char* name, const TensorArg& x, int64_t dim) {
  Check(op, name, x).dtype(DType::kBF16).shape({-1, -1, dim}).inner_contiguous().aligned(16).stride_aligned(0, 16)
      .stride_aligned(1, 16);
}

// Slots int32 / int64 [T] (all layers) or [L, T]; returns the layer stride (0: shared).
static int64_t check_slots(const char* op, const char* name, const TensorArg& s, int64_t L, int64_t T) {
  Check c(op, name, s);
  c.dtype({DType::kI32, DType::kI64}).contiguous();
  if (s.ndim == 2) {
    c.shape({L, T});
    return s.strides(0);
  }
  c.shape({T});
  return 0;
}

// kv bf16 [L, T, 512] -> cache (uint8 fp8 pages or bf16 pages, [L, ...]). positions None:
// slot = index[t] (or index[l, t]); positions int [T] (rings): page index[t], row
// positions[t] % window (window <= page_size).
void kv_store(const TensorArg& kv, const TensorArg& cache, const TensorArg& index, const TensorArg& positions,
              int window) {
  const char* op = "kv_store";
  check_rows(op, "kv", kv, kKvDim);
  const int64_t L = kv.size(0), T = kv.size(1);
  const Pages p = pages_of(op, "cache", cache, kKvDim, kKvRowBytes);
  check_layers(op, "cache", cache, L, "kv");
  int64_t index_ld = 0;
  if (positions.defined()) {
    Check(op, "index", index).dtype({DType::kI32, DType::kI64}).shape({T}).contiguous();
    Check(op, "positions", positions).dtype({DType::kI32, DType::kI64}).shape({T}).contiguous();
    if (window <= 0) arg_error(op, "window", "must be positive");
    if (p.page_size < window)
      Check(op, "cache", cache).fail("must hold window = " + std::to_string(window) + " rows per ring page");
  } else {
    index_ld = check_slots(op, "index", index, L, T);
  }
  check_same_cuda_device(op, {{"kv", kv}, {"cache", cache}, {"index", index}, {"positions", positions}});
  if (L == 0 || T == 0 || p.num_pages == 0) return;
  DeviceScope scope(op, "kv", kv);
  deepfuse::kv_store(kv.data, kv.strides(0), kv.strides(1), L, T, cache.data, p.layer_ld, p.num_pages, p.page_bytes,
                     p.page_size, p.fp8, index.data, index.dtype == DType::kI64, index_ld, positions.data,
                     positions.dtype == DType::kI64, window, as_cuda_stream(scope));
}

// k bf16 [L, T, 128] -> cache (uint8 fp8 key pages with scale_fmt "fp32" / "ue8m0" scales, or
// bf16 pages) at slots [T] / [L, T].
void indexer_key_store(const TensorArg& k, const TensorArg& cache, const TensorArg& slots,
                       const std::string& scale_fmt) {
  const char* op = "indexer_key_store";
  if (scale_fmt != "fp32" && scale_fmt != "ue8m0")
    arg_error(op, "scale_fmt", "must be fp32 or ue8m0 (got " + scale_fmt + ")");
  check_rows(op, "k", k, kIdxDim);
  const int64_t L = k.size(0), T = k.size(1);
  const Pages p = pages_of(op, "cache", cache, kIdxDim, kIdxRowBytes);
  check_layers(op, "cache", cache, L, "k");
  const int64_t slots_ld = check_slots(op, "slots", slots, L, T);
  check_same_cuda_device(op, {{"k", k}, {"cache", cache}, {"slots", slots}});
  if (L == 0 || T == 0 || p.num_pages == 0) return;
  DeviceScope scope(op, "k", k);
  const int kind = !p.fp8 ? 0 : scale_fmt == "fp32" ? 1 : 2;
  deepfuse::indexer_key_store(k.data, k.strides(0), k.strides(1), L, T, cache.data, p.layer_ld, p.num_pages,
                              p.page_bytes, p.page_size, kind, slots.data, slots.dtype == DType::kI64, slots_ld,
                              as_cuda_stream(scope));
}

// One side of a window copy: its pages and how a request's window row is located (index None:
// dense, page b row j; int [B]: ring, page index[b] row pos % window; int [B, n]: block table).
static KvSide side_of(const char* op, const char* cache_name, const TensorArg& cache, const Pages& p,
                      const char* index_name, const TensorArg& index, int64_t B, int window) {
  KvSide s{};
  s.base = cache.data;
  s.layer_ld = p.layer_ld;
  s.num_pages = p.num_pages;
  s.page_bytes = p.page_bytes;
  s.page_size = p.page_size;
  if (!index.defined()) {
    s.mode = 2;
    if (p.num_pages != B) Check(op, cache_name, cache).fail("must have one page per request (" + std::to_string(B) +
                                                            ") when its index is None");
    return s;
  }
  Check c(op, index_name, index);
  c.dtype({DType::kI32, DType::kI64});
  s.index = index.data;
  s.index64 = index.dtype == DType::kI64;
  if (index.ndim == 1) {
    c.shape({B}).contiguous();
    s.mode = 0;
    if (p.page_size < window)
      Check(op, cache_name, cache).fail("must hold window = " + std::to_string(window) + " rows per ring page");
  } else if (index.ndim == 2) {
    c.shape({B, -1}).inner_contiguous();
    s.mode = 1;
    s.index_ld = index.strides(0);
    s.index_cols = index.size(1);
  } else {
    c.fail("must be None (dense pages), [B] (ring slots) or [B, n] (a block table)");
  }
  return s;
}

// The window rows of each request (lengths int [B]: positions consumed; window rows
// max(n - window, 0) .. n - 1) from src_cache to dst_cache, both [L, ...] KV pages. fp8 -> fp8
// and bf16 -> bf16 copy rows, fp8 -> bf16 dequantises. A dense destination holds page_size
// rows per request; fill_missing (dense destinations only) zeroes the rows not copied.
void kv_window_copy(const TensorArg& src_cache, const TensorArg& src_index, const TensorArg& dst_cache,
                    const TensorArg& dst_index, const TensorArg& lengths, int window, bool fill_missing) {
  const char* op = "kv_window_copy";
  Check(op, "lengths", lengths).dtype({DType::kI32, DType::kI64}).dim(1).contiguous();
  const int64_t B = lengths.size(0);
  if (window <= 0) arg_error(op, "window", "must be positive");
  const Pages sp = pages_of(op, "src_cache", src_cache, kKvDim, kKvRowBytes);
  const Pages dp = pages_of(op, "dst_cache", dst_cache, kKvDim, kKvRowBytes);
  const int64_t L = src_cache.size(0);
  check_layers(op, "dst_cache", dst_cache, L, "src_cache");
  if (!sp.fp8 && dp.fp8)
    Check(op, "dst_cache", dst_cache).fail("must be bfloat16 when src_cache is (no requantisation)");
  const KvCopyKind kind = sp.fp8 ? (dp.fp8 ? KvCopyKind::kFp8 : KvCopyKind::kFp8ToBf16) : KvCopyKind::kBf16;
  const KvSide src = side_of(op, "src_cache", src_cache, sp, "src_index", src_index, B, window);
  const KvSide dst = side_of(op, "dst_cache", dst_cache, dp, "dst_index", dst_index, B, window);
  if (fill_missing && dst.mode != 2)
    Check(op, "dst_index", dst_index).fail("must be None when fill_missing (only dense destinations are filled)");
  const int rows = dst.mode == 2 ? dst.page_size : window;
  check_same_cuda_device(op, {{"src_cache", src_cache}, {"src_index", src_index}, {"dst_cache", dst_cache},
                              {"dst_index", dst_index}, {"lengths", lengths}});
  if (L == 0 || B == 0) return;
  DeviceScope scope(op, "src_cache", src_cache);
  deepfuse::kv_window_copy(src, dst, lengths.data, lengths.dtype == DType::kI64, L, B, window, rows, kind,
                           fill_missing, as_cuda_stream(scope));
}

}  // namespace api

void register_kvcache(py::module_& m) {
  m.def("kv_store", &api::kv_store, py::arg("kv"), py::arg("cache"), py::arg("index"),
        py::arg("positions") = py::none(), py::arg("window") = 1,
        "kv bf16 [L, T, 512] -> fp8 / bf16 KV pages at slots index (or ring rows: index, positions % window)");
  m.def("indexer_key_store", &api::indexer_key_store, py::arg("k"), py::arg("cache"), py::arg("slots"),
        py::arg("scale_fmt") = "fp32", "indexer keys bf16 [L, T, 128] -> fp8 / bf16 key pages at slots");
  m.def("kv_window_copy", &api::kv_window_copy, py::arg("src_cache"), py::arg("src_index"), py::arg("dst_cache"),
        py::arg("dst_index"), py::arg("lengths"), py::arg("window"), py::arg("fill_missing") = false,
        "each request's window rows between KV pages, rings (index [B]), block tables (index [B, n]) and dense "
        "buffers (index None)");
}

}  // namespace deepfuse
