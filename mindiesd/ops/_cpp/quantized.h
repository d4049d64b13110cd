// What int8_linear.cpp and dequant_linear.cpp share: the epilogue after their
// GEMM (a scale per output column, the bias, each rounded where eager's
// promoted types round) and the dispatch over the dtypes it reads and writes.

#pragma once

#include "common.h"

#include <ATen/EmptyTensor.h>

namespace mindiesd_cpu {

// Whether a kernel covers a layer's operands: x [..., K] of a covered float type T on CPU, a 2-D weight [N, K]
// with N, K > 0 (its storage type is the caller's to check), N scales and a bias [N] (or none) each of T or
// float32, and an output of T or float32.
inline bool covers_layer(const Tensor& x, const Tensor& weight, const Tensor& weight_scale,
                         const std::optional<Tensor>& bias, ScalarType out_dtype) {
  const ScalarType t = x.scalar_type();
  auto pairs_with_x = [&](ScalarType d) { return d == t || d == ScalarType::Float; };
  const bool biased = bias.has_value() && bias->defined();
  return on_cpu(x) && on_cpu(weight) && on_cpu(weight_scale) && is_covered_float(t) && x.dim() >= 1 &&
         weight.dim() == 2 && weight.size(0) > 0 && weight.size(1) > 0 && weight.size(1) == x.size(-1) &&
         weight_scale.numel() == weight.size(0) && pairs_with_x(weight_scale.scalar_type()) &&
         pairs_with_x(out_dtype) &&
         (!biased || (on_cpu(*bias) && pairs_with_x(bias->scalar_type()) && bias->dim() == 1 &&
                      bias->size(0) == weight.size(0)));
}

// A dequantized weight's buffer of this thread, kept between calls and grown as needed (the bytes of the largest
// weight seen), shared by the quantized linear layers: a view of it as ``dtype`` [n, k].
inline Tensor scratch(int64_t n, int64_t k, ScalarType dtype) {
  thread_local Tensor buffer;
  const int64_t bytes = n * k * static_cast<int64_t>(c10::elementSize(dtype));
  if (!buffer.defined() || buffer.nbytes() < static_cast<size_t>(bytes)) {
    buffer = at::detail::empty_cpu({bytes}, ScalarType::Byte, /*pin_memory=*/false, at::MemoryFormat::Contiguous);
  }
  return buffer.view(ScalarType::Byte).slice(0, 0, bytes).view(dtype).view({n, k});
}

// Rounding of the epilogue's steps to x's type T: after the scale (where the
// scale is T) and after the bias (where the product and the bias are T).
struct Epilogue {
  bool round_product;
  bool round_sum;
};

// One block of an output row: ``a, b`` (float32 values of the GEMM's row) times
// ``scale`` (none: nullptr), plus ``bias`` (none: nullptr), stored into ``row``
// as its type TO.
template <typename T, typename TS, typename TB, typename TO, typename BlockT>
inline void finish_block(const BlockT& block, fVec a, fVec b, const TS* scale, const TB* bias, TO* row,
                         Epilogue rounding) {
  if (scale != nullptr) {
    const auto [sa, sb] = block.load(scale);
    a = a * sa;
    b = b * sb;
    if (rounding.round_product) {
      round_through<T>(a, b);
    }
  }
  if (bias != nullptr) {
    const auto [ba, bb] = block.load(bias);
    a = a + ba;
    b = b + bb;
    if (rounding.round_sum) {
      round_through<T>(a, b);
    }
  }
  block.store(row, a, b);
}

// Calls f(TS{}, TB{}, TO{}): each of the scale's, the bias's and the output's
// types is float32 or x's type T.
template <typename T, typename F>
void dispatch_epilogue(ScalarType scale, ScalarType bias, ScalarType out, const F& f) {
  auto pick = [](ScalarType t, const auto& g) {
    if (t == ScalarType::Float) {
      g(float{});
    } else {
      g(T{});
    }
  };
  pick(scale, [&](auto ts) {
    pick(bias, [&](auto tb) { pick(out, [&](auto to) { f(ts, tb, to); }); });
  });
}

}  // namespace mindiesd_cpu
