// deepfuse._C launchers of the attention family: sparse attention over paged KV (one or two key
// sources) and its launch plan.
#include <cstdint>
#include <string>

#include "attention/sparse_attention.h"
#include "common/api.h"
#include "common/cuda_utils.h"

namespace deepfuse {

namespace api {

namespace {

constexpr int64_t kDim = 512;            // head dim (kv_format.KV_DIM)
constexpr int64_t kFp8RowBytes = 584;    // FP8 row: 576 data + 8 scale bytes (kv_format.KV_ROW_BYTES)
constexpr int64_t kPageAlignRows = 16;   // kv_format.PAGE_ALIGN_ROWS
constexpr int64_t kMaxInt = 0x7fffffff;

struct SourceNames {
  const char* cache;
  const char* index;
  const char* lengths;
};

// One key source of T query rows: cache pages (FP8 uint8 [P, page_size * 584] or bf16
// [P, page_size, 512]; page size and FP8-ness read from the tensor), index [T, K] slots,
// lengths [T] or None.
AttnSource key_source(const char* op, SourceNames n, const TensorArg& cache, const TensorArg& index,
                      const TensorArg& lengths, int64_t T) {
  AttnSource s;
  Check(op, n.cache, cache).dtype({DType::kU8, DType::kBF16});
  if (cache.dtype == DType::kU8) {
    Check(op, n.cache, cache).dim(2);
    const int64_t row_bytes = cache.size(1);
    if (row_bytes % kFp8RowBytes != 0 || row_bytes / kFp8RowBytes == 0 ||
        (row_bytes / kFp8RowBytes) % kPageAlignRows != 0)
      Check(op, n.cache, cache).fail("must be FP8 pages [num_pages, page_size * 584] with page_size a multiple of 16");
    s.page_size = static_cast<int>(row_bytes / kFp8RowBytes);
    s.page_bytes = row_bytes;
    s.fp8 = 1;
  } else {
    Check(op, n.cache, cache).shape({-1, -1, kDim});
    if (cache.size(1) < 1 || cache.size(1) > kMaxInt) Check(op, n.cache, cache).fail("must have a page size >= 1 (dim 1)");
    s.page_size = static_cast<int>(cache.size(1));
    s.page_bytes = cache.size(1) * kDim * 2;
    s.fp8 = 0;
  }
  Check(op, n.cache, cache).contiguous().aligned(16);
  s.num_slots = cache.size(0) * s.page_size;
  if (s.num_slots > kMaxInt) Check(op, n.cache, cache).fail("must have < 2^31 slots");
  s.base = cache.ptr<const uint8_t>();
  Check(op, n.index, index).dtype({DType::kI32, DType::kI64}).shape({T, -1}).contiguous();
  if (index.size(1) > kMaxInt) Check(op, n.index, index).fail("must have < 2^31 columns");
  s.idx = index.data;
  s.idx64 = index.dtype == DType::kI64 ? 1 : 0;
  s.K = static_cast<int>(index.size(1));
  Check(op, n.lengths, lengths).optional().dtype({DType::kI32, DType::kI64}).shape({T}).contiguous();
  s.len = lengths.defined() ? lengths.data : nullptr;
  s.len64 = lengths.defined() && lengths.dtype == DType::kI64 ? 1 : 0;
  return s;
}

}  // namespace

// Attention of q bf16 [T, H, 512] over the keys of `kv` (and `extra_kv`) named by their slot
// indices (ops/attention.py, sparse_attention_paged, defines the semantics). out bf16
// [T, H, 512] (out_scale None) or e4m3 [T, H * 512] with out_scale UE8M0 uint8 [T, H * 16];
// lse fp32 [T, H]; cos / sin fp32 [T, R / 2] (inverse RoPE on the last R dims) or None.
// splits > 1 needs ws_o fp32 [splits, T, H, 512] and ws_ml fp32 [splits, T, H, 2].
void sparse_attention_paged(const TensorArg& q, const TensorArg& kv, const TensorArg& indices,
                            const TensorArg& lengths, const TensorArg& extra_kv, const TensorArg& extra_indices,
                            const TensorArg& extra_lengths, const TensorArg& sink, double scale,
                            const TensorArg& cos, const TensorArg& sin, const TensorArg& out,
                            const TensorArg& out_scale, const TensorArg& lse, int group_rows, int splits,
                            const TensorArg& ws_o, const TensorArg& ws_ml) {
  const char* op = "sparse_attention_paged";
  Check(op, "q", q).dtype(DType::kBF16).dim(3).size(2, kDim).inner_contiguous().stride_aligned(0, 16)
      .stride_aligned(1, 16).aligned(16);
  const int64_t T = q.size(0), H = q.size(1);
  if (H != 64 && H != 128) Check(op, "q", q).fail("must have 64 or 128 heads (dim 1)");
  if (T > kMaxInt) Check(op, "q", q).fail("must have < 2^31 rows");

  AttnParams p;
  p.src[0] = key_source(op, {"kv", "indices", "lengths"}, kv, indices, lengths, T);
  if (extra_kv.defined()) {
    Check(op, "extra_indices", extra_indices).defined();
    p.src[1] = key_source(op, {"extra_kv", "extra_indices", "extra_lengths"}, extra_kv, extra_indices,
                          extra_lengths, T);
  } else {
    if (extra_indices.defined()) Check(op, "extra_indices", extra_indices).fail("must be None without extra_kv");
    if (extra_lengths.defined()) Check(op, "extra_lengths", extra_lengths).fail("must be None without extra_kv");
    p.src[1].page_size = 16;  // absent source: K = 0, never read
  }
  Check(op, "sink", sink).dtype(DType::kF32).shape({H}).contiguous();

  int64_t rope_pairs = 0;
  if (cos.defined()) {
    Check(op, "cos", cos).dtype(DType::kF32).dim(2).size(0, T).contiguous();
    rope_pairs = cos.size(1);
    if (2 * rope_pairs > kDim) Check(op, "cos", cos).fail("must have at most 256 columns (R / 2 with R <= 512)");
    Check(op, "sin", sin).dtype(DType::kF32).shape({T, rope_pairs}).contiguous();
  } else if (sin.defined()) {
    Check(op, "sin", sin).fail("must be None without cos");
  }

  Check(op, "out", out).dtype({DType::kBF16, DType::kF8E4M3});
  const bool mxfp8 = out.dtype == DType::kF8E4M3;
  if (mxfp8) {
    Check(op, "out", out).shape({T, H * kDim}).contiguous();
    Check(op, "out_scale", out_scale).dtype(DType::kU8).shape({T, H * kDim / 32}).contiguous();
  } else {
    Check(op, "out", out).shape({T, H, kDim}).contiguous();
    if (out_scale.defined()) Check(op, "out_scale", out_scale).fail("must be None with a bfloat16 out");
  }
  Check(op, "lse", lse).dtype(DType::kF32).shape({T, H}).contiguous();

  if (group_rows != 1 && group_rows != 2 && group_rows != 4)
    arg_error(op, "group_rows", "must be 1, 2 or 4 (got " + std::to_string(group_rows) + ")");
  if (splits < 1 || splits > 65535)
    arg_error(op, "splits", "must be in [1, 65535] (got " + std::to_string(splits) + ")");
  if (splits > 1) {
    Check(op, "ws_o", ws_o).defined();
    Check(op, "ws_ml", ws_ml).defined();
  }
  Check(op, "ws_o", ws_o).optional().dtype(DType::kF32).shape({splits, T, H, kDim}).contiguous();
  Check(op, "ws_ml", ws_ml).optional().dtype(DType::kF32).shape({splits, T, H, 2}).contiguous();

  check_same_cuda_device(op, {{"q", q}, {"kv", kv}, {"indices", indices}, {"lengths", lengths},
                              {"extra_kv", extra_kv}, {"extra_indices", extra_indices},
                              {"extra_lengths", extra_lengths}, {"sink", sink}, {"cos", cos}, {"sin", sin},
                              {"out", out}, {"out_scale", out_scale}, {"lse", lse}, {"ws_o", ws_o},
                              {"ws_ml", ws_ml}});
  if (T == 0) return;
  DeviceScope scope(op, "q", q);

  p.q = q.data;
  p.q_ld_t = q.strides(0);
  p.q_ld_h = q.strides(1);
  p.T = static_cast<int>(T);
  p.H = static_cast<int>(H);
  p.sink = sink.ptr<const float>();
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);  // * log2(e)
  p.cos = cos.defined() ? cos.ptr<const float>() : nullptr;
  p.sin = sin.defined() ? sin.ptr<const float>() : nullptr;
  p.rope_pairs = static_cast<int>(rope_pairs);
  p.mxfp8 = mxfp8 ? 1 : 0;
  p.out = out.data;
  p.out_scale = mxfp8 ? out_scale.ptr<uint8_t>() : nullptr;
  p.lse = lse.ptr<float>();
  p.G = group_rows;
  p.splits = splits;
  p.ws_o = ws_o.defined() ? ws_o.ptr<float>() : nullptr;
  p.ws_ml = ws_ml.defined() ? ws_ml.ptr<float>() : nullptr;
  deepfuse::sparse_attention_paged(p, as_cuda_stream(scope));
}

// The launch plan of sparse_attention_paged for T rows of H heads over K_total index columns
// in groups of group_rows rows, on CUDA device `device` (-1: the current one). Host only.
py::dict sparse_attention_plan(int64_t T, int64_t H, int64_t K_total, int group_rows, int device) {
  const char* op = "sparse_attention_plan";
  if (T < 0 || T > kMaxInt) arg_error(op, "T", "must be in [0, 2^31) (got " + std::to_string(T) + ")");
  if (H < 1 || H > kMaxInt) arg_error(op, "H", "must be in [1, 2^31) (got " + std::to_string(H) + ")");
  if (K_total < 0 || K_total > kMaxInt)
    arg_error(op, "K_total", "must be in [0, 2^31) (got " + std::to_string(K_total) + ")");
  if (group_rows != 1 && group_rows != 2 && group_rows != 4)
    arg_error(op, "group_rows", "must be 1, 2 or 4 (got " + std::to_string(group_rows) + ")");
  if (device < -1) arg_error(op, "device", "must be a CUDA ordinal or -1 (got " + std::to_string(device) + ")");
  int prev = -1;
  if (device >= 0) {
    check_cuda(cudaGetDevice(&prev), "cudaGetDevice");
    if (prev == device) prev = -1;
    else check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  AttnPlan pl{};
  try {
    pl = deepfuse::sparse_attention_plan(static_cast<int>(T), static_cast<int>(H), static_cast<int>(K_total),
                                         group_rows);
  } catch (...) {
    if (prev >= 0) cudaSetDevice(prev);
    throw;
  }
  if (prev >= 0) cudaSetDevice(prev);
  py::dict d;
  d["group_rows"] = pl.G;
  d["splits"] = pl.splits;
  d["ctas"] = pl.ctas;
  d["blocks"] = pl.blocks;
  return d;
}

}  // namespace api

void register_attention(py::module_& m) {
  const auto none = py::none();
  m.def("sparse_attention_paged", &api::sparse_attention_paged, py::kw_only(), py::arg("q"), py::arg("kv"),
        py::arg("indices"), py::arg("lengths") = none, py::arg("extra_kv") = none, py::arg("extra_indices") = none,
        py::arg("extra_lengths") = none, py::arg("sink"), py::arg("scale"), py::arg("cos") = none,
        py::arg("sin") = none, py::arg("out"), py::arg("out_scale") = none, py::arg("lse"),
        py::arg("group_rows") = 1, py::arg("splits") = 1, py::arg("ws_o") = none, py::arg("ws_ml") = none,
        "sparse attention of q bf16 [T, H, 512] over paged KV (FP8 or bf16 pages) named by slot indices; "
        "writes out (bf16 or e4m3 + UE8M0 out_scale) and lse");
  m.def("sparse_attention_plan", &api::sparse_attention_plan, py::kw_only(), py::arg("T"), py::arg("H"),
        py::arg("K_total"), py::arg("group_rows"), py::arg("device") = -1,
        "sparse attention launch plan on CUDA device `device`: dict(group_rows, splits, ctas, blocks of 32 keys)");
}

}  // namespace deepfuse
