// fast_gelu: tanh-approximated GELU, elementwise (a flat loop over contiguous
// input, a TensorIterator otherwise); linear_gelu: ATen's linear layer, then
// that loop in place over its (new, contiguous) output.

#include "common.h"

#include <ATen/native/TensorIterator.h>
#include <ATen/ops/linear.h>
#include <ATen/native/cpu/Loops.h>

namespace mindiesd_cpu {
namespace {

template <typename T>
void gelu_loop(at::TensorIteratorBase& iter) {
  if constexpr (std::is_same_v<T, float>) {
    at::native::cpu_kernel_vec(
        iter, [](float v) -> float { return gelu_tanh(v); },
        [](fVec v) -> fVec { return gelu_tanh(v); });
  } else {
    using Vec = at::vec::Vectorized<T>;
    at::native::cpu_kernel_vec(
        iter, [](T v) -> T { return static_cast<T>(gelu_tanh(static_cast<float>(v))); },
        [](Vec v) -> Vec {
          auto [a, b] = at::vec::convert_to_float<T>(v);
          return from_float<T>(gelu_tanh(a), gelu_tanh(b));
        });
  }
}

// Contiguous input: one flat loop over blocks, split across threads.
template <typename T>
void gelu_contiguous(const Tensor& x, Tensor& out) {
  const T* in = x.const_data_ptr<T>();
  T* result = out.mutable_data_ptr<T>();
  const int64_t numel = x.numel();
  const bool stream = streams(out);
  const int64_t blocks = (numel + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, kParallelElements / kBlock, [&](int64_t begin, int64_t end) {
    for_each_block(begin * kBlock, std::min(end * kBlock, numel), stream, [&](const auto& block) {
      const auto [a, b] = block.load(in);
      block.store(result, gelu_tanh(a), gelu_tanh(b));
    });
    finish_streaming(stream);
  });
}

}  // namespace

std::optional<Tensor> fast_gelu(const Tensor& x) {
  if (!on_cpu(x) || !is_covered_float(x.scalar_type())) {
    return std::nullopt;
  }
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // internal views skip autograd and view tracking
  Tensor out = empty_output(x, x.sizes(), x.scalar_type());
  if (x.numel() == 0) {
    return out;
  }
  if (x.is_contiguous()) {
    dispatch_float(x.scalar_type(), [&](auto tag) { gelu_contiguous<decltype(tag)>(x, out); });
    return out;
  }
  auto iter = at::TensorIteratorConfig().add_output(out).add_const_input(x).build();
  dispatch_float(x.scalar_type(), [&](auto tag) { gelu_loop<decltype(tag)>(iter); });
  return out;
}

std::optional<Tensor> linear_gelu(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
  const bool biased = bias.has_value() && bias->defined();
  if (!on_cpu(x) || !on_cpu(weight) || !is_covered_float(x.scalar_type()) || x.dim() < 1 || weight.dim() != 2 ||
      weight.scalar_type() != x.scalar_type() || x.size(-1) != weight.size(1) ||
      (biased && !(on_cpu(*bias) && bias->scalar_type() == x.scalar_type() && bias->dim() == 1 &&
                   bias->size(0) == weight.size(0)))) {
    return std::nullopt;
  }
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // internal views skip autograd and view tracking
  // The GEMM rounded to x's dtype, as eager's linear; its output is new, so the GELU overwrites it.
  std::optional<Tensor> straight = mindiesd_cpu::linear(x, weight, bias);
  Tensor out = straight.has_value() ? std::move(*straight) : at::linear(x, weight, biased ? *bias : Tensor());
  if (!out.is_contiguous()) {
    out = out.contiguous();
  }
  if (out.numel() > 0) {
    dispatch_float(out.scalar_type(), [&](auto tag) { gelu_contiguous<decltype(tag)>(out, out); });
  }
  return out;
}

namespace {

// The executor's entry (entries.h): fast_gelu(x).
const EntryRegistrar kFastGeluEntry("fast_gelu", [](const EntryArgs& a) {
  return mindiesd_cpu::fast_gelu(a.tensor(0));
});

// The executor's entry (entries.h): linear_gelu(x, weight, bias).
const EntryRegistrar kLinearGeluEntry("linear_gelu", [](const EntryArgs& a) {
  return mindiesd_cpu::linear_gelu(a.tensor(0), a.tensor(1), a.optional_tensor(2));
});

}  // namespace

}  // namespace mindiesd_cpu
