// What every family's api.cpp (the launchers registered in deepfuse._C) includes: the typed
// tensor argument, its checks and device scope, and the registration functions bindings.cpp
// calls. Launchers check dtype and shape before device (so the checks are testable without a
// GPU), then open a DeviceScope on their anchor tensor and launch on its stream.
#pragma once
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include "common/py_tensor.h"
#include "common/tensor.h"

namespace deepfuse {

namespace py = pybind11;

inline cudaStream_t as_cuda_stream(const DeviceScope& s) { return static_cast<cudaStream_t>(s.stream()); }

void register_cast(py::module_& m);
void register_topk(py::module_& m);
void register_kvcache(py::module_& m);
void register_attention(py::module_& m);
void register_moe(py::module_& m);
void register_gemm(py::module_& m);
void register_mhc(py::module_& m);
void register_norm(py::module_& m);
void register_compressor(py::module_& m);
void register_indexer(py::module_& m);

}  // namespace deepfuse
