// Entry points of the single-pass CPU kernels (one source per op: rms_norm.cpp,
// adalayernorm.cpp, rope.cpp, glu.cpp, fast_gelu.cpp (linear_gelu too), group_norm_silu.cpp,
// channel_rms_norm.cpp,
// mul_add.cpp, cat_linear.cpp, int8_linear.cpp, dequant_linear.cpp; linear.cpp: aten's linear layer for the
// generated runner; the build and streaming settings in common.cpp; helpers
// shared by them in common.h).
//
// Each returns a new contiguous output, or std::nullopt when it does not
// cover the form of its inputs (the caller then uses another kernel).  These
// declarations serve the Python bindings (bindings.cpp); the C++ executor
// reaches each kernel through the entry its source registers (entries.h).

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <typeinfo>
#include <vector>

namespace mindiesd_cpu {

std::optional<at::Tensor> rms_norm(
    const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps, at::ScalarType out_dtype);
std::optional<at::Tensor> adalayernorm(
    const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift, double eps,
    at::ScalarType out_dtype);
std::optional<at::Tensor> rope(
    const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
    at::ScalarType out_dtype);
std::optional<at::Tensor> norm_rope(
    const std::vector<at::Tensor>& xs, int64_t dim, const std::vector<std::optional<at::Tensor>>& weights,
    double eps, std::optional<at::ScalarType> norm_dtype, int64_t head_dim, const at::Tensor& cos,
    const at::Tensor& sin, bool interleaved, at::ScalarType out_dtype);
std::optional<at::Tensor> glu(
    const at::Tensor& x, const std::optional<at::Tensor>& y, const std::string& activation, bool gate_first);
std::optional<at::Tensor> fast_gelu(const at::Tensor& x);
std::optional<at::Tensor> channel_rms_norm(
    const at::Tensor& x, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double scale, double eps, bool silu);
std::optional<at::Tensor> group_norm_silu(
    const at::Tensor& x, int64_t groups, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps);
std::optional<at::Tensor> linear(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
// linear.out of 2-D rows into a contiguous ``out`` (returned); nullopt where it does not cover the form.
std::optional<at::Tensor> linear_out(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& out);
std::optional<at::Tensor> cat_linear(
    const std::vector<at::Tensor>& xs, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
std::optional<at::Tensor> linear_gelu(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
std::optional<at::Tensor> mul_add(const at::Tensor& x, const at::Tensor& y, const at::Tensor& z);
std::optional<at::Tensor> int8_linear(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& compensation, double eps,
    at::ScalarType out_dtype);
// How int8_linear computes its integer product: chosen by the CPU's int8 instructions (kAuto), or as set.
enum class IntegerGemm : int { kAuto, kSigned, kUnsigned, kFloat, kDot };
// Sets it by name: auto, signed, unsigned, float or dot (for tests and measurements; auto by default).
void set_int8_gemm(const std::string& name);
// The product int8_linear computes for ``rows`` rows, with or without the weight's compensation.
std::string int8_gemm(int64_t rows, bool compensated);
std::optional<at::Tensor> dequant_linear(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
    const std::optional<at::Tensor>& bias, bool scale_first, at::ScalarType out_dtype);

// A plain strided tensor of a device with no TensorImpl of its own (not a subclass, nor a wrapper): a view of it
// made by hand (alias_view) is the view ATen makes below the view-tracking layer.
inline bool plain_impl(const at::Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return typeid(*impl) == typeid(c10::TensorImpl) && t.layout() == at::kStrided && (t.is_cpu() || t.is_cuda()) &&
         !impl->is_python_dispatch() && t.has_storage();
}

// A view of the plain tensor ``base`` (plain_impl) with these sizes, strides and storage offset, made without a
// call through the dispatcher and without view tracking (as a view op below ADInplaceOrView makes it).
at::Tensor alias_view(const at::Tensor& base, at::IntArrayRef sizes, at::IntArrayRef strides, int64_t offset);

// ATen CPU capability the kernels were compiled for, e.g. "AVX512+BF16".
std::string capability();
// float32 lanes of one vector.
int64_t vector_lanes();
// Outputs of at least ``bytes`` use non-temporal stores (-1: 3/4 of L3).
void set_streaming_threshold(int64_t bytes);
int64_t streaming_threshold();

}  // namespace mindiesd_cpu
