// rms_norm: x / sqrt(mean(x^2) + eps) * weight, one row at a time.

#include "common.h"

#include <cmath>

namespace mindiesd_cpu {
namespace {

template <typename TX, typename TW, typename TO, bool kWeighted>
void rms_norm_kernel(const Tensor& x, const Tensor& weight, Tensor& out, float eps) {
  const float inv_width = 1.0f / static_cast<float>(x.size(-1));
  auto body = [&](const RowWalk& walk, TO* outr, const TX* xr, const TW* wr, float*) {
    const float mean_square = sum_of_squares(xr, walk.width) * inv_width;
    const fVec inv_rms(1.0f / std::sqrt(mean_square + eps));
    const TX* next_xr = xr + walk.next[0];
    for_each_block(0, walk.width, walk.stream, [&](const auto& block) {
      prefetch_bytes(next_xr + block.j, kBlock * sizeof(TX));
      const auto [a, b] = normed_block<TX, TW, kWeighted, false>(block, xr, wr, inv_rms);
      block.store(outr, a, b);
    });
  };
  if constexpr (kWeighted) {
    for_each_row<TO, TX, TW>(out, {&x, &weight}, body);
  } else {
    for_each_row<TO, TX>(out, {&x}, [&](const RowWalk& walk, TO* outr, const TX* xr, float* scratch) {
      body(walk, outr, xr, nullptr, scratch);
    });
  }
}

}  // namespace

std::optional<Tensor> rms_norm(
    const Tensor& x_in, const std::optional<Tensor>& weight_in, double eps, ScalarType out_dtype) {
  const bool weighted = weight_in.has_value() && weight_in->defined();
  if (!covers_rows(x_in, out_dtype) || (weighted && !covers_row_parameter(*weight_in, x_in))) {
    return std::nullopt;
  }
  return row_op(x_in, out_dtype, [&](const Tensor& x, Tensor& out) {
    Tensor weight;
    ScalarType w_dtype = ScalarType::Float;
    if (weighted) {
      w_dtype = parameter_dtype(x.scalar_type(), x.numel(), {&*weight_in});
      weight = as_row_operand(*weight_in, x.sizes(), x.size(-1), w_dtype);
    }
    const float eps_f = static_cast<float>(eps);
    dispatch_row_types(x.scalar_type(), w_dtype, out_dtype, [&](auto x_tag, auto w_tag, auto o_tag) {
      using TX = decltype(x_tag);
      using TW = decltype(w_tag);
      using TO = decltype(o_tag);
      if (weighted) {
        rms_norm_kernel<TX, TW, TO, true>(x, weight, out, eps_f);
      } else if constexpr (std::is_same_v<TW, float>) {
        rms_norm_kernel<TX, TW, TO, false>(x, weight, out, eps_f);
      }
    });
  });
}

namespace {

// The executor's entry (entries.h): rms_norm(x, weight, eps) with the resolved out_dtype.
const EntryRegistrar kRmsNormEntry("rms_norm", [](const EntryArgs& a) {
  return mindiesd_cpu::rms_norm(a.tensor(0), a.optional_tensor(1), a.to_double(2), a.out_dtype());
});

}  // namespace

}  // namespace mindiesd_cpu
