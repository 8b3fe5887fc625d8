// The DLPack ABI (https://dmlc.github.io/dlpack/latest/c_api.html, version 1.x) as far as
// deepfuse reads it: the tensor descriptor and the framework's C exchange API that fills one
// without allocating (torch.Tensor.__dlpack_c_exchange_api__, torch >= 2.10).
#pragma once
#include <cstdint>

namespace deepfuse::dlpack {

struct Version {
  uint32_t major;
  uint32_t minor;
};

enum DeviceType : int32_t { kCPU = 1, kCUDA = 2, kCUDAHost = 3, kCUDAManaged = 13 };

enum TypeCode : uint8_t {
  kInt = 0,
  kUInt = 1,
  kFloat = 2,
  kBfloat = 4,
  kBool = 6,
  kFloat8_e4m3fn = 10,
  kFloat8_e5m2 = 12,
  kFloat8_e8m0fnu = 14,
  kFloat4_e2m1fn = 17,
};

struct Device {
  int32_t device_type;
  int32_t device_id;
};

struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; NULL means compact row-major
  uint64_t byte_offset;
};

struct ManagedTensorVersioned;

extern "C" {
typedef int (*ManagedTensorAllocator)(Tensor*, ManagedTensorVersioned**, void*,
                                      void (*)(void*, const char*, const char*));
typedef int (*ManagedTensorFromPyObjectNoSync)(void*, ManagedTensorVersioned**);
typedef int (*ManagedTensorToPyObjectNoSync)(ManagedTensorVersioned*, void**);
typedef int (*TensorFromPyObjectNoSync)(void* py_object, Tensor* out);
typedef int (*CurrentWorkStream)(int32_t device_type, int32_t device_id, void** out_stream);
}

struct ExchangeAPIHeader {
  Version version;
  ExchangeAPIHeader* prev_api;
};

struct ExchangeAPI {
  ExchangeAPIHeader header;
  ManagedTensorAllocator managed_tensor_allocator;
  ManagedTensorFromPyObjectNoSync managed_tensor_from_py_object_no_sync;
  ManagedTensorToPyObjectNoSync managed_tensor_to_py_object_no_sync;
  TensorFromPyObjectNoSync dltensor_from_py_object_no_sync;  // may be NULL
  CurrentWorkStream current_work_stream;
};

}  // namespace deepfuse::dlpack
