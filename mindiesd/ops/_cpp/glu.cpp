// glu: act(gate) * value, row by row.  The two operands are the halves of
// x's last dim, read in place through x's strides (x is often itself a
// strided view of a wider projection), or x and y of one shape.  One read of
// each operand, one write of the output; 16-bit values are computed in
// float32 and rounded once.

#include "common.h"

#include <string>

namespace mindiesd_cpu {
namespace {

enum class Activation { kSilu, kGelu, kGeluTanh };

template <Activation A>
inline fVec activate(const fVec& v) {
  if constexpr (A == Activation::kSilu) {
    return silu(v);
  } else if constexpr (A == Activation::kGelu) {
    return gelu_erf(v);
  } else {
    return gelu_tanh(v);
  }
}

// out_row = act(gate_row) * value_row over ``walk.width`` values.
template <Activation A, typename T>
inline void glu_row(const RowWalk& walk, T* out_row, const T* gate_row, const T* value_row) {
  for_each_block(0, walk.width, walk.stream, [&](const auto& block) {
    const auto [g0, g1] = block.load(gate_row);
    const auto [v0, v1] = block.load(value_row);
    block.store(out_row, activate<A>(g0) * v0, activate<A>(g1) * v1);
  });
}

// x holds [first, second] along its last dim (unit stride).
template <Activation A, typename T>
void glu_halves(const Tensor& x, bool gate_first, Tensor& out) {
  const int64_t width = out.size(-1);
  const int64_t gate_offset = gate_first ? 0 : width;
  const int64_t value_offset = gate_first ? width : 0;
  auto body = [&](const RowWalk& walk, T* out_row, const T* x_row, float*) {
    glu_row<A, T>(walk, out_row, x_row + gate_offset, x_row + value_offset);
  };
  for_each_row<T, T>(out, {&x}, body);
}

// first = x, second = y (one shape, unit-stride last dims).
template <Activation A, typename T>
void glu_pair(const Tensor& x, const Tensor& y, bool gate_first, Tensor& out) {
  auto body = [&](const RowWalk& walk, T* out_row, const T* x_row, const T* y_row, float*) {
    if (gate_first) {
      glu_row<A, T>(walk, out_row, x_row, y_row);
    } else {
      glu_row<A, T>(walk, out_row, y_row, x_row);
    }
  };
  for_each_row<T, T, T>(out, {&x, &y}, body);
}

std::optional<Activation> parse_activation(const std::string& name) {
  if (name == "silu") {
    return Activation::kSilu;
  }
  if (name == "gelu") {
    return Activation::kGelu;
  }
  if (name == "gelu_tanh") {
    return Activation::kGeluTanh;
  }
  return std::nullopt;
}

template <typename F>
void dispatch_activation(Activation a, const F& f) {
  switch (a) {
    case Activation::kSilu:
      f(std::integral_constant<Activation, Activation::kSilu>{});
      break;
    case Activation::kGelu:
      f(std::integral_constant<Activation, Activation::kGelu>{});
      break;
    case Activation::kGeluTanh:
      f(std::integral_constant<Activation, Activation::kGeluTanh>{});
      break;
  }
}

Tensor with_unit_last_stride(const Tensor& t) {
  return (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
}

}  // namespace

std::optional<Tensor> glu(
    const Tensor& x, const std::optional<Tensor>& y, const std::string& activation, bool gate_first) {
  const std::optional<Activation> act = parse_activation(activation);
  if (!act || !on_cpu(x) || !is_covered_float(x.scalar_type()) || x.dim() < 1 || x.dim() - 1 > kMaxLeadingDims) {
    return std::nullopt;
  }
  if (y.has_value()) {
    if (!on_cpu(*y) || y->scalar_type() != x.scalar_type() || y->sizes() != x.sizes()) {
      return std::nullopt;
    }
  } else if (x.size(-1) % 2 != 0) {
    return std::nullopt;
  }
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // internal views skip autograd and view tracking
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  if (!y.has_value()) {
    sizes.back() /= 2;
  }
  Tensor out = empty_output(x, sizes, x.scalar_type());
  if (out.numel() == 0) {
    return out;
  }
  const Tensor first = with_unit_last_stride(x);
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    dispatch_activation(*act, [&](auto a) {
      if (y.has_value()) {
        glu_pair<decltype(a)::value, T>(first, with_unit_last_stride(*y), gate_first, out);
      } else {
        glu_halves<decltype(a)::value, T>(first, gate_first, out);
      }
    });
  });
  return out;
}

namespace {

// The executor's entry (entries.h): glu(x, y, activation, gate_first).
const EntryRegistrar kGluEntry("glu", [](const EntryArgs& a) {
  return mindiesd_cpu::glu(a.tensor(0), a.optional_tensor(1), a.to_string(2), a.to_bool(3));
});

}  // namespace

}  // namespace mindiesd_cpu
