// Python bindings of the single-pass CPU kernels (see kernels.h).
//
// Kept apart from the kernel sources so that they compile in parallel: the
// Python and pybind11 headers take as long to parse as the kernels.

#include "kernels.h"

#include <torch/csrc/utils/pybind.h>

#include <pybind11/stl.h>

namespace mindiesd_cpu {
void bind_executor(pybind11::module_& m);  // executor.cpp
}  // namespace mindiesd_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using py::arg;
  const auto release = py::call_guard<py::gil_scoped_release>();
  m.doc() = "Single-pass CPU kernels for the mindiesd operators (None: form not covered).";
  m.def("rms_norm", &mindiesd_cpu::rms_norm, arg("x"), arg("weight"), arg("eps"), arg("out_dtype"), release);
  m.def("adalayernorm", &mindiesd_cpu::adalayernorm, arg("x"), arg("scale"), arg("shift"), arg("eps"),
        arg("out_dtype"), release);
  m.def("rope", &mindiesd_cpu::rope, arg("x"), arg("cos"), arg("sin"), arg("interleaved"), arg("out_dtype"),
        release);
  m.def("norm_rope", &mindiesd_cpu::norm_rope, arg("xs"), arg("dim"), arg("weights"), arg("eps"), arg("norm_dtype"),
        arg("head_dim"), arg("cos"), arg("sin"), arg("interleaved"), arg("out_dtype"), release);
  m.def("glu", &mindiesd_cpu::glu, arg("x"), arg("y"), arg("activation"), arg("gate_first"), release);
  m.def("fast_gelu", &mindiesd_cpu::fast_gelu, arg("x"), release);
  m.def("channel_rms_norm", &mindiesd_cpu::channel_rms_norm, arg("x"), arg("weight"), arg("bias"), arg("scale"),
        arg("eps"), arg("silu"), release);
  m.def("group_norm_silu", &mindiesd_cpu::group_norm_silu, arg("x"), arg("groups"), arg("weight"), arg("bias"),
        arg("eps"), release);
  m.def("linear", &mindiesd_cpu::linear, arg("x"), arg("weight"), arg("bias"), release);
  m.def("cat_linear", &mindiesd_cpu::cat_linear, arg("xs"), arg("weight"), arg("bias"), release);
  m.def("linear_gelu", &mindiesd_cpu::linear_gelu, arg("x"), arg("weight"), arg("bias"), release);
  m.def("mul_add", &mindiesd_cpu::mul_add, arg("x"), arg("y"), arg("z"), release);
  m.def("int8_linear", &mindiesd_cpu::int8_linear, arg("x"), arg("weight"), arg("weight_scale"), arg("bias"),
        arg("compensation"), arg("eps"), arg("out_dtype"), release);
  m.def("set_int8_gemm", &mindiesd_cpu::set_int8_gemm, arg("name"),
        "int8_linear's integer product: auto (by the CPU's int8 instructions), signed, unsigned, float or dot.");
  m.def("int8_gemm", &mindiesd_cpu::int8_gemm, arg("rows"), arg("compensated"),
        "The integer product int8_linear computes for that many rows.");
  m.def("dequant_linear", &mindiesd_cpu::dequant_linear, arg("x"), arg("weight"), arg("weight_scale"), arg("bias"),
        arg("scale_first"), arg("out_dtype"), release);
  m.def("capability", &mindiesd_cpu::capability);
  m.def("set_streaming_threshold", &mindiesd_cpu::set_streaming_threshold, arg("bytes"),
        "Outputs of at least ``bytes`` use non-temporal stores (-1: 3/4 of the L3 size).");
  m.def("streaming_threshold", &mindiesd_cpu::streaming_threshold);
  m.attr("vector_lanes") = mindiesd_cpu::vector_lanes();
  mindiesd_cpu::bind_executor(m);
}
