// mul_add: x * y + z with broadcasting (a row loop when every operand has the
// output's last dim with unit stride, a TensorIterator otherwise).

#include "common.h"

#include <ATen/ExpandUtils.h>
#include <ATen/native/TensorIterator.h>
#include <ATen/native/cpu/Loops.h>

namespace mindiesd_cpu {
namespace {

template <typename T>
void mul_add_loop(at::TensorIteratorBase& iter) {
  if constexpr (std::is_same_v<T, float>) {
    at::native::cpu_kernel_vec(
        iter, [](float a, float b, float c) -> float { return a * b + c; },
        [](fVec a, fVec b, fVec c) -> fVec { return at::vec::fmadd(a, b, c); });
  } else {
    using Vec = at::vec::Vectorized<T>;
    at::native::cpu_kernel_vec(
        iter,
        [](T a, T b, T c) -> T {
          return static_cast<T>(static_cast<float>(a) * static_cast<float>(b) + static_cast<float>(c));
        },
        [](Vec a, Vec b, Vec c) -> Vec {
          auto [a0, a1] = at::vec::convert_to_float<T>(a);
          auto [b0, b1] = at::vec::convert_to_float<T>(b);
          auto [c0, c1] = at::vec::convert_to_float<T>(c);
          return from_float<T>(at::vec::fmadd(a0, b0, c0), at::vec::fmadd(a1, b1, c1));
        });
  }
}

// Operands with a unit-stride last dim of the output's width: row loop.
// TY/TZ are float when y/z were converted once (small, re-read operands).
template <typename T, typename TY, typename TZ>
void mul_add_rows(const Tensor& x, const Tensor& y, const Tensor& z, Tensor& out) {
  auto body = [&](const RowWalk& walk, T* outr, const T* xr, const TY* yr, const TZ* zr, float*) {
    for_each_block(0, walk.width, walk.stream, [&](const auto& block) {
      const auto [x0, x1] = block.load(xr);
      const auto [y0, y1] = block.load(yr);
      const auto [z0, z1] = block.load(zr);
      block.store(outr, at::vec::fmadd(x0, y0, z0), at::vec::fmadd(x1, y1, z1));
    });
  };
  for_each_row<T, T, TY, TZ>(out, {&x, &y, &z}, body);
}

// ``t`` broadcast to ``shape`` when its last dim is the output's with unit
// stride (the row loop's form), else an undefined tensor.
Tensor as_row_input(const Tensor& t, at::IntArrayRef shape) {
  if (t.dim() == 0 || t.size(-1) != shape.back() || (shape.back() > 1 && t.stride(-1) != 1)) {
    return Tensor();
  }
  return expanded(t, shape);
}

// The row loop when every operand has its form; false otherwise.
template <typename T>
bool mul_add_by_rows(Tensor x, Tensor y, Tensor z, Tensor& out) {
  const int64_t numel = out.numel();
  bool y_small = false;
  bool z_small = false;
  if constexpr (!std::is_same_v<T, float>) {
    if (is_small_operand(x, numel) && !is_small_operand(y, numel)) {
      std::swap(x, y);  // x * y == y * x: keep the small factor in y
    }
    // Small operands are widened once, before broadcasting (a copy of their size).
    y_small = is_small_operand(y, numel);
    z_small = is_small_operand(z, numel);
    if (y_small) {
      y = y.to(ScalarType::Float);
    }
    if (z_small) {
      z = z.to(ScalarType::Float);
    }
  }
  x = as_row_input(x, out.sizes());
  y = as_row_input(y, out.sizes());
  z = as_row_input(z, out.sizes());
  if (!x.defined() || !y.defined() || !z.defined()) {
    return false;
  }
  dispatch_float_or<T>(y_small, [&](auto y_tag) {
    dispatch_float_or<T>(z_small, [&](auto z_tag) {
      mul_add_rows<T, decltype(y_tag), decltype(z_tag)>(x, y, z, out);
    });
  });
  return true;
}

}  // namespace

std::optional<Tensor> mul_add(const Tensor& x, const Tensor& y, const Tensor& z) {
  if (!on_cpu(x) || !on_cpu(y) || !on_cpu(z) || !is_covered_float(x.scalar_type()) ||
      y.scalar_type() != x.scalar_type() || z.scalar_type() != x.scalar_type()) {
    return std::nullopt;
  }
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // internal views skip autograd and view tracking
  const std::vector<int64_t> shape = at::infer_size(at::infer_size(x.sizes(), y.sizes()), z.sizes());
  Tensor out = empty_output(x, shape, x.scalar_type());
  if (out.numel() == 0) {
    return out;
  }
  if (out.dim() >= 1 && out.dim() - 1 <= kMaxLeadingDims && out.size(-1) >= kLanes) {
    bool done = false;
    dispatch_float(x.scalar_type(), [&](auto tag) { done = mul_add_by_rows<decltype(tag)>(x, y, z, out); });
    if (done) {
      return out;
    }
  }
  auto iter = at::TensorIteratorConfig()
                  .add_output(out)
                  .add_const_input(x)
                  .add_const_input(y)
                  .add_const_input(z)
                  .build();
  dispatch_float(x.scalar_type(), [&](auto tag) { mul_add_loop<decltype(tag)>(iter); });
  return out;
}

namespace {

// The executor's entry (entries.h): mul_add(x, y, z).
const EntryRegistrar kMulAddEntry("mul_add", [](const EntryArgs& a) {
  return mindiesd_cpu::mul_add(a.tensor(0), a.tensor(1), a.tensor(2));
});

}  // namespace

}  // namespace mindiesd_cpu
