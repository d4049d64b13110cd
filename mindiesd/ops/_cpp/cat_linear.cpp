// cat_linear: a linear layer over the concatenation of its inputs along the
// last dim, as GEMMs of each input with its block of weight columns (views),
// the first one's with the bias making the output and the others accumulated
// into it in place: the concatenation is never written. float32 and float64
// only: in 16-bit dtypes the output would round the partial sums once more
// than eager's single GEMM.

#include "common.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/mm.h>

namespace mindiesd_cpu {

std::optional<Tensor> cat_linear(
    const std::vector<Tensor>& xs, const Tensor& weight, const std::optional<Tensor>& bias) {
  const bool biased = bias.has_value() && bias->defined();
  if (xs.size() < 2 || !on_cpu(weight) || weight.dim() != 2) {
    return std::nullopt;
  }
  const Tensor& first = xs[0];
  const ScalarType dtype = first.scalar_type();
  if ((dtype != ScalarType::Float && dtype != ScalarType::Double) || weight.scalar_type() != dtype ||
      first.dim() < 1 ||
      (biased && !(on_cpu(*bias) && bias->scalar_type() == dtype && bias->dim() == 1 &&
                   bias->size(0) == weight.size(0)))) {
    return std::nullopt;
  }
  const auto lead = first.sizes().slice(0, first.dim() - 1);
  int64_t width = 0;
  for (const Tensor& x : xs) {
    if (!on_cpu(x) || x.scalar_type() != dtype || x.dim() != first.dim() ||
        x.sizes().slice(0, x.dim() - 1) != lead) {
      return std::nullopt;
    }
    width += x.size(-1);
  }
  if (width != weight.size(1)) {
    return std::nullopt;
  }
  // Plain CPU tensors call the GEMM kernels straight (as the linear entry does), others go through the dispatcher.
  bool straight = plain_gemm_operands({&weight, biased ? &*bias : nullptr});
  for (const Tensor& x : xs) {
    straight = straight && plain_gemm_operands({&x});
  }
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // internal views skip autograd and view tracking
  std::vector<int64_t> shape(lead.begin(), lead.end());
  shape.push_back(weight.size(0));
  if (straight) {
    // Views made by hand, as the linear entry makes them.
    const int64_t n = weight.size(0);
    Tensor out = empty_output(first, shape, dtype);
    int64_t m = 1;
    for (const int64_t size : lead) {
      m *= size;
    }
    Tensor out_rows = alias_view(out, {m, n}, {n, 1}, 0);
    int64_t start = 0;
    for (const Tensor& x : xs) {
      const int64_t k = x.size(-1);
      const Tensor rows = x.dim() == 2 ? x
                          : x.is_contiguous() ? alias_view(x, {m, k}, {k, 1}, x.storage_offset())
                                              : x.reshape({m, k});
      const Tensor block = transposed_block(weight, start, k);
      if (start == 0) {
        gemm_rows_into(out_rows, rows, block, biased ? &*bias : nullptr);
      } else {
        at::cpu::addmm_(out_rows, rows, block);
      }
      start += k;
    }
    return out;
  }
  Tensor out;
  int64_t start = 0;
  for (const Tensor& x : xs) {
    const int64_t k = x.size(-1);
    const Tensor rows = x.reshape({-1, k});
    const Tensor block = weight.narrow(1, start, k).t();
    start += k;
    if (!out.defined()) {
      out = biased ? at::addmm(*bias, rows, block) : at::mm(rows, block);
    } else {
      out.addmm_(rows, block);
    }
  }
  return out.view(shape);
}

namespace {

// The executor's entry (entries.h): cat_linear(xs, weight, bias).
const EntryRegistrar kCatLinearEntry("cat_linear", [](const EntryArgs& a) {
  return mindiesd_cpu::cat_linear(a.tensors(0), a.tensor(1), a.optional_tensor(2));
});

}  // namespace

}  // namespace mindiesd_cpu
