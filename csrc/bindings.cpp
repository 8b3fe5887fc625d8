// deepfuse._C: the launchers of every kernel family (csrc/<family>/api.cpp), each taking typed
// tensors (common/tensor.h), checking them and launching on the tensors' device and current
// stream. None allocates or synchronises. The op contracts live in deepfuse.ops.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "common/api.h"
#include "common/cuda_utils.h"

namespace py = pybind11;

namespace deepfuse {
void register_engram(py::module_& m);  // csrc/engram/api.cpp
}  // namespace deepfuse

namespace {

std::vector<std::string> built_archs() {
  std::vector<std::string> out;
  std::string s = DEEPFUSE_ARCHS_STR;
  size_t a = 0;
  while (a <= s.size()) {
    size_t b = s.find(',', a);
    if (b == std::string::npos) b = s.size();
    if (b > a) out.push_back(s.substr(a, b - a));
    a = b + 1;
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "deepfuse CUDA launchers (typed tensors; the op contracts live in deepfuse.ops)";
  m.def("built_archs", &built_archs, "CUDA archs this module carries machine code for");
  m.def(
      "num_sms",
      [](int device) {
        int prev = 0;
        deepfuse::check_cuda(cudaGetDevice(&prev), "cudaGetDevice");
        if (device >= 0) deepfuse::check_cuda(cudaSetDevice(device), "cudaSetDevice");
        const int n = deepfuse::num_sms();
        if (device >= 0) cudaSetDevice(prev);
        return n;
      },
      py::arg("device") = -1);
  m.def(
      "tensor_arg",
      [](deepfuse::TensorArg t) { return t.describe(); },
      py::arg("t"), "testing hook: how a tensor argument reads on the C++ side");
  deepfuse::register_cast(m);
  deepfuse::register_topk(m);
  deepfuse::register_kvcache(m);
  deepfuse::register_attention(m);
  deepfuse::register_moe(m);
  deepfuse::register_gemm(m);
  deepfuse::register_mhc(m);
  deepfuse::register_norm(m);
  deepfuse::register_compressor(m);
  deepfuse::register_indexer(m);
  deepfuse::register_engram(m);
}
