// adalayernorm: layer_norm(x) * (1 + scale) + shift, one row at a time.

#include "common.h"

#include <cmath>

namespace mindiesd_cpu {
namespace {

// Sum of the row; when ``copy`` is given, also stores the row there as float32.
template <typename T>
inline float row_sum(const T* p, int64_t width, float* copy) {
  return reduce_row(
      p, width, [](const fVec& acc, const fVec& v) { return acc + v; },
      [&](const auto& block, const fVec& a, const fVec& b) {
        if (copy != nullptr) {
          block.store(copy, a, b);
        }
      });
}

// Sums of d = x - mean and of d^2 over a float32 row, as {sum d, sum d^2}.
inline std::pair<float, float> centered_sums(const float* p, int64_t width, const fVec& mean) {
  fVec sum0(0.0f), sum1(0.0f), sq0(0.0f), sq1(0.0f), sq2(0.0f), sq3(0.0f);
  int64_t j = 0;
  for (; j + 4 * kLanes <= width; j += 4 * kLanes) {
    const fVec a = fVec::loadu(p + j) - mean;
    const fVec b = fVec::loadu(p + j + kLanes) - mean;
    const fVec c = fVec::loadu(p + j + 2 * kLanes) - mean;
    const fVec d = fVec::loadu(p + j + 3 * kLanes) - mean;
    sum0 = sum0 + (a + b);
    sum1 = sum1 + (c + d);
    sq0 = at::vec::fmadd(a, a, sq0);
    sq1 = at::vec::fmadd(b, b, sq1);
    sq2 = at::vec::fmadd(c, c, sq2);
    sq3 = at::vec::fmadd(d, d, sq3);
  }
  for (; j < width; j += kLanes) {
    const int64_t n = std::min(kLanes, width - j);
    // Lanes past the row must add nothing (a zero-filled lane would add -mean).
    const fVec a = n == kLanes ? fVec::loadu(p + j) - mean
                               : fVec::set(fVec(0.0f), fVec::loadu(p + j) - mean, n);
    sum0 = sum0 + a;
    sq0 = at::vec::fmadd(a, a, sq0);
  }
  return {horizontal_sum(sum0 + sum1), horizontal_sum((sq0 + sq1) + (sq2 + sq3))};
}

// 1 + scale is formed in float32 in the loop: two vector adds per block cost less than a tensor of 1 + scale
// made per call (an allocation and a kernel, which dominate at small sizes), and round the same.
template <typename TX, typename TP, typename TO>
void adalayernorm_kernel(
    const Tensor& x, const Tensor& scale, const Tensor& shift, Tensor& out, float eps) {
  const int64_t width = x.size(-1);
  const float inv_width = 1.0f / static_cast<float>(width);
  const fVec one(1.0f);
  // 16-bit rows are widened once into a float32 row buffer (L1-resident).
  constexpr bool kWiden = !std::is_same_v<TX, float>;

  auto body = [&](const RowWalk& walk, TO* outr, const TX* xr, const TP* sr, const TP* hr, float* scratch) {
    const float first_mean = row_sum(xr, width, kWiden ? scratch : nullptr) * inv_width;
    const float* values = kWiden ? scratch : reinterpret_cast<const float*>(xr);
    // Corrected two-pass statistics: the centered sum refines the mean.
    const auto [centered, squares] = centered_sums(values, width, fVec(first_mean));
    const float correction = centered * inv_width;
    const fVec mean(first_mean + correction);
    const float variance = std::max(squares * inv_width - correction * correction, 0.0f);
    const fVec rstd(1.0f / std::sqrt(variance + eps));

    const TX* next_xr = xr + walk.next[0];
    for_each_block(0, width, walk.stream, [&](const auto& block) {
      prefetch_bytes(next_xr + block.j, kBlock * sizeof(TX));
      auto [a, b] = block.load(values);
      auto [s0, s1] = block.load(sr);
      const auto [h0, h1] = block.load(hr);
      s0 = s0 + one;
      s1 = s1 + one;
      a = at::vec::fmadd((a - mean) * rstd, s0, h0);
      b = at::vec::fmadd((b - mean) * rstd, s1, h1);
      block.store(outr, a, b);
    });
  };
  for_each_row<TO, TX, TP, TP>(out, {&x, &scale, &shift}, body, kWiden ? width : 0);
}

}  // namespace

std::optional<Tensor> adalayernorm(
    const Tensor& x_in, const Tensor& scale_in, const Tensor& shift_in, double eps, ScalarType out_dtype) {
  if (!covers_rows(x_in, out_dtype) || !covers_row_parameter(scale_in, x_in) ||
      !covers_row_parameter(shift_in, x_in)) {
    return std::nullopt;
  }
  return row_op(x_in, out_dtype, [&](const Tensor& x, Tensor& out) {
    const int64_t width = x.size(-1);
    const ScalarType p_dtype = parameter_dtype(x.scalar_type(), x.numel(), {&scale_in, &shift_in});
    const Tensor scale = as_row_operand(scale_in, x.sizes(), width, p_dtype);
    const Tensor shift = as_row_operand(shift_in, x.sizes(), width, p_dtype);
    const float eps_f = static_cast<float>(eps);
    dispatch_row_types(x.scalar_type(), p_dtype, out_dtype, [&](auto x_tag, auto p_tag, auto o_tag) {
      adalayernorm_kernel<decltype(x_tag), decltype(p_tag), decltype(o_tag)>(x, scale, shift, out, eps_f);
    });
  });
}

namespace {

// The executor's entry (entries.h): adalayernorm(x, scale, shift, eps) with the resolved out_dtype.
const EntryRegistrar kAdaLayerNormEntry("adalayernorm", [](const EntryArgs& a) {
  return mindiesd_cpu::adalayernorm(a.tensor(0), a.tensor(1), a.tensor(2), a.to_double(3), a.out_dtype());
});

}  // namespace

}  // namespace mindiesd_cpu
