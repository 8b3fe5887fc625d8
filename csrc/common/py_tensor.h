// pybind11 conversion of a torch.Tensor (or None) argument into deepfuse::TensorArg. Include
// this in the family api.cpp files that register launchers.
#pragma once
#include <pybind11/pybind11.h>

#include "common/tensor.h"

namespace deepfuse {

// Fills `out` from a tensor object; false when `obj` is not a tensor (pybind11 then reports a
// type error naming the launcher's signature). Throws when the framework's export fails.
bool load_tensor_arg(PyObject* obj, TensorArg& out);

}  // namespace deepfuse

namespace pybind11::detail {

template <>
struct type_caster<deepfuse::TensorArg> {
  PYBIND11_TYPE_CASTER(deepfuse::TensorArg, const_name("torch.Tensor | None"));
  bool load(handle src, bool) {
    if (src.is_none()) {
      value = deepfuse::TensorArg{};
      return true;
    }
    return deepfuse::load_tensor_arg(src.ptr(), value);
  }
  static handle cast(const deepfuse::TensorArg&, return_value_policy, handle) {
    throw cast_error("deepfuse.TensorArg cannot be returned to Python");
  }
};

}  // namespace pybind11::detail
