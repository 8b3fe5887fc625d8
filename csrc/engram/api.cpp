// deepfuse._C launchers of the Engram family (DeepSeek V4.1): n-gram hash, gather +
// dequantisation of FP8 / UE8M0 table rows (table in device memory or page-locked host
// memory read over UVA), both fused, and the gate. Contracts: deepfuse/ops/engram.py.
#include <string>

#include "common/api.h"
#include "common/cuda_utils.h"
#include "engram/engram.h"

namespace deepfuse {

namespace api {

constexpr int64_t kScaleBlock = 32;

// ngram int32 / int64 [N, M], unit column stride; M >= 2.
static EngramHashArgs ngram_args(const char* op, const TensorArg& ngram) {
  Check c(op, "ngram", ngram);
  c.dtype({DType::kI32, DType::kI64}).dim(2).inner_contiguous();
  if (ngram.size(1) < 2) c.fail("must have >= 2 columns (the max n-gram size)");
  EngramHashArgs h{};
  h.ngram = ngram.data;
  h.ngram64 = ngram.dtype == DType::kI64;
  h.ngram_ld = ngram.size(0) > 1 ? ngram.strides(0) : ngram.size(1);
  h.M = static_cast<int>(ngram.size(1));
  return h;
}

// multipliers int64 [L, M] (layer_dim) or [M]; primes, offsets int64 [L, C] or [C],
// C = (M - 1) * H; all contiguous.
static void hash_consts(const char* op, EngramHashArgs& h, const TensorArg& mult, const TensorArg& primes,
                        const TensorArg& offsets, bool layered) {
  Check cm(op, "multipliers", mult);
  cm.dtype(DType::kI64).contiguous();
  Check cp(op, "primes", primes);
  cp.dtype(DType::kI64).contiguous();
  int64_t C;
  if (layered) {
    cm.shape({-1, h.M});
    cp.dim(2);
    if (primes.size(0) != mult.size(0)) cp.fail("must have " + std::to_string(mult.size(0)) + " rows (those of 'multipliers')");
    C = primes.size(1);
  } else {
    cm.shape({h.M});
    cp.dim(1);
    C = primes.size(0);
  }
  if (C == 0 || C % (h.M - 1)) cp.fail("must have (M - 1) * H columns, M - 1 = " + std::to_string(h.M - 1));
  Check co(op, "offsets", offsets);
  co.dtype(DType::kI64).contiguous();
  if (layered) co.shape({primes.size(0), C}); else co.shape({C});
  h.H = static_cast<int>(C / (h.M - 1));
  h.mult = mult.ptr<const int64_t>();
  h.primes = primes.ptr<const int64_t>();
  h.offsets = offsets.ptr<const int64_t>();
}

// table e4m3 (or its bytes) [R, D], D % 32 == 0; scale UE8M0 bytes [R, D / 32]; both dense.
static EngramTable table_args(const char* op, const TensorArg& table, const TensorArg& scale) {
  Check ct(op, "table", table);
  ct.dtype({DType::kF8E4M3, DType::kU8}).dim(2).contiguous().aligned(16);
  if (table.size(1) % kScaleBlock || table.size(1) == 0)
    ct.fail("must have rows a positive multiple of 32 wide");
  Check(op, "scale", scale).dtype({DType::kU8, DType::kF8E8M0}).shape({table.size(0), table.size(1) / kScaleBlock})
      .contiguous();
  return EngramTable{nullptr, nullptr, table.size(0), static_cast<int>(table.size(1))};
}

// Where the kernel reads a table tensor: its CUDA pointer on `device`, or the device pointer of
// page-locked host memory (UVA). Call with `device` current. While `stream` is capturing a
// graph the host pointer is taken as is (no pointer query inside a capture; page-locked memory
// from cudaHostAlloc has the same address on the device): page-locking is checked outside.
static const uint8_t* table_ptr(const char* op, const char* name, const TensorArg& t, int device,
                                cudaStream_t stream) {
  if (t.numel() == 0) return nullptr;
  if (t.is_cuda()) {
    Check(op, name, t).cuda(device);
    return t.ptr<const uint8_t>();
  }
  if (t.device_type != 1 && t.device_type != 3)  // DLPack CPU / CUDA host
    Check(op, name, t).fail("must be a CUDA tensor or in page-locked host memory");
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &cap), "cudaStreamIsCapturing");
  if (cap != cudaStreamCaptureStatusNone) return t.ptr<const uint8_t>();  // UVA: host pointer == device pointer
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, t.data);
  if (e != cudaSuccess) cudaGetLastError();  // not sticky: clear it
  if (e != cudaSuccess || a.type != cudaMemoryTypeHost || a.devicePointer == nullptr)
    Check(op, name, t).fail("is in pageable host memory: the kernel reads page-locked host memory over UVA "
                            "(pin it: ops.engram.to_host)");
  return static_cast<const uint8_t*>(a.devicePointer);
}

static EngramOut out_type(const char* op, const TensorArg& out) {
  Check(op, "out", out).dtype({DType::kF32, DType::kBF16, DType::kF16});
  return out.dtype == DType::kF32 ? EngramOut::kF32 : out.dtype == DType::kBF16 ? EngramOut::kBF16 : EngramOut::kF16;
}

// ngram [N, M] -> out int64 [N, L, C] (multipliers [L, M], primes / offsets [L, C]).
void engram_hash(const TensorArg& ngram, const TensorArg& multipliers, const TensorArg& primes,
                 const TensorArg& offsets, const TensorArg& out) {
  const char* op = "engram_hash";
  EngramHashArgs h = ngram_args(op, ngram);
  hash_consts(op, h, multipliers, primes, offsets, true);
  const int64_t N = ngram.size(0), L = multipliers.size(0), C = primes.size(1);
  Check(op, "out", out).dtype(DType::kI64).shape({N, L, C}).contiguous();
  check_same_cuda_device(op, {{"ngram", ngram}, {"multipliers", multipliers}, {"primes", primes},
                              {"offsets", offsets}, {"out", out}});
  if (N == 0 || L == 0) return;
  DeviceScope scope(op, "out", out);
  deepfuse::engram_hash(h, N, static_cast<int>(L), out.ptr<int64_t>(), as_cuda_stream(scope));
}

// table / scale rows at ids int32 / int64 [N, C] (unit column stride) -> out [N, C, D].
void engram_lookup(const TensorArg& table, const TensorArg& scale, const TensorArg& ids, const TensorArg& out) {
  const char* op = "engram_lookup";
  EngramTable t = table_args(op, table, scale);
  Check(op, "ids", ids).dtype({DType::kI32, DType::kI64}).dim(2).inner_contiguous();
  const int64_t N = ids.size(0), C = ids.size(1);
  const EngramOut type = out_type(op, out);
  Check(op, "out", out).shape({N, C, t.D}).contiguous().aligned(16);
  const int device = check_same_cuda_device(op, {{"ids", ids}, {"out", out}});
  if (N == 0 || C == 0) return;
  DeviceScope scope(op, "out", out);
  t.rows = table_ptr(op, "table", table, device, as_cuda_stream(scope));
  t.scale = table_ptr(op, "scale", scale, device, as_cuda_stream(scope));
  const int64_t ld = N > 1 ? ids.strides(0) : C;
  deepfuse::engram_lookup(t, ids.data, ids.dtype == DType::kI64, ld, N, static_cast<int>(C), out.data, type,
                          as_cuda_stream(scope));
}

// ngram [N, M], one layer's multipliers [M], primes / offsets [C] -> out [N, C, D].
void engram_embed(const TensorArg& ngram, const TensorArg& multipliers, const TensorArg& primes,
                  const TensorArg& offsets, const TensorArg& table, const TensorArg& scale, const TensorArg& out) {
  const char* op = "engram_embed";
  EngramHashArgs h = ngram_args(op, ngram);
  hash_consts(op, h, multipliers, primes, offsets, false);
  EngramTable t = table_args(op, table, scale);
  const int64_t N = ngram.size(0), C = primes.size(0);
  const EngramOut type = out_type(op, out);
  Check(op, "out", out).shape({N, C, t.D}).contiguous().aligned(16);
  const int device = check_same_cuda_device(op, {{"ngram", ngram}, {"multipliers", multipliers}, {"primes", primes},
                                                 {"offsets", offsets}, {"out", out}});
  if (N == 0) return;
  DeviceScope scope(op, "out", out);
  t.rows = table_ptr(op, "table", table, device, as_cuda_stream(scope));
  t.scale = table_ptr(op, "scale", scale, device, as_cuda_stream(scope));
  deepfuse::engram_embed(h, N, t, out.data, type, as_cuda_stream(scope));
}

// hidden [N, n, d], kv [N, n + 1, d] (bf16 / fp32, same dtype), w_hidden / w_embed fp32 [n, d]
// -> out [N, n, d] (hidden's dtype); all contiguous, d % 8 == 0.
void engram_gate(const TensorArg& hidden, const TensorArg& kv, const TensorArg& w_hidden, const TensorArg& w_embed,
                 const TensorArg& out, double clamp, double eps) {
  const char* op = "engram_gate";
  Check(op, "hidden", hidden).dtype({DType::kBF16, DType::kF32}).dim(3).contiguous().aligned(16);
  const int64_t N = hidden.size(0), n = hidden.size(1), d = hidden.size(2);
  if (d % 8) Check(op, "hidden", hidden).fail("must have rows a multiple of 8 wide");
  Check(op, "kv", kv).dtype(hidden.dtype).shape({N, n + 1, d}).contiguous().aligned(16);
  Check(op, "w_hidden", w_hidden).dtype(DType::kF32).shape({n, d}).contiguous().aligned(16);
  Check(op, "w_embed", w_embed).dtype(DType::kF32).shape({n, d}).contiguous().aligned(16);
  Check(op, "out", out).dtype(hidden.dtype).shape({N, n, d}).contiguous().aligned(16);
  if (!(clamp >= 0)) arg_error(op, "clamp", "must be >= 0");
  if (!(eps >= 0)) arg_error(op, "eps", "must be >= 0");
  check_same_cuda_device(op, {{"hidden", hidden}, {"kv", kv}, {"w_hidden", w_hidden}, {"w_embed", w_embed},
                              {"out", out}});
  if (N == 0 || n == 0 || d == 0) return;
  DeviceScope scope(op, "out", out);
  deepfuse::engram_gate(hidden.data, kv.data, w_hidden.ptr<const float>(), w_embed.ptr<const float>(), out.data, N,
                        static_cast<int>(n), static_cast<int>(d), hidden.dtype == DType::kBF16,
                        static_cast<float>(clamp), static_cast<float>(eps), as_cuda_stream(scope));
}

}  // namespace api

void register_engram(py::module_& m) {
  m.def("engram_hash", &api::engram_hash, py::arg("ngram"), py::arg("multipliers"), py::arg("primes"),
        py::arg("offsets"), py::arg("out"), "Engram n-gram hash: ngram [N, M] -> table rows out int64 [N, L, C]");
  m.def("engram_lookup", &api::engram_lookup, py::arg("table"), py::arg("scale"), py::arg("ids"), py::arg("out"),
        "Engram rows: FP8 table rows (device or page-locked host memory) at ids [N, C], dequantised into out "
        "[N, C, D]");
  m.def("engram_embed", &api::engram_embed, py::arg("ngram"), py::arg("multipliers"), py::arg("primes"),
        py::arg("offsets"), py::arg("table"), py::arg("scale"), py::arg("out"),
        "Engram hash + gather + dequantisation of one layer in one pass: ngram [N, M] -> out [N, C, D]");
  m.def("engram_gate", &api::engram_gate, py::arg("hidden"), py::arg("kv"), py::arg("w_hidden"), py::arg("w_embed"),
        py::arg("out"), py::arg("clamp"), py::arg("eps"), "Engram gate: out = hidden + g * value per stream");
}

}  // namespace deepfuse
