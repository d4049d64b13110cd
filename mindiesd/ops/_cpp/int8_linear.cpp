// int8_linear: torchao's dynamic per-row int8 quantization of x, the int8 GEMM
// (ATen's _int_mm) and its rescale, with the roundings of torchao's unfused
// sequence (defs/int8_linear.py). One task per block of rows quantizes them
// (the row's minimum and maximum, then its int8 values, while the row is in
// cache); one task per block of output rows rescales the int32 product.
//
// Every step rounds where eager rounds: the scale in x's type, the products
// and the sum in their promoted types (16-bit types round through their
// vectors, float32 stays). The build uses -std=c++17, so no multiply-add is
// contracted into an FMA (which would round once where eager rounds twice).

#include "quantized.h"

#include <ATen/ops/_int_mm.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>

namespace mindiesd_cpu {
namespace {

constexpr float kHalfRange = 127.5f;
constexpr float kQMin = -128.0f;
constexpr float kQMax = 127.0f;

// A float32 value stored in T and read back (float: itself), as a tensor of T holds it.
template <typename T>
inline float stored(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return static_cast<float>(static_cast<T>(v));
  }
}

inline float nan_min(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return at::vec::minimum(a, b); }, v);
}

inline float nan_max(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, v);
}

// The float32 scale of one row of T: clamp(max(-min(amin, 0), max(amax, 0)) / 127.5, eps), rounded to T at
// each step as eager's ops of T round; NaN when the row holds a NaN.
template <typename T>
float row_scale(const T* row, int64_t width, float eps) {
  fVec low(0.0f), high(0.0f);  // minimum(amin, 0) and maximum(amax, 0); the partial block reads zeros
  for_each_block(0, width, false, [&](const auto& block) {
    const auto [a, b] = block.load(row);
    low = at::vec::minimum(low, at::vec::minimum(a, b));
    high = at::vec::maximum(high, at::vec::maximum(a, b));
  });
  const float lo = nan_min(low), hi = nan_max(high);
  if (std::isnan(lo) || std::isnan(hi)) {
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float amax_abs = std::max(-lo, hi);  // exact in T: a value of T and its negation
  const float scale = stored<T>(amax_abs / kHalfRange);
  const float floor = stored<T>(eps);
  return scale < floor ? floor : scale;
}

// Quantizes ``rows`` rows of x (contiguous [rows, width]) into ``q`` and their scales into ``scales``.
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t width, float eps, int8_t* q, float* scales) {
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    alignas(64) std::array<float, kBlock> values;
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * width;
      int8_t* out = q + r * width;
      const float scale = row_scale(row, width, eps);
      scales[r] = scale;
      const fVec inverse(1.0f / scale), lo(kQMin), hi(kQMax);
      for_each_block(0, width, false, [&](const auto& block) {
        auto [a, b] = block.load(row);
        // clamp(round(x * (1 / scale)), -128, 127); a NaN row gives any int8 here and a NaN output row later
        a = at::vec::clamp((a * inverse).round(), lo, hi);
        b = at::vec::clamp((b * inverse).round(), lo, hi);
        a.store(values.data());
        b.store(values.data() + kLanes);
        for (int64_t k = 0; k < block.n; ++k) {
          out[block.j + k] = static_cast<int8_t>(static_cast<int32_t>(values[k]));
        }
      });
    }
  });
}

// The product's rows are read through memcpy (a may-alias read) before the block is written, so ``out`` may be
// the product's own memory (a float32 output overwrites the int32 product in place).
//
// What step 5 rounds to: x's type T after the row scale (always), and T or float32 after the weight scale and
// after the bias (the promoted types), before the output's type TO.
template <typename T, typename TS, typename TB, typename TO>
void rescale_rows(const int32_t* acc, const float* scales, const TS* weight_scale, const TB* bias, TO* out,
                  int64_t rows, int64_t n, Epilogue rounding) {
  const bool stream = false;
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    alignas(64) std::array<int32_t, kBlock> products;
    alignas(64) std::array<float, kBlock> values;
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* in = acc + r * n;
      TO* result = out + r * n;
      const fVec scale(scales[r]);
      for_each_block(0, n, stream, [&](const auto& block) {
        std::memcpy(products.data(), in + block.j, sizeof(int32_t) * block.n);
        for (int64_t k = 0; k < block.n; ++k) {
          values[k] = static_cast<float>(products[k]);
        }
        fVec a = fVec::loadu(values.data()) * scale;
        fVec b = fVec::loadu(values.data() + kLanes) * scale;
        round_through<T>(a, b);
        finish_block<T>(block, a, b, weight_scale, bias, result, rounding);
      });
    }
  });
}

}  // namespace

std::optional<Tensor> int8_linear(const Tensor& x, const Tensor& weight, const Tensor& weight_scale,
                                  const std::optional<Tensor>& bias, double eps, ScalarType out_dtype) {
  const bool biased = bias.has_value() && bias->defined();
  const ScalarType t = x.scalar_type();
  if (!(eps > 0) || weight.scalar_type() != ScalarType::Char ||
      !covers_layer(x, weight, weight_scale, bias, out_dtype)) {
    return std::nullopt;  // K == 0 included: the composition's _int_mm says what it makes of it
  }
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // internal views skip autograd and view tracking
  const int64_t width = x.size(-1), n = weight.size(0);
  const int64_t rows = x.numel() / width;
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = n;
  if (rows == 0) {
    return empty_output(x, sizes, out_dtype);
  }
  const Tensor xc = x.is_contiguous() ? x : x.contiguous();
  Tensor q = empty_output(x, {rows, width}, ScalarType::Char);
  Tensor scales = empty_output(x, {rows}, ScalarType::Float);
  const Tensor ws = weight_scale.is_contiguous() ? weight_scale : weight_scale.contiguous();
  const Tensor b = biased ? (bias->is_contiguous() ? *bias : bias->contiguous()) : Tensor();
  // the product rounds to T where weight_scale is T (else float32), the sum where both it and the bias are
  const bool round_product = ws.scalar_type() == t;
  const bool round_sum = round_product && (!biased || b.scalar_type() == t);
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    quantize_rows<T>(xc.const_data_ptr<T>(), rows, width, static_cast<float>(eps), q.mutable_data_ptr<int8_t>(),
                     scales.mutable_data_ptr<float>());
  });
  Tensor acc = at::_int_mm(q, weight.t());
  if (!acc.is_contiguous()) {
    acc = acc.contiguous();
  }
  const Tensor& accc = acc;
  // a float32 output takes the product's memory (same element size, rows rescaled in place): no fresh buffer
  Tensor out = out_dtype == ScalarType::Float ? acc.view(ScalarType::Float).view(sizes)
                                              : empty_output(x, sizes, out_dtype);
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    dispatch_epilogue<T>(ws.scalar_type(), biased ? b.scalar_type() : t, out_dtype, [&](auto ts, auto tb, auto to) {
      using TS = decltype(ts);
      using TB = decltype(tb);
      using TO = decltype(to);
      rescale_rows<T, TS, TB, TO>(accc.const_data_ptr<int32_t>(), scales.const_data_ptr<float>(),
                                  ws.const_data_ptr<TS>(), biased ? b.const_data_ptr<TB>() : nullptr,
                                  out.mutable_data_ptr<TO>(), rows, n, Epilogue{round_product, round_sum});
    });
  });
  return out;
}

}  // namespace mindiesd_cpu
