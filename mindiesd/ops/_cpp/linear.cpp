// linear: the aten linear layer of an inference graph in one call from the
// host, as ATen decomposes it (addmm of the rows and the transposed weight,
// mm without a bias; a contiguous 3-D input viewed as rows and back), calling
// the CPU GEMM kernels themselves rather than through the dispatcher's
// autograd and view-tracking layers, which an inference graph does not need.
// Declines (nullopt: the caller runs torch's linear) wherever those layers or
// another dispatch could matter: an input that requires grad while grad mode
// is on, a tensor subclass or an active dispatch mode, autocast, a device
// other than the CPU, mixed dtypes, or another form of input.

#include "common.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <cstring>

namespace mindiesd_cpu {
namespace {

bool plain(const Tensor& t, bool grad_mode) {
  return on_cpu(t) && plain_impl(t) && !t.key_set().has(c10::DispatchKey::Python) && !(grad_mode && t.requires_grad());
}

}  // namespace

bool plain_gemm_operands(std::initializer_list<const Tensor*> tensors) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 || at::autocast::is_autocast_enabled(at::kCPU)) {
    return false;
  }
  const bool grad_mode = at::GradMode::is_enabled();
  for (const Tensor* t : tensors) {
    if (t != nullptr && !plain(*t, grad_mode)) {
      return false;
    }
  }
  return true;
}

Tensor transposed_block(const Tensor& weight, int64_t first, int64_t count) {
  return alias_view(weight, {count, weight.size(0)}, {weight.stride(1), weight.stride(0)},
                    weight.storage_offset() + first * weight.stride(1));
}

void gemm_rows_into(Tensor& out, const Tensor& rows, const Tensor& weight_t, const Tensor* bias) {
  if (bias == nullptr) {
    at::cpu::mm_out(out, rows, weight_t);
    return;
  }
  // What addmm does first: the output holds the bias, and the GEMM adds into it (beta 1). addmm's own copy goes
  // through TensorIterator, which costs more than the GEMM itself at small sizes; a contiguous bias is copied by
  // rows here.
  const int64_t m = out.size(0);
  const int64_t n = out.size(1);
  if (bias->stride(0) == 1 || n <= 1) {
    const int64_t bytes = n * static_cast<int64_t>(out.element_size());
    const char* source = static_cast<const char*>(bias->const_data_ptr());
    char* target = static_cast<char*>(out.mutable_data_ptr());
    for (int64_t r = 0; r < m; ++r) {
      std::memcpy(target + r * bytes, source, static_cast<size_t>(bytes));
    }
  } else {
    out.copy_(bias->expand({m, n}));
  }
  at::cpu::addmm_out(out, out, rows, weight_t);
}

std::optional<Tensor> linear(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
  const bool biased = bias.has_value() && bias->defined();
  const ScalarType dtype = x.scalar_type();
  if (!plain_gemm_operands({&x, &weight, biased ? &*bias : nullptr}) ||
      !(is_covered_float(dtype) || dtype == ScalarType::Double) || weight.scalar_type() != dtype ||
      weight.dim() != 2 || x.dim() < 2 || x.dim() > 3 || x.size(-1) != weight.size(1) ||
      (x.dim() == 3 && !x.is_contiguous()) ||
      (biased && (bias->scalar_type() != dtype || bias->dim() != 1 || bias->size(0) != weight.size(0)))) {
    return std::nullopt;
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  // The rows of x, the transposed weight and the output's rows as views made by hand: plain tensors, and a call
  // through the dispatcher for each would cost more than the GEMM of a small layer.
  const int64_t k = weight.size(1);
  const int64_t n = weight.size(0);
  const int64_t m = x.dim() == 2 ? x.size(0) : x.size(0) * x.size(1);
  const Tensor rows = x.dim() == 2 ? x : alias_view(x, {m, k}, {k, 1}, x.storage_offset());
  Tensor out = x.dim() == 2 ? empty_output(x, {m, n}, dtype) : empty_output(x, {x.size(0), x.size(1), n}, dtype);
  Tensor out_rows = x.dim() == 2 ? out : alias_view(out, {m, n}, {n, 1}, 0);
  gemm_rows_into(out_rows, rows, transposed_block(weight, 0, k), biased ? &*bias : nullptr);
  return out;
}

std::optional<Tensor> linear_out(
    const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, const Tensor& out) {
  const bool biased = bias.has_value() && bias->defined();
  const ScalarType dtype = x.scalar_type();
  if (!plain_gemm_operands({&x, &weight, &out, biased ? &*bias : nullptr}) ||
      !(is_covered_float(dtype) || dtype == ScalarType::Double) || weight.scalar_type() != dtype ||
      out.scalar_type() != dtype || weight.dim() != 2 || x.dim() != 2 || out.dim() != 2 ||
      x.size(1) != weight.size(1) || out.size(0) != x.size(0) || out.size(1) != weight.size(0) ||
      !out.is_contiguous() || out.is_same(x) || out.is_same(weight) ||
      (biased && (bias->scalar_type() != dtype || bias->dim() != 1 || bias->size(0) != weight.size(0)))) {
    return std::nullopt;
  }
  // torch's linear.out of 2-D rows: addmm_out (mm_out without a bias), the same GEMM into the same output.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  Tensor target = out;
  gemm_rows_into(target, x, transposed_block(weight, 0, weight.size(1)), biased ? &*bias : nullptr);
  return out;
}

namespace {

// The executor's entry (entries.h): aten's linear(x, weight, bias).
const EntryRegistrar kLinearEntry("linear", [](const EntryArgs& a) {
  return mindiesd_cpu::linear(a.tensor(0), a.tensor(1), a.optional_tensor(2));
});

// The executor's entry (entries.h): aten's linear.out(x, weight, bias, out=out): the program passes out fourth.
const EntryRegistrar kLinearOutEntry("linear_out", [](const EntryArgs& a) {
  return mindiesd_cpu::linear_out(a.tensor(0), a.tensor(1), a.optional_tensor(2), a.tensor(3));
});

}  // namespace

}  // namespace mindiesd_cpu
