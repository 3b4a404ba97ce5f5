// The only PYBIND11_MODULE of the package. Each subsystem exposes register_*(m).
#include <pybind11/pybind11.h>

namespace py = pybind11;

void register_ops(py::module_& m);  // ops_bindings.cpp: the data-plane kernels

PYBIND11_MODULE(_C, m) {
  m.doc() = "vllm_hisparse CUDA data plane (resolve, gather_rows, page copies, mirrors)";
  m.attr("cuda_archs") = HISPARSE_CUDA_ARCHS;
  register_ops(m);
}
