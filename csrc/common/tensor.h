// deepfuse::TensorArg: the typed view of a tensor argument every launcher takes (data, dtype,
// shape, strides, device), filled from a torch.Tensor through DLPack without linking libtorch
// (common/py_tensor.h). Check: the C++ line of argument checks behind the Python op contracts.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <stdexcept>
#include <string>

namespace deepfuse {

enum class DType : uint8_t { kOther, kF32, kF64, kF16, kBF16, kF8E4M3, kF8E5M2, kF8E8M0, kF4x2, kI8, kU8, kI16, kI32, kI64, kBool };

const char* dtype_name(DType d);
int64_t dtype_bytes(DType d);  // 0 for kOther

constexpr int kMaxDims = 8;

struct TensorArg {
  void* data = nullptr;
  DType dtype = DType::kOther;
  int ndim = -1;          // -1: the argument was None
  int device_type = 0;    // DLPack device type: 1 CPU, 2 CUDA
  int device = -1;        // CUDA ordinal
  int64_t shape[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};  // in elements
  const void* api = nullptr;      // the producer's DLPack exchange API (stream queries)

  bool defined() const { return ndim >= 0; }
  bool is_cuda() const { return device_type == 2; }
  int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }
  int64_t strides(int d) const { return stride[d < 0 ? d + ndim : d]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  bool is_contiguous() const;  // dense row-major (size-1 dims ignored)
  template <typename T = void>
  T* ptr() const { return static_cast<T*>(data); }
  std::string describe() const;  // "bfloat16[4, 8] on cuda:0"
};

// The error of a bad argument (tensor or scalar): std::invalid_argument (ValueError in Python)
// "deepfuse.<op>: argument '<name>' <what>".
[[noreturn]] void arg_error(const char* op, const char* name, const std::string& what);

// Fluent checks with errors naming the op and the argument:
//   Check("fp8_linear", "x", x).cuda().dtype({DType::kBF16, DType::kF8E4M3}).dim(2).size(1, K);
// Errors are std::invalid_argument (ValueError in Python). optional(): a None argument passes
// every later check of the chain.
class Check {
 public:
  Check(const char* op, const char* name, const TensorArg& t) : op_(op), name_(name), t_(t) {}
  Check& optional() {
    skip_ = !t_.defined();
    return *this;
  }
  Check& defined();
  Check& cuda(int device = -1);  // a CUDA tensor (on `device` when >= 0)
  Check& dtype(DType d);
  Check& dtype(std::initializer_list<DType> ds);
  Check& dim(int n);
  Check& size(int d, int64_t n);
  Check& shape(std::initializer_list<int64_t> s);  // -1: any size
  Check& contiguous();
  Check& inner_contiguous();  // stride 1 in the last dim
  Check& aligned(int bytes);  // data pointer alignment
  Check& stride_aligned(int d, int bytes);  // stride of dim d in bytes a multiple of `bytes`
  [[noreturn]] void fail(const std::string& what) const;

 private:
  const char* op_;
  const char* name_;
  const TensorArg& t_;
  bool skip_ = false;
};

struct Named {
  const char* name;
  const TensorArg& t;
};

// Every defined tensor of `ts` is a CUDA tensor on the first one's device; returns that device.
// Launchers call this after the dtype / shape checks of all their arguments.
int check_same_cuda_device(const char* op, std::initializer_list<Named> ts);

// The CUDA device of `anchor` (made current for the launch, restored after) and its current
// stream as the tensor's framework sees it (the capture stream inside a CUDA graph).
class DeviceScope {
 public:
  DeviceScope(const char* op, const char* name, const TensorArg& anchor);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  void* stream() const { return stream_; }
  int device() const { return device_; }

 private:
  int prev_ = -1;
  int device_ = -1;
  void* stream_ = nullptr;
};

}  // namespace deepfuse
