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
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

namespace mindiesd_cpu {
namespace {

bool plain(const Tensor& t, bool grad_mode) {
  return on_cpu(t) && !t.key_set().has(c10::DispatchKey::Python) && !(grad_mode && t.requires_grad());
}

}  // namespace

std::optional<Tensor> linear(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
  const bool biased = bias.has_value() && bias->defined();
  const bool grad_mode = at::GradMode::is_enabled();
  const ScalarType dtype = x.scalar_type();
  if (!plain(x, grad_mode) || !plain(weight, grad_mode) || (biased && !plain(*bias, grad_mode)) ||
      c10::impl::TorchDispatchModeTLS::stack_len() > 0 || at::autocast::is_autocast_enabled(at::kCPU) ||
      !(is_covered_float(dtype) || dtype == ScalarType::Double) || weight.scalar_type() != dtype ||
      weight.dim() != 2 || x.dim() < 2 || x.dim() > 3 || x.size(-1) != weight.size(1) ||
      (x.dim() == 3 && !x.is_contiguous()) ||
      (biased && (bias->scalar_type() != dtype || bias->dim() != 1 || bias->size(0) != weight.size(0)))) {
    return std::nullopt;
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const Tensor rows = x.dim() == 2 ? x : x.view({-1, x.size(2)});
  Tensor out = biased ? at::cpu::addmm(*bias, rows, weight.t()) : at::cpu::mm(rows, weight.t());
  if (x.dim() == 3) {
    out = out.view({x.size(0), x.size(1), weight.size(0)});
  }
  return out;
}

}  // namespace mindiesd_cpu
