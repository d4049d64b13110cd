// cat_linear: a linear layer over the concatenation of its inputs along the
// last dim, as GEMMs of each input with its block of weight columns (views),
// the first one's with the bias making the output and the others accumulated
// into it in place: the concatenation is never written. float32 and float64
// only: in 16-bit dtypes the output would round the partial sums once more
// than eager's single GEMM.

#include "common.h"

#include <ATen/ops/addmm.h>
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
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // internal views skip autograd and view tracking
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
  std::vector<int64_t> shape(lead.begin(), lead.end());
  shape.push_back(weight.size(0));
  return out.view(shape);
}

}  // namespace mindiesd_cpu
