// TensorArg from a Python tensor (DLPack exchange API, or the tensor's attributes on
// frameworks without it), the argument checks and the device / stream scope of a launch.
#include <cuda_runtime.h>

#include <cstring>
#include <sstream>

#include "common/cuda_utils.h"
#include "common/dlpack_abi.h"
#include "common/py_tensor.h"

namespace py = pybind11;

namespace deepfuse {

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kF32: return "float32";
    case DType::kF64: return "float64";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
    case DType::kF8E4M3: return "float8_e4m3fn";
    case DType::kF8E5M2: return "float8_e5m2";
    case DType::kF8E8M0: return "float8_e8m0fnu";
    case DType::kF4x2: return "float4_e2m1fn_x2";
    case DType::kI8: return "int8";
    case DType::kU8: return "uint8";
    case DType::kI16: return "int16";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
    case DType::kBool: return "bool";
    default: return "an unsupported dtype";
  }
}

int64_t dtype_bytes(DType d) {
  switch (d) {
    case DType::kF32: case DType::kI32: return 4;
    case DType::kF64: case DType::kI64: return 8;
    case DType::kF16: case DType::kBF16: case DType::kI16: return 2;
    case DType::kOther: return 0;
    default: return 1;
  }
}

static DType from_dl(dlpack::DataType t) {
  if (t.lanes != 1) return DType::kOther;
  switch (t.code) {
    case dlpack::kFloat:
      return t.bits == 32 ? DType::kF32 : t.bits == 16 ? DType::kF16 : t.bits == 64 ? DType::kF64 : DType::kOther;
    case dlpack::kBfloat: return t.bits == 16 ? DType::kBF16 : DType::kOther;
    case dlpack::kFloat8_e4m3fn: return DType::kF8E4M3;
    case dlpack::kFloat8_e5m2: return DType::kF8E5M2;
    case dlpack::kFloat8_e8m0fnu: return DType::kF8E8M0;
    case dlpack::kFloat4_e2m1fn: return t.bits == 8 ? DType::kF4x2 : DType::kOther;
    case dlpack::kBool: return DType::kBool;
    case dlpack::kInt:
      return t.bits == 8 ? DType::kI8 : t.bits == 16 ? DType::kI16 : t.bits == 32 ? DType::kI32
             : t.bits == 64 ? DType::kI64 : DType::kOther;
    case dlpack::kUInt: return t.bits == 8 ? DType::kU8 : DType::kOther;
    default: return DType::kOther;
  }
}

static DType from_name(const std::string& s) {
  static const std::pair<const char*, DType> names[] = {
      {"torch.float32", DType::kF32}, {"torch.float64", DType::kF64}, {"torch.float16", DType::kF16},
      {"torch.bfloat16", DType::kBF16}, {"torch.float8_e4m3fn", DType::kF8E4M3},
      {"torch.float8_e5m2", DType::kF8E5M2}, {"torch.float8_e8m0fnu", DType::kF8E8M0},
      {"torch.float4_e2m1fn_x2", DType::kF4x2}, {"torch.int8", DType::kI8}, {"torch.uint8", DType::kU8},
      {"torch.int16", DType::kI16}, {"torch.int32", DType::kI32}, {"torch.int64", DType::kI64},
      {"torch.bool", DType::kBool}};
  for (const auto& [n, d] : names)
    if (s == n) return d;
  return DType::kOther;
}

// The exchange API of a tensor type: looked up once per Python type (torch.Tensor,
// nn.Parameter, ...). nullptr: the type has none (older frameworks).
static const dlpack::ExchangeAPI* exchange_api(PyTypeObject* type) {
  struct Entry {
    PyTypeObject* type;
    const dlpack::ExchangeAPI* api;
  };
  static Entry cache[8];
  static int n = 0;
  for (int i = 0; i < n; ++i)
    if (cache[i].type == type) return cache[i].api;
  const dlpack::ExchangeAPI* api = nullptr;
  PyObject* cap = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__dlpack_c_exchange_api__");
  if (cap == nullptr) {
    PyErr_Clear();
  } else {
    if (PyCapsule_CheckExact(cap)) {
      auto* a = static_cast<const dlpack::ExchangeAPI*>(PyCapsule_GetPointer(cap, "dlpack_exchange_api"));
      if (a == nullptr) PyErr_Clear();
      // the struct layout deepfuse reads is DLPack 1.x's; newer majors chain older ones
      for (auto* h = a ? &a->header : nullptr; h != nullptr; h = h->prev_api) {
        if (h->version.major == 1) {
          auto* cand = reinterpret_cast<const dlpack::ExchangeAPI*>(h);
          if (cand->dltensor_from_py_object_no_sync != nullptr && cand->current_work_stream != nullptr) api = cand;
          break;
        }
      }
    }
    Py_DECREF(cap);  // the capsule lives on the type for the process lifetime
  }
  if (n < 8) cache[n++] = {type, api};
  return api;
}

static void fill_dims(TensorArg& out, int ndim, const int64_t* shape, const int64_t* strides) {
  if (ndim > kMaxDims)
    throw std::invalid_argument("deepfuse: tensors of more than " + std::to_string(kMaxDims) + " dims are not supported");
  out.ndim = ndim;
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    out.shape[i] = shape[i];
    out.stride[i] = strides ? strides[i] : s;
    s *= shape[i];
  }
}

bool load_tensor_arg(PyObject* obj, TensorArg& out) {
  out = TensorArg{};
  const dlpack::ExchangeAPI* api = exchange_api(Py_TYPE(obj));
  if (api != nullptr) {
    dlpack::Tensor dl;
    if (api->dltensor_from_py_object_no_sync(obj, &dl) != 0) throw py::error_already_set();
    out.data = static_cast<char*>(dl.data) + dl.byte_offset;
    out.dtype = from_dl(dl.dtype);
    out.device_type = dl.device.device_type;
    out.device = dl.device.device_id;
    out.api = api;
    fill_dims(out, dl.ndim, dl.shape, dl.strides);
    return true;
  }
  // Frameworks without the exchange API: read the tensor's own attributes.
  py::handle h(obj);
  if (!py::hasattr(h, "data_ptr") || !py::hasattr(h, "stride") || !py::hasattr(h, "device")) return false;
  out.data = reinterpret_cast<void*>(h.attr("data_ptr")().cast<std::uintptr_t>());
  out.dtype = from_name(py::str(h.attr("dtype")).cast<std::string>());
  const py::object dev = h.attr("device");
  const std::string type = dev.attr("type").cast<std::string>();
  out.device_type = type == "cuda" ? dlpack::kCUDA : type == "cpu" ? dlpack::kCPU : 0;
  out.device = dev.attr("index").is_none() ? 0 : dev.attr("index").cast<int>();
  const py::tuple shape = h.attr("shape");
  const py::tuple stride = h.attr("stride")();
  int64_t sh[kMaxDims + 1], st[kMaxDims + 1];
  const int nd = static_cast<int>(shape.size());
  if (nd > kMaxDims)
    throw std::invalid_argument("deepfuse: tensors of more than " + std::to_string(kMaxDims) + " dims are not supported");
  for (int i = 0; i < nd; ++i) {
    sh[i] = shape[i].cast<int64_t>();
    st[i] = stride[i].cast<int64_t>();
  }
  fill_dims(out, nd, sh, st);
  return true;
}

bool TensorArg::is_contiguous() const {
  if (numel() == 0) return true;  // as torch: an empty tensor is contiguous whatever its strides
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != s) return false;
    s *= shape[i];
  }
  return true;
}

std::string TensorArg::describe() const {
  if (!defined()) return "None";
  std::ostringstream o;
  o << dtype_name(dtype) << "[";
  for (int i = 0; i < ndim; ++i) o << (i ? ", " : "") << shape[i];
  o << "] on " << (device_type == dlpack::kCUDA ? "cuda:" + std::to_string(device) : device_type == dlpack::kCPU ? std::string("cpu") : "device type " + std::to_string(device_type));
  return o.str();
}

void arg_error(const char* op, const char* name, const std::string& what) {
  throw std::invalid_argument(std::string("deepfuse.") + op + ": argument '" + name + "' " + what);
}

void Check::fail(const std::string& what) const { arg_error(op_, name_, what + " (got " + t_.describe() + ")"); }

Check& Check::defined() {
  if (!t_.defined()) fail("is required");
  return *this;
}

Check& Check::cuda(int device) {
  if (skip_) return *this;
  defined();
  if (!t_.is_cuda()) fail("must be a CUDA tensor");
  if (device >= 0 && t_.device != device) fail("must be on cuda:" + std::to_string(device));
  return *this;
}

Check& Check::dtype(DType d) {
  if (skip_) return *this;
  defined();
  if (t_.dtype != d) fail(std::string("must be ") + dtype_name(d));
  return *this;
}

Check& Check::dtype(std::initializer_list<DType> ds) {
  if (skip_) return *this;
  defined();
  std::string names;
  for (DType d : ds) {
    if (t_.dtype == d) return *this;
    names += (names.empty() ? "" : " or ") + std::string(dtype_name(d));
  }
  fail("must be " + names);
}

Check& Check::dim(int n) {
  if (skip_) return *this;
  defined();
  if (t_.ndim != n) fail("must have " + std::to_string(n) + " dims");
  return *this;
}

Check& Check::size(int d, int64_t n) {
  if (skip_) return *this;
  defined();
  const int i = d < 0 ? d + t_.ndim : d;
  if (i < 0 || i >= t_.ndim) fail("has no dim " + std::to_string(d));
  if (t_.shape[i] != n) fail("must have size " + std::to_string(n) + " in dim " + std::to_string(d));
  return *this;
}

Check& Check::shape(std::initializer_list<int64_t> s) {
  if (skip_) return *this;
  dim(static_cast<int>(s.size()));
  int i = 0;
  for (int64_t n : s) {
    if (n >= 0 && t_.shape[i] != n) {
      std::ostringstream want;
      int j = 0;
      for (int64_t m : s) {
        want << (j++ ? ", " : "[");
        if (m >= 0) want << m; else want << '*';
      }
      fail("must have shape " + want.str() + "]");
    }
    ++i;
  }
  return *this;
}

Check& Check::contiguous() {
  if (skip_) return *this;
  defined();
  if (!t_.is_contiguous()) fail("must be contiguous");
  return *this;
}

Check& Check::inner_contiguous() {
  if (skip_) return *this;
  defined();
  if (t_.ndim > 0 && t_.shape[t_.ndim - 1] > 1 && t_.stride[t_.ndim - 1] != 1) fail("must have stride 1 in its last dim");
  return *this;
}

Check& Check::aligned(int bytes) {
  if (skip_) return *this;
  defined();
  if (reinterpret_cast<std::uintptr_t>(t_.data) % bytes != 0) fail("must be " + std::to_string(bytes) + "-byte aligned");
  return *this;
}

Check& Check::stride_aligned(int d, int bytes) {
  if (skip_) return *this;
  defined();
  const int i = d < 0 ? d + t_.ndim : d;
  if (t_.shape[i] > 1 && (t_.stride[i] * dtype_bytes(t_.dtype)) % bytes != 0)
    fail("must have a stride in dim " + std::to_string(d) + " that is a multiple of " + std::to_string(bytes) + " bytes");
  return *this;
}

int check_same_cuda_device(const char* op, std::initializer_list<Named> ts) {
  int device = -1;
  for (const Named& n : ts) {
    if (!n.t.defined()) continue;
    Check(op, n.name, n.t).cuda(device);
    device = n.t.device;
  }
  return device;
}

DeviceScope::DeviceScope(const char* op, const char* name, const TensorArg& anchor) {
  Check(op, name, anchor).cuda();
  device_ = anchor.device;
  auto* api = static_cast<const dlpack::ExchangeAPI*>(anchor.api);
  if (api != nullptr) {
    if (api->current_work_stream(dlpack::kCUDA, device_, &stream_) != 0) throw py::error_already_set();
  } else {
    py::object torch = py::module_::import("torch");
    stream_ = reinterpret_cast<void*>(
        torch.attr("cuda").attr("current_stream")(device_).attr("cuda_stream").cast<std::uintptr_t>());
  }
  check_cuda(cudaGetDevice(&prev_), "cudaGetDevice");
  if (prev_ == device_) {
    prev_ = -1;
  } else {
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
  }
}

DeviceScope::~DeviceScope() {
  if (prev_ >= 0) cudaSetDevice(prev_);
}

}  // namespace deepfuse
